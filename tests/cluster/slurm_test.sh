#!/usr/bin/env bash
# srun -n 2 (Slurm) starts two fashion_mnist_ddp processes without chorus run: they must find each
# other from Slurm's variables alone (env:// rendezvous: SLURM_PROCID, SLURM_STEP_NUM_TASKS, the
# first host of SLURM_STEP_NODELIST, a port derived from SLURM_JOB_ID and SLURM_STEP_ID) and train
# as one job of 2 ranks.
#
# The test brings up a private single-host Slurm cluster in a temporary directory: its own munge
# key and socket, a slurm.conf (found through SLURM_CONF, so /etc/slurm is never read), free ports
# for slurmctld and slurmd, and the daemons in the foreground under a watchdog. It always stops
# them and removes the directory, also when it fails or is interrupted. Needs root (slurmd starts
# tasks as their user) and Debian's slurm-wlm and munge.
#
#   tests/cluster/slurm_test.sh build/bin/fashion_mnist_ddp
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/cluster/common.sh
. "$here/common.sh"

bin=${1:?usage: slurm_test.sh FASHION_MNIST_DDP_BINARY}
[ -x "$bin" ] || fail "$bin is not an executable"
bin=$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")
for tool in slurmctld slurmd srun sinfo squeue scancel munged munge unmunge; do
  command -v "$tool" > /dev/null || skip "$tool not found (Debian: slurm-wlm and munge)"
done
command -v python3 > /dev/null || skip "python3 not found (picks free ports, checks the metrics)"
[ "$(id -u)" -eq 0 ] || skip "not root: a private slurmd must run as root to start tasks"

# Bounds, in seconds: well inside the ctest TIMEOUT, so the cleanup below always gets to run.
readonly start_limit=60 job_limit=240 watchdog=420

tmp=$(mktemp -d "${TMPDIR:-/tmp}/chorus-slurm-test-XXXXXX")
pids=()  # daemons started here (their watchdog's pid), stopped in this order's reverse
job=     # srun (its timeout's pid) while it runs

cleanup() {
  local rc=$? i pid
  trap - EXIT INT TERM
  [ -n "$job" ] && kill -TERM "$job" 2> /dev/null
  if [ -n "${SLURM_CONF:-}" ] && [ -f "$SLURM_CONF" ]; then
    # Jobs first, so no slurmstepd outlives its slurmd.
    scancel --quiet --user="$(id -un)" > /dev/null 2>&1
    for i in $(seq 20); do
      [ -z "$(squeue -h -o %i 2> /dev/null)" ] && break
      sleep 0.5
    done
  fi
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill -TERM "${pids[i]}" 2> /dev/null
  done
  for pid in "${pids[@]}"; do
    for i in $(seq 20); do
      kill -0 "$pid" 2> /dev/null || break
      sleep 0.25
    done
    kill -KILL "$pid" 2> /dev/null
    wait "$pid" 2> /dev/null
  done
  rm -rf "$tmp"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

clean_launcher_env

# Starts a daemon in the foreground under a watchdog (it dies on its own should this script be
# killed before its cleanup runs); output to $tmp/NAME.out.
start_daemon() {
  local name=$1
  shift
  timeout -k 5 "$watchdog" "$@" > "$tmp/$name.out" 2>&1 &
  pids+=($!)
}

alive() { kill -0 "${pids[$1]}" 2> /dev/null; }

# munge: a fresh key and a socket of our own, so the system's munged (if any) is not involved.
head -c 1024 /dev/urandom > "$tmp/munge.key"
chmod 400 "$tmp/munge.key"
start_daemon munged munged --foreground --force --socket="$tmp/munge.sock" \
  --key-file="$tmp/munge.key" --pid-file="$tmp/munged.pid" --seed-file="$tmp/munged.seed" \
  --log-file="$tmp/munged.log"
for i in $(seq 40); do
  [ -S "$tmp/munge.sock" ] && break
  alive 0 || break
  sleep 0.25
done
if ! munge -S "$tmp/munge.sock" -n 2> "$tmp/munge.err" |
  unmunge -S "$tmp/munge.sock" > /dev/null 2>> "$tmp/munge.err"; then
  show_tail "$tmp/munged.out" "$tmp/munge.err"
  skip "munged does not start or does not answer here (see above)"
fi

# Two free TCP ports for slurmctld and slurmd.
read -r ctld_port slurmd_port < <(python3 -c '
import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(*(x.getsockname()[1] for x in s))')

# This host's real CPU layout (slurmd refuses a node that claims more than it has), named
# "localhost" so that the node list, and with it the master address, is "localhost".
node=$(slurmd -C 2> /dev/null | head -n 1)
case "$node" in NodeName=*) ;; *) skip "slurmd -C does not describe this host: $node" ;; esac
node="NodeName=localhost NodeAddr=127.0.0.1 ${node#NodeName=* }"
cpus=$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<< "$node")
mkdir -p "$tmp/state" "$tmp/spool"
cat > "$tmp/slurm.conf" <<CONF
ClusterName=chorustest
SlurmctldHost=localhost
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$tmp/munge.sock
StateSaveLocation=$tmp/state
SlurmdSpoolDir=$tmp/spool
SlurmctldPidFile=$tmp/slurmctld.pid
SlurmdPidFile=$tmp/slurmd.pid
SlurmctldLogFile=$tmp/slurmctld.log
SlurmdLogFile=$tmp/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
$node State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF=$tmp/slurm.conf

start_daemon slurmctld slurmctld -D -c
start_daemon slurmd slurmd -D -N localhost
state=
for i in $(seq $((start_limit * 2))); do
  state=$(sinfo -h -n localhost -o %T 2> /dev/null)
  [ "$state" = idle ] && break
  if ! alive 1 || ! alive 2; then break; fi
  sleep 0.5
done
if [ "$state" != idle ]; then
  show_tail "$tmp/slurmctld.out" "$tmp/slurmctld.log" "$tmp/slurmd.out" "$tmp/slurmd.log"
  skip "the private Slurm cluster did not come up within $start_limit s" \
    "(node state '$state'; logs above)"
fi
echo "$(sinfo -V): private cluster up in $tmp (node: $node)"

# srun -n 2: both tasks on this host. With a single CPU, --overcommit lets two tasks share it.
overcommit=()
[ "${cpus:-1}" -ge 2 ] || overcommit=(--overcommit)
echo "running: srun -n 2 $bin --max-steps 5 ..."
start=$SECONDS
FAIL_CONTEXT="$tmp/slurmctld.log $tmp/slurmd.log"
cd "$tmp" || fail "cannot enter $tmp"
# Without a launcher that makes one up, the ranks need a shared secret (docs/launch-env.md); srun
# passes the environment on.
CHORUS_JOB_TOKEN=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
export CHORUS_JOB_TOKEN
run_job "$tmp/output.log" "$job_limit" srun srun -n 2 "${overcommit[@]}" \
  --job-name=chorus-env-test --time=5 --kill-on-bad-exit=1 --wait=60 \
  "$bin" --max-steps 5 --eval-limit 200 --no-checkpoint --log-every 1 --metrics-json "$tmp/metrics.json"
check_metrics "$tmp/metrics.json" 2 5
echo "PASS: srun -n 2 ran fashion_mnist_ddp as one job of 2 ranks in $((SECONDS - start)) s"
