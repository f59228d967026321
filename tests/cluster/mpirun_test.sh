#!/usr/bin/env bash
# mpirun -np 2 (Open MPI) starts two fashion_mnist_ddp processes without chorus run: they must find
# each other from Open MPI's variables alone (env:// rendezvous: OMPI_COMM_WORLD_RANK and _SIZE,
# master 127.0.0.1, port derived from OMPI_MCA_ess_base_jobid) and train as one job of 2 ranks.
#
#   tests/cluster/mpirun_test.sh build/bin/fashion_mnist_ddp
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/cluster/common.sh
. "$here/common.sh"

bin=${1:?usage: mpirun_test.sh FASHION_MNIST_DDP_BINARY}
[ -x "$bin" ] || fail "$bin is not an executable"
command -v mpirun > /dev/null || skip "mpirun not found (Debian: openmpi-bin)"
version=$(mpirun --version 2>&1 | head -n 1)
case "$version" in
  *"Open MPI"* | *"Open RTE"*) ;;
  *) skip "mpirun is not Open MPI's: $version" ;;
esac
command -v python3 > /dev/null || skip "python3 not found (checks the metrics JSON)"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/chorus-mpirun-test-XXXXXX")
job=  # mpirun (its timeout's pid) while it runs
trap '[ -n "$job" ] && kill -TERM "$job" 2> /dev/null && wait "$job"; rm -rf "$tmp"' EXIT
trap 'exit 130' INT TERM

clean_launcher_env
# Open MPI refuses to run as root without both the flag and these.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

echo "$version; running: mpirun -np 2 $bin --max-steps 5 ..."
start=$SECONDS
# Without a launcher that makes one up, the ranks need a shared secret (docs/launch-env.md).
CHORUS_JOB_TOKEN=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
export CHORUS_JOB_TOKEN
run_job "$tmp/output.log" 240 mpirun mpirun --allow-run-as-root --oversubscribe -np 2 -x CHORUS_JOB_TOKEN \
  "$bin" --max-steps 5 --eval-limit 200 --no-checkpoint --log-every 1 --metrics-json "$tmp/metrics.json"
check_metrics "$tmp/metrics.json" 2 5
echo "PASS: mpirun -np 2 ran fashion_mnist_ddp as one job of 2 ranks in $((SECONDS - start)) s"
