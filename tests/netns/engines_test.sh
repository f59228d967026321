#!/bin/bash
# Cluster engines on two hosts: two network namespaces joined by a veth pair (scripts/two_hosts.sh),
# each pod (host) given exactly the variables its engine sets and running the unchanged command that
# engine would run, training the Fashion-MNIST harness (bench/fashion_mnist_ddp) for a few steps:
#
#   pytorchjob-v1-n1  Kubeflow training operator v1, nprocPerNode 1: MASTER_ADDR/PORT, WORLD_SIZE,
#                     RANK (the pod's index), PET_NPROC_PER_NODE, PET_NODE_RANK, PET_NNODES; the
#                     program alone in each pod
#   pytorchjob-v1-n2  the same with nprocPerNode 2 (WORLD_SIZE 4, RANK still the pod's index);
#                     `chorus run PROGRAM` in each pod
#   trainer-v2        Kubeflow Trainer v2: PET_* only; `chorus run PROGRAM`
#   jobset            JOB_COMPLETION_INDEX; `chorus run --nnodes 2 --master-addr A --master-port P PROGRAM`
#   ray               RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR/PORT;
#                     the program (Ray starts each rank)
#
# Each must train to the same result (world size, transport, steps, rank 0's last loss and test
# accuracy) as the same job under `chorus run --nnodes 2 --node-rank I --rdzv-endpoint A:P` with 1
# (or 2) ranks per host, run here first. Every pod gets the job token as a mounted Secret would
# give it (CHORUS_JOB_TOKEN_FILE) or as its value (CHORUS_JOB_TOKEN, for the programs run alone).
#
#   engines_test.sh CHORUS FASHION_MNIST_DDP
#
# Needs root and `ip netns`; exits 77 (skip) where the namespaces cannot be made. Everything it
# makes (namespaces, veth, processes, files) is removed on every exit.
set -euo pipefail

[[ $# -eq 2 ]] || { echo "usage: $0 CHORUS FASHION_MNIST_DDP" >&2; exit 2; }
CHORUS=$(realpath "$1")
PROGRAM=$(realpath "$2")
STEPS=5
TIMEOUT_S=120

skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }

# shellcheck source-path=SCRIPTDIR source=../../scripts/two_hosts.sh
source "$(dirname "$(realpath "$0")")/../../scripts/two_hosts.sh"
two_hosts_check || skip "$TWO_HOSTS_WHY"

PORT=$((29000 + RANDOM % 1000))  # fresh namespaces: nothing else listens there; one port per job
WORK=$(mktemp -d /tmp/chorus-engines-XXXXXX)
PIDS=()
two_hosts_traps  # on exit: stop PIDS, remove the hosts and WORK

two_hosts_up || skip "$TWO_HOSTS_WHY"
echo "hosts: $NS_A ($ADDR_A, pod 0) and $NS_B ($ADDR_B, pod 1)"
(umask 077 && head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$WORK/token")

# job NAME CMD_0 CMD_1: pod 0 runs the shell command CMD_0 in host A, pod 1 CMD_1 in host B, with
# A (host A's address), P (a fresh port), CHORUS, PROGRAM, ARGS (the harness's arguments, ending in
# --metrics-json: rank 0 writes NAME.json) and TOKEN_FILE set.
job() {
  local name=$1 pod pid rc=0
  shift
  PORT=$((PORT + 1))
  local pids=()
  for pod in 0 1; do
    local ns=$NS_A
    [[ $pod -eq 1 ]] && ns=$NS_B
    (cd "$WORK" && two_hosts_exec "$ns" env A="$ADDR_A" P="$PORT" CHORUS="$CHORUS" PROGRAM="$PROGRAM" \
      TOKEN_FILE="$WORK/token" ARGS="--max-steps $STEPS --eval-limit 200 --no-checkpoint --metrics-json $WORK/$name.json" \
      timeout "$TIMEOUT_S" bash -c "$1") >"$WORK/$name.$pod.log" 2>&1 &
    pids+=($!)
    PIDS+=($!)
    shift
  done
  for pid in "${pids[@]}"; do
    wait "$pid" || rc=$?
  done
  if [[ $rc -ne 0 ]]; then
    for pod in 0 1; do
      echo "--- $name, pod $pod, last 20 lines:"
      tail -n 20 "$WORK/$name.$pod.log" | sed 's/^/    | /'
    done
    fail "$name: a pod exited with $rc"
  fi
  [[ -s $WORK/$name.json ]] || fail "$name: no metrics from rank 0"
}

# same NAME REF: NAME trained as REF did.
same() {
  python3 - "$WORK/$1.json" "$WORK/$2.json" "$1" "$2" <<'PY' || fail "$1 did not train as $2 did"
import json, sys
got, want = (json.load(open(p)) for p in sys.argv[1:3])
bad = ["%s %r vs %r" % (k, got[k], want[k]) for k in ("world_size", "transport", "steps") if got[k] != want[k]]
if abs(got["last_loss"] - want["last_loss"]) > 1e-5 or got["test_accuracy"] != want["test_accuracy"]:
    bad.append("last loss %r vs %r, test accuracy %r vs %r" % (got["last_loss"], want["last_loss"],
                                                             got["test_accuracy"], want["test_accuracy"]))
print("%-17s world %d (%s), %d steps, last loss %.6f, test accuracy %.4f: %s" % (
    sys.argv[3], got["world_size"], got["transport"], got["steps"], got["last_loss"], got["test_accuracy"],
    "as " + sys.argv[4] if not bad else "DIFFERS: " + "; ".join(bad)))
sys.exit(1 if bad else 0)
PY
}

for n in 1 2; do
  job "chorus-run-n$n" \
    "exec \$CHORUS run --nnodes 2 --node-rank 0 --rdzv-endpoint \$A:\$P --token-file \$TOKEN_FILE -n $n \$PROGRAM \$ARGS" \
    "exec \$CHORUS run --nnodes 2 --node-rank 1 --rdzv-endpoint \$A:\$P --token-file \$TOKEN_FILE -n $n \$PROGRAM \$ARGS"
done

v1() {  # v1 POD NPROC: training operator v1's variables for pod POD of 2
  echo "MASTER_ADDR=\$A MASTER_PORT=\$P WORLD_SIZE=$((2 * $2)) RANK=$1 PET_NPROC_PER_NODE=$2 PET_NODE_RANK=$1" \
    "PET_NNODES=2 PYTHONUNBUFFERED=0 CHORUS_JOB_TOKEN=\$(cat \$TOKEN_FILE)"
}
job pytorchjob-v1-n1 "$(v1 0 1) exec \$PROGRAM \$ARGS" "$(v1 1 1) exec \$PROGRAM \$ARGS"
same pytorchjob-v1-n1 chorus-run-n1
job pytorchjob-v1-n2 "$(v1 0 2) CHORUS_JOB_TOKEN_FILE=\$TOKEN_FILE exec \$CHORUS run \$PROGRAM \$ARGS" \
  "$(v1 1 2) CHORUS_JOB_TOKEN_FILE=\$TOKEN_FILE exec \$CHORUS run \$PROGRAM \$ARGS"
same pytorchjob-v1-n2 chorus-run-n2

v2() {  # v2 POD: Trainer v2's PET_ variables for pod POD of 2, one process each
  echo "PET_NNODES=2 PET_NPROC_PER_NODE=1 PET_NODE_RANK=$1 PET_MASTER_ADDR=\$A PET_MASTER_PORT=\$P" \
    "CHORUS_JOB_TOKEN_FILE=\$TOKEN_FILE"
}
job trainer-v2 "$(v2 0) exec \$CHORUS run \$PROGRAM \$ARGS" "$(v2 1) exec \$CHORUS run \$PROGRAM \$ARGS"
same trainer-v2 chorus-run-n1

jobset() {  # jobset POD: an indexed Job's pod
  echo "JOB_COMPLETION_INDEX=$1 CHORUS_JOB_TOKEN_FILE=\$TOKEN_FILE exec \$CHORUS run --nnodes 2" \
    "--master-addr \$A --master-port \$P \$PROGRAM \$ARGS"
}
job jobset "$(jobset 0)" "$(jobset 1)"
same jobset chorus-run-n1

ray() {  # ray POD: what Ray Train sets for the rank it starts on node POD
  echo "RANK=$1 LOCAL_RANK=0 WORLD_SIZE=2 LOCAL_WORLD_SIZE=1 NODE_RANK=$1 MASTER_ADDR=\$A MASTER_PORT=\$P" \
    "CHORUS_JOB_TOKEN=\$(cat \$TOKEN_FILE) exec \$PROGRAM \$ARGS"
}
job ray "$(ray 0)" "$(ray 1)"
same ray chorus-run-n1
echo "PASS"
