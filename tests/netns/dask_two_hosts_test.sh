#!/bin/bash
# chorus.dask across two hosts: two network namespaces joined by a veth pair (scripts/two_hosts.sh),
# a dask-scheduler and a dask-worker in host A, a dask-worker in host B, and the client
# (tests/python/dask_two_hosts.py) in host A: DDP over chorus across the hosts, then host B's worker
# SIGKILLed mid-training.
#
#   dask_two_hosts_test.sh PYTHONPATH_OF_CHORUS [CHORUS TRANSFER]   (with them: run_program of transfer too)
#
# Needs root, `ip netns` and python3-distributed; exits 77 (skip) where the namespaces cannot be
# made. Everything it makes (namespaces, veth, processes, files) is removed on every exit.
set -euo pipefail

[[ $# -eq 1 || $# -eq 3 ]] || { echo "usage: $0 PYTHONPATH_OF_CHORUS [CHORUS TRANSFER]" >&2; exit 2; }
PROGRAMS=()
[[ $# -eq 3 ]] && PROGRAMS=("$(realpath "$2")" "$(realpath "$3")")
HERE=$(dirname "$(realpath "$0")")
export PYTHONPATH="$(realpath "$1"):$HERE/../python"
PY=/usr/bin/python3

skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }

# shellcheck source-path=SCRIPTDIR source=../../scripts/two_hosts.sh
source "$HERE/../../scripts/two_hosts.sh"
two_hosts_check || skip "$TWO_HOSTS_WHY"
command -v dask-scheduler >/dev/null && command -v dask-worker >/dev/null || skip "no dask-scheduler/dask-worker (python3-distributed)"

PORT=$((29000 + RANDOM % 1000))  # fresh namespaces: nothing else listens there
WORK=$(mktemp -d /tmp/chorus-dask-netns-XXXXXX)
# The workers' and the client's temporary files (rank scratch directories, Dask's worker space) in
# WORK: a rank task sweeps the scratch of dead workers in its TMPDIR, and another job on this
# machine must not sweep this one's before the test has looked.
export TMPDIR=$WORK/tmp
mkdir "$TMPDIR"
PIDS=()
two_hosts_traps  # on exit: stop PIDS, remove the hosts and WORK

two_hosts_up || skip "$TWO_HOSTS_WHY"
echo "hosts: $NS_A ($ADDR_A: scheduler, worker, client) and $NS_B ($ADDR_B: worker)"
start() {  # start NS NAME CMD...: in its own working directory, output to NAME.log
  local ns=$1 name=$2
  shift 2
  mkdir -p "$WORK/$name"
  (cd "$WORK/$name" && two_hosts_exec "$ns" "$@") >"$WORK/$name.log" 2>&1 &
  PIDS+=($!)
}
start "$NS_A" scheduler dask-scheduler --host "$ADDR_A" --port "$PORT" --no-dashboard
start "$NS_A" worker-a dask-worker "tcp://$ADDR_A:$PORT" --host "$ADDR_A" --nworkers 1 --nthreads 1 --no-dashboard
start "$NS_B" worker-b dask-worker "tcp://$ADDR_A:$PORT" --host "$ADDR_B" --nworkers 1 --nthreads 1 --no-dashboard

if ! (cd "$WORK" && two_hosts_exec "$NS_A" timeout 240 "$PY" "$HERE/../python/dask_two_hosts.py" \
      "tcp://$ADDR_A:$PORT" "$ADDR_A" "$ADDR_B" "${PROGRAMS[@]}") >"$WORK/client.log" 2>&1; then
  cat "$WORK/client.log"
  for n in scheduler worker-a worker-b; do
    echo "--- $n, last 20 lines:"
    tail -n 20 "$WORK/$n.log" | sed 's/^/    | /'
  done
  fail "the client reported problems (above)"
fi
grep -E "^(OK|MISMATCH)" "$WORK/client.log"
echo "PASS"
