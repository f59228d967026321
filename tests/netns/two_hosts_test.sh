#!/bin/bash
# Two hosts on one machine: two network namespaces joined by a veth pair, one `chorus run` in each
# (--nnodes 2 --nproc-per-node NPROC), training the Fashion-MNIST harness
# (bench/fashion_mnist_ddp) for a few steps over the veth.
#
#   two_hosts_test.sh CHORUS FASHION_MNIST_DDP [NPROC]
#
# NPROC 1 (default): one rank per host, so the default transport is TCP. NPROC 2: two ranks per
# host, so it is the hybrid: shared memory within each host, TCP between them over the veth.
# Each host also gets its own hostname and IPC namespace, so that nothing can tell the two apart
# from two machines (chorus picks shared memory only for ranks with the same hostname and IPC
# namespace). Host A (node 0) hosts the rendezvous store at A's veth address; its own worker reaches the store
# by that address too, so every worker advertises a veth address for its transport connections.
# Checks: both launchers exit 0 within the timeout; rank 0's metrics say world_size 2 x NPROC, the
# transport expected and the steps asked for; a transport connection (not the store's) was seen established from B to A's
# address; and the veth carried at least steps x gradient bytes each way (a W=2 ring allreduce of
# N bytes sends N bytes each way), so the gradients really went between the namespaces.
#
# Needs root and `ip netns`; exits 77 (skip) where the namespaces or the veth cannot be made.
# Everything it makes (namespaces, veth, processes, files) is removed on every exit.
set -euo pipefail

if [[ $# -lt 2 || $# -gt 3 ]]; then
  echo "usage: $0 CHORUS FASHION_MNIST_DDP [NPROC]" >&2
  exit 2
fi
CHORUS=$(realpath "$1")
FASHION_MNIST=$(realpath "$2")
NPROC=${3:-1}
STEPS=5
TIMEOUT_S=120

skip() {
  echo "SKIP: $*"
  exit 77
}
fail() {
  echo "FAIL: $*"
  exit 1
}

# The namespaces, the veth and the hostnames: scripts/two_hosts.sh (bench/scaling uses it too).
# shellcheck source-path=SCRIPTDIR source=../../scripts/two_hosts.sh
source "$(dirname "$(realpath "$0")")/../../scripts/two_hosts.sh"
two_hosts_check || skip "$TWO_HOSTS_WHY"
command -v ss >/dev/null || skip "ss (iproute2) is not installed"
[[ -x $CHORUS ]] || fail "no executable chorus at $CHORUS"
[[ -x $FASHION_MNIST ]] || fail "no executable fashion_mnist_ddp at $FASHION_MNIST"

PORT=$((29000 + RANDOM % 1000))  # fresh namespaces: nothing else listens there
WORK=$(mktemp -d /tmp/chorus-netns-XXXXXX)
PIDS=()

two_hosts_traps  # on exit: stop PIDS, remove the hosts and WORK

two_hosts_up || skip "$TWO_HOSTS_WHY"
echo "hosts: $NS_A ($ADDR_A, node 0, store at $ADDR_A:$PORT) and $NS_B ($ADDR_B, node 1)"

veth_bytes() {  # veth_bytes tx|rx: bytes through A's end of the veth
  ip netns exec "$NS_A" cat "/sys/class/net/$VETH_A/statistics/${1}_bytes"
}
TX0=$(veth_bytes tx)
RX0=$(veth_bytes rx)

launch() {  # launch NS NODE_RANK NAME: its own hostname and IPC namespace too, as on another machine
  (cd "$WORK" && two_hosts_exec "$1" timeout "$TIMEOUT_S" "$CHORUS" run --nnodes 2 --node-rank "$2" \
    --rdzv-endpoint "$ADDR_A:$PORT" --nproc-per-node "$NPROC" --token-file "$WORK/token" \
    "$FASHION_MNIST" --max-steps "$STEPS" --eval-limit 200 --no-checkpoint --metrics-json "$WORK/$3.json") \
    >"$WORK/$3.log" 2>&1 &
  PIDS+=($!)
}
# A multi-node job needs a secret shared by every node: a file only this user can read.
(umask 077 && head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$WORK/token")
launch "$NS_A" 0 A
PID_A=$!
launch "$NS_B" 1 B
PID_B=$!

# While the job runs, note the TCP connections B has established to A.
(
  while kill -0 "$PID_A" 2>/dev/null || kill -0 "$PID_B" 2>/dev/null; do
    ip netns exec "$NS_B" ss -Htn state established dst "$ADDR_A" 2>/dev/null || true
    sleep 0.1
  done
) >"$WORK/connections" &
PIDS+=($!)
SAMPLER=$!

declare -A RC=([A]=0 [B]=0)
wait "$PID_A" || RC[A]=$?
wait "$PID_B" || RC[B]=$?
wait "$SAMPLER" || true

show_logs() {
  local n
  for n in A B; do
    echo "--- node $n ($([[ $n == A ]] && echo "$NS_A" || echo "$NS_B")) output, last 30 lines:"
    tail -n 30 "$WORK/$n.log" | sed 's/^/    | /'
  done
}
for n in A B; do
  rc=${RC[$n]}
  if [[ $rc -ne 0 ]]; then
    show_logs
    [[ $rc -eq 124 ]] && fail "node $n's chorus run did not finish within $TIMEOUT_S s"
    fail "node $n's chorus run exited with status $rc"
  fi
done
echo "both launchers exited 0"

# Rank 0 (node A) writes the metrics; rank 1's --metrics-json is ignored by the program.
read -r WORLD DONE_STEPS GRAD_BYTES KIND < <(python3 -c '
import json, sys
m = json.load(open(sys.argv[1]))
print(m["world_size"], m["steps"], m["ddp"]["gradient_bytes"], m["transport"])' "$WORK/A.json") ||
  { show_logs; fail "no readable metrics in $WORK/A.json"; }
[[ $WORLD -eq $((2 * NPROC)) ]] || fail "metrics: world_size $WORLD, expected $((2 * NPROC))"
# One rank per host: TCP. Two: the hybrid (shared memory in each namespace-host, TCP across).
WANT_KIND=$([[ $NPROC -eq 1 ]] && echo tcp || echo hybrid)
[[ $KIND == "$WANT_KIND" ]] || fail "metrics: transport $KIND, expected $WANT_KIND (auto, with separate hosts)"
[[ $DONE_STEPS -eq $STEPS ]] || fail "metrics: $DONE_STEPS steps, expected $STEPS"
echo "metrics: world_size $WORLD, transport $KIND, $DONE_STEPS steps, $GRAD_BYTES gradient bytes per step"

# Transport connections: from B's address to A's address on a port other than the store's.
# (`ss state established` prints Recv-Q Send-Q Local Peer.)
TRANSPORT=$(awk -v a="$ADDR_A:" -v s="$ADDR_A:$PORT" 'index($4, a) == 1 && $4 != s {print $3 " -> " $4}' \
  "$WORK/connections" | sort -u)
STORE=$(awk -v s="$ADDR_A:$PORT" '$4 == s {print $3 " -> " $4}' "$WORK/connections" | sort -u)
[[ -n $STORE ]] || fail "no store connection from $NS_B to $ADDR_A:$PORT was seen (sampled with ss every 0.1 s)"
[[ -n $TRANSPORT ]] || fail "no transport connection from $NS_B to $ADDR_A was seen (sampled with ss every 0.1 s); \
store connections seen: $STORE"
echo "store connections B -> A: ${STORE//$'\n'/, }"
echo "transport connections B -> A: ${TRANSPORT//$'\n'/, }"

TX=$(($(veth_bytes tx) - TX0))
RX=$(($(veth_bytes rx) - RX0))
NEED=$((STEPS * GRAD_BYTES))
echo "veth $VETH_A carried $TX bytes A->B and $RX bytes B->A (the allreduces alone need >= $NEED each way)"
[[ $TX -ge $NEED && $RX -ge $NEED ]] || fail "too little traffic over the veth: the gradients did not go between the namespaces"
echo "PASS"
