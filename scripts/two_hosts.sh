# shellcheck shell=bash
# Two simulated hosts on one machine, for bash scripts to source: two network namespaces joined by
# a veth pair, each end with an address on a private /24. A command started in one of them with
# two_hosts_exec also gets its own hostname and IPC namespace, so that nothing tells the two apart
# from two machines (chorus picks shared memory only for ranks with the same hostname and IPC
# namespace). Used by tests/netns/two_hosts_test.sh and bench/scaling.
#
#   source scripts/two_hosts.sh
#   two_hosts_check || echo "cannot: $TWO_HOSTS_WHY"   # root, ip, unshare --uts --ipc
#   two_hosts_up || echo "cannot: $TWO_HOSTS_WHY"      # sets NS_A NS_B VETH_A VETH_B ADDR_A ADDR_B
#   (cd DIR && two_hosts_exec "$NS_A" CMD ARGS...) &   # CMD in host A, hostname NS_A with '-' for '_'
#   two_hosts_down                                      # kills what runs in them, deletes them
#
# The functions return non-zero with the reason in TWO_HOSTS_WHY and never exit: the caller decides
# whether that is a skip (a test's exit 77) or one point left out (a benchmark). two_hosts_down is
# safe to call at any time, more than once, after a partial two_hosts_up: call it from the caller's
# EXIT trap. Names carry the caller's pid ($$) and the subnet a random octet, so that concurrent
# users do not collide.

# shellcheck disable=SC2034 # the callers read them
TWO_HOSTS_WHY=""
TWO_HOSTS_MADE_A=0
TWO_HOSTS_MADE_B=0

# shellcheck source=hosts.sh
source "$(dirname "${BASH_SOURCE[0]}")/hosts.sh"

# Whether this process can make the hosts: root, iproute2's ip, and UTS and IPC namespaces.
two_hosts_check() {
  hosts_check || { TWO_HOSTS_WHY=$HOSTS_WHY; return 1; }
}

# Makes namespaces NS_A and NS_B, a veth pair VETH_A (in A, address ADDR_A) -- VETH_B (in B,
# ADDR_B), every link up.
two_hosts_up() {
  NS_A=chorus_a_$$
  NS_B=chorus_b_$$
  VETH_A=chva$$  # interface names: at most 15 characters
  VETH_B=chvb$$
  local octet=$((RANDOM % 254 + 1)) err
  ADDR_A=10.77.$octet.1
  ADDR_B=10.77.$octet.2
  if ! err=$(ip netns add "$NS_A" 2>&1); then
    TWO_HOSTS_WHY="cannot make a network namespace: $err"
    return 1
  fi
  TWO_HOSTS_MADE_A=1
  if ! err=$(ip netns add "$NS_B" 2>&1); then
    TWO_HOSTS_WHY="cannot make a second network namespace: $err"
    return 1
  fi
  TWO_HOSTS_MADE_B=1
  if ! err=$(ip link add "$VETH_A" type veth peer name "$VETH_B" 2>&1); then
    TWO_HOSTS_WHY="cannot make a veth pair: $err"
    return 1
  fi
  if ! err=$({ ip link set "$VETH_A" netns "$NS_A" && ip link set "$VETH_B" netns "$NS_B" &&
    ip -n "$NS_A" addr add "$ADDR_A/24" dev "$VETH_A" && ip -n "$NS_B" addr add "$ADDR_B/24" dev "$VETH_B" &&
    ip -n "$NS_A" link set lo up && ip -n "$NS_B" link set lo up &&
    ip -n "$NS_A" link set "$VETH_A" up && ip -n "$NS_B" link set "$VETH_B" up; } 2>&1); then
    TWO_HOSTS_WHY="cannot set up the veth pair $VETH_A -- $VETH_B: $err"
    return 1
  fi
  return 0
}

# two_hosts_exec NS CMD [ARGS...]: replaces the calling shell (run it in a subshell) with CMD in
# network namespace NS, in a UTS and IPC namespace of its own, with hostname NS ('_' read as '-').
# The pid of the subshell is then CMD's: signals sent to it reach CMD.
two_hosts_exec() {
  # shellcheck disable=SC2016 # the inner bash expands $0 and $@
  exec ip netns exec "$1" unshare --uts --ipc /bin/bash -c 'hostname "${0//_/-}" && exec "$@"' "$@"
}

# Kills whatever still runs in the two namespaces (it was started there by this script) and deletes
# them and the veth pair.
two_hosts_down() {
  local ns
  for ns in ${NS_A:+"$NS_A"} ${NS_B:+"$NS_B"}; do
    if ip netns list 2>/dev/null | grep -qw "$ns"; then
      ip netns pids "$ns" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
    fi
  done
  if [[ -n ${VETH_A:-} ]]; then
    ip link del "$VETH_A" 2>/dev/null || true  # only there if moving it into A failed
  fi
  if [[ $TWO_HOSTS_MADE_A -eq 1 ]] && ip netns del "$NS_A"; then TWO_HOSTS_MADE_A=0; fi
  if [[ $TWO_HOSTS_MADE_B -eq 1 ]] && ip netns del "$NS_B"; then TWO_HOSTS_MADE_B=0; fi
  return 0
}

# two_hosts_traps: for a test script that keeps the pids of what it started in the hosts in the
# array PIDS and its files in WORK. On exit (and on INT, TERM, HUP, as exits 130 and 143): SIGTERM
# to those processes, up to 10 s for them to exit (a dask-worker's nanny then stops its worker and
# Python's resource tracker unlinks their semaphores in /dev/shm; SIGKILLed, they would stay), then
# two_hosts_down, then their exits are reaped and WORK removed; the script's exit status is kept.
two_hosts_cleanup() {
  local rc=$? pid i
  set +e
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  for ((i = 0; i < 100; i++)); do
    local alive=0
    for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 0.1
  done
  two_hosts_down  # SIGKILLs whatever still runs inside the namespaces
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null; done
  [[ -n ${WORK:-} ]] && rm -rf "$WORK"
  exit "$rc"
}
two_hosts_traps() {
  trap two_hosts_cleanup EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM HUP
}
