#!/bin/bash
# An elastic job on three hosts: three network namespaces on a bridge (scripts/hosts.sh), one
# `chorus run --nnodes 2:3` in each, training the Fashion-MNIST example (the Accelerator, a state
# saved every EVERY steps). Once the job runs on three hosts and has saved its state past step
# KILL_AT, host C dies (every process in its namespace SIGKILLed at once); the job must re-form on
# A and B and go on from the saved state. Once it has saved its state at two hosts, a new launcher
# starts on C; the job must grow back to three (A and B stop their workers with SIGTERM, which
# saves the state) and finish.
#
#   elastic_test.sh CHORUS FASHION_MNIST
#
# Checks: every launcher exits 0 (the last one on C too); A's log has rounds of 3, then 2, then 3
# nodes, the middle one after a failure, the last after a membership change; the run's records
# hold every step from 1 to STEPS once, their samples per step say 3, then 2, then 3 ranks, and the
# summary says finished at world size 3; the final test accuracy is within TOLERANCE of the same
# job run uninterrupted on three ranks (run first, here).
#
# Needs root and `ip netns`; exits 77 (skip) where the namespaces or the bridge cannot be made.
# Everything it makes (namespaces, processes, files) is removed on every exit.
set -euo pipefail

if [[ $# -ne 2 ]]; then
  echo "usage: $0 CHORUS FASHION_MNIST" >&2
  exit 2
fi
CHORUS=$(realpath "$1")
FASHION_MNIST=$(realpath "$2")
STEPS=160
EVERY=10      # the example's --checkpoint-every
KILL_AT=30    # host C dies once a state at this step or later is saved at three hosts
GROW_AFTER=30 # C comes back once the two hosts saved a state this many steps past the kill
BATCH=64      # the example's default batch per rank: samples per step = 64 x world size
TOLERANCE=0.03
TIMEOUT_S=240

skip() {
  echo "SKIP: $*"
  exit 77
}
fail() {
  echo "FAIL: $*"
  show_logs
  exit 1
}
show_logs() {
  local n
  for n in A B C C2; do
    [[ -f $WORK/$n.log ]] || continue
    echo "--- host $n's launcher, last 25 lines:"
    tail -n 25 "$WORK/$n.log" | sed 's/^/    | /'
  done
}

# shellcheck source-path=SCRIPTDIR source=../../scripts/hosts.sh
source "$(dirname "$(realpath "$0")")/../../scripts/hosts.sh"
hosts_check || skip "$HOSTS_WHY"
[[ -x $CHORUS ]] || { echo "FAIL: no executable chorus at $CHORUS"; exit 1; }
[[ -x $FASHION_MNIST ]] || { echo "FAIL: no executable fashion_mnist at $FASHION_MNIST"; exit 1; }
DATA=${FASHION_MNIST_DATA:-/usr/share/datasets/fashion-mnist}
[[ -d $DATA ]] || skip "no Fashion-MNIST at $DATA (Debian's dataset-fashion-mnist, or set FASHION_MNIST_DATA)"

PORT=$((29000 + RANDOM % 1000)) # fresh namespaces: nothing else listens there
WORK=$(mktemp -d /tmp/chorus-elastic-XXXXXX)
PIDS=()
cleanup() {
  local rc=$?
  set +e
  for pid in "${PIDS[@]}"; do
    kill -TERM "$pid" 2>/dev/null
  done
  sleep 0.2
  hosts_down # SIGKILLs whatever still runs inside our namespaces: this script started it
  for pid in "${PIDS[@]}"; do
    wait "$pid" 2>/dev/null
  done
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

hosts_up 3 || skip "$HOSTS_WHY"
NAMES=(A B C)
echo "hosts: A ${HOST_ADDR[0]} (store at :$PORT), B ${HOST_ADDR[1]}, C ${HOST_ADDR[2]}"
(umask 077 && head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$WORK/token")
EXAMPLE_ARGS=(--max-steps "$STEPS" --threads 1 --data "$DATA")

# The reference: the same job uninterrupted on three ranks (one host, chorus run -n 3).
echo "reference: $STEPS steps on three ranks, uninterrupted"
(cd "$WORK" && timeout "$TIMEOUT_S" "$CHORUS" run -n 3 "$FASHION_MNIST" --run-name reference "${EXAMPLE_ARGS[@]}") \
  >"$WORK/reference.log" 2>&1 || { tail -n 20 "$WORK/reference.log"; echo "FAIL: the reference run failed"; exit 1; }

# launch HOST_INDEX LOG_NAME: a launcher on that host, in the background; its pid in LAST_PID.
launch() {
  (cd "$WORK" && hosts_exec "${HOST_NS[$1]}" timeout "$TIMEOUT_S" "$CHORUS" run --nnodes 2:3 \
    --rdzv-endpoint "${HOST_ADDR[0]}:$PORT" --token-file "$WORK/token" --max-restarts 3 --rdzv-last-call 1 \
    --grace-period 20 "$FASHION_MNIST" --run-name elastic --checkpoint-every "$EVERY" "${EXAMPLE_ARGS[@]}") \
    >"$WORK/$2.log" 2>&1 &
  LAST_PID=$!
  PIDS+=("$LAST_PID")
}

# The newest saved state of the elastic run: "STEP WORLD_SIZE", or "0 0" before the first save.
saved_state() {
  python3 - "$WORK/runs/elastic/state" <<'EOF'
import glob, json, os, sys
best = (0, 0)
for f in glob.glob(os.path.join(sys.argv[1], "*", "state.json")):
    try:
        s = json.load(open(f))
        best = max(best, (int(s["step"]), int(s["world_size"])))
    except (OSError, ValueError, KeyError):
        pass  # being written
print(*best)
EOF
}
# wait_for WHAT SECONDS COMMAND...: polls COMMAND every 0.2 s until it succeeds.
wait_for() {
  local what=$1 limit=$2 start=$SECONDS i
  shift 2
  until "$@"; do
    ((SECONDS - start < limit)) || fail "waited $limit s for $what"
    for i in "${!LAUNCHED[@]}"; do
      kill -0 "${LAUNCHED[$i]}" 2>/dev/null || fail "launcher $i exited while waiting for $what"
    done
    sleep 0.2
  done
}
declare -A LAUNCHED=()
state_at() { # state_at MIN_STEP WORLD
  local step world
  read -r step world < <(saved_state)
  [[ $step -ge $1 && $world -eq $2 ]]
}

for i in 0 1 2; do
  launch "$i" "${NAMES[$i]}"
  LAUNCHED[${NAMES[$i]}]=$LAST_PID
done
wait_for "a round of 3 nodes" 60 grep -q "round [0-9]*: 3 node(s)" "$WORK/A.log"
wait_for "a state saved at step >= $KILL_AT by three hosts" 120 state_at "$KILL_AT" 3
read -r KILLED_AT _ < <(saved_state)
echo "state saved at step $KILLED_AT on three hosts: host C dies"
hosts_kill "${HOST_NS[2]}"
wait "${LAUNCHED[C]}" 2>/dev/null || true
unset 'LAUNCHED[C]'

wait_for "a round of 2 nodes" 60 grep -q "round [0-9]*: 2 node(s)" "$WORK/A.log"
wait_for "a state saved by two hosts $GROW_AFTER steps after the kill" 120 state_at $((KILLED_AT + GROW_AFTER)) 2
read -r GREW_AT _ < <(saved_state)
echo "state saved at step $GREW_AT on two hosts: a new launcher starts on host C"
launch 2 C2
LAUNCHED[C2]=$LAST_PID

declare -A RC=()
for n in A B C2; do
  RC[$n]=0
  wait "${LAUNCHED[$n]}" || RC[$n]=$?
done
for n in A B C2; do
  [[ ${RC[$n]} -eq 0 ]] || fail "host $n's launcher exited with status ${RC[$n]} (124: not done within $TIMEOUT_S s)"
done
echo "the launchers of A, B and the new C exited 0; A's launcher said:"
grep "^chorus run:" "$WORK/A.log" | sed 's/^/    | /'

ROUNDS=$(grep -o "round [0-9]*: [0-9] node(s)" "$WORK/A.log" | awk '{print $3}' | uniq | tr '\n' ' ')
echo "A's rounds, by node count: $ROUNDS"
[[ $ROUNDS == *"3 2 3 "* ]] || fail "the rounds went $ROUNDS; expected 3, then 2, then 3 nodes"
grep -q "^chorus run: round [0-9]* failed: " "$WORK/A.log" || fail "A's log names no failed round (host C's death)"
grep -q "ended (membership: a node waits to join" "$WORK/A.log" || fail "A's log has no round ended for a joining node"

python3 - "$WORK/runs/elastic" "$WORK/runs/reference" "$STEPS" "$BATCH" "$TOLERANCE" <<'EOF' || fail "the records"
import json, sys
run, ref, steps, batch, tolerance = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
def lines(d):
    return [json.loads(l) for l in open(d + "/metrics.jsonl") if l.strip()]
rows = [l for l in lines(run) if l["type"] == "step"]
got = [r["step"] for r in rows]
assert got == list(range(1, steps + 1)), f"steps recorded: {got[:5]}...{got[-5:]} ({len(got)}), expected 1..{steps} once each"
worlds = [r["samples"] // batch for r in rows]
runs = [w for i, w in enumerate(worlds) if i == 0 or worlds[i - 1] != w]
print("world size by step, in runs:", runs)
assert runs == [3, 2, 3], f"world sizes went {runs}, expected [3, 2, 3]"
summary = json.load(open(run + "/summary.json"))
assert summary["status"] == "finished" and summary["world_size"] == 3 and summary["steps"] == steps, summary
def accuracy(d):
    acc = [l["test_accuracy"] for l in lines(d) if l["type"] == "log" and "test_accuracy" in l]
    assert acc, f"no test accuracy in {d}"
    return acc[-1]
a, r = accuracy(run), accuracy(ref)
print(f"test accuracy: elastic {a:.4f}, uninterrupted {r:.4f} (difference {a - r:+.4f}, tolerance {tolerance})")
assert abs(a - r) <= tolerance, "the elastic run's accuracy is not within tolerance of the uninterrupted run's"
EOF
echo "PASS"
