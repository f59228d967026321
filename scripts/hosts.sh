# shellcheck shell=bash
# N simulated hosts on one machine, for bash scripts to source: N network namespaces, each with a
# veth to a bridge in a "switch" namespace of its own, addresses on a private /24. A command started
# with hosts_exec also gets its own hostname and IPC namespace, as on another machine (chorus
# picks shared memory only for ranks with the same hostname and IPC namespace). Used by
# tests/netns/elastic_test.sh; two hosts joined directly: scripts/two_hosts.sh.
#
#   source scripts/hosts.sh
#   hosts_check || echo "cannot: $HOSTS_WHY"      # root, ip, bridges, unshare --uts --ipc
#   hosts_up 3 || echo "cannot: $HOSTS_WHY"       # sets HOST_NS[i] HOST_ADDR[i], i in 0..N-1
#   hosts_shape 1gbit || echo "cannot: $HOSTS_WHY" # every link 1 Gbit/s each way (tc tbf)
#   (cd DIR && hosts_exec "${HOST_NS[0]}" CMD ARGS...) &
#   hosts_kill "${HOST_NS[2]}"                    # SIGKILL everything in it: the machine died
#   hosts_down                                    # kills what runs in them, deletes everything
#
# The functions return non-zero with the reason in HOSTS_WHY and never exit. hosts_down is safe to
# call at any time, more than once, after a partial hosts_up: call it from the caller's EXIT trap.
# Names carry the caller's pid ($$) and the subnet a random octet, so that concurrent users do not
# collide.

# shellcheck disable=SC2034 # the callers read them
HOSTS_WHY=""
HOST_NS=()
HOST_ADDR=()
HOSTS_SWITCH=""

# Whether this process can make the hosts: root, iproute2's ip, and UTS and IPC namespaces.
hosts_check() {
  if [[ $(id -u) -ne 0 ]]; then
    HOSTS_WHY="needs root to make network namespaces (ip netns); running as uid $(id -u)"
    return 1
  fi
  if ! command -v ip >/dev/null; then
    HOSTS_WHY="ip (iproute2) is not installed"
    return 1
  fi
  if ! unshare --uts --ipc true 2>/dev/null; then
    HOSTS_WHY="cannot make UTS and IPC namespaces (unshare --uts --ipc)"
    return 1
  fi
  return 0
}

# hosts_up N: the switch namespace with bridge "br0", then N host namespaces, each linked to it.
hosts_up() {
  local n=$1 octet=$((RANDOM % 254 + 1)) err i ns
  HOSTS_SWITCH=chorus_sw_$$
  if ! err=$(ip netns add "$HOSTS_SWITCH" 2>&1); then
    HOSTS_SWITCH=""
    HOSTS_WHY="cannot make a network namespace: $err"
    return 1
  fi
  if ! err=$({ ip -n "$HOSTS_SWITCH" link add br0 type bridge && ip -n "$HOSTS_SWITCH" link set br0 up &&
    ip -n "$HOSTS_SWITCH" link set lo up; } 2>&1); then
    HOSTS_WHY="cannot make a bridge: $err"
    return 1
  fi
  for ((i = 0; i < n; ++i)); do
    ns=chorus_h${i}_$$
    if ! err=$(ip netns add "$ns" 2>&1); then
      HOSTS_WHY="cannot make network namespace $ns: $err"
      return 1
    fi
    HOST_NS+=("$ns")
    HOST_ADDR+=("10.78.$octet.$((i + 1))")
    # Made inside the host's namespace, so that nothing is ever left in the caller's.
    if ! err=$({ ip -n "$ns" link add eth0 type veth peer name "h$i" netns "$HOSTS_SWITCH" &&
      ip -n "$HOSTS_SWITCH" link set "h$i" master br0 && ip -n "$HOSTS_SWITCH" link set "h$i" up &&
      ip -n "$ns" addr add "${HOST_ADDR[$i]}/24" dev eth0 && ip -n "$ns" link set eth0 up &&
      ip -n "$ns" link set lo up; } 2>&1); then
      HOSTS_WHY="cannot link $ns to the bridge: $err"
      return 1
    fi
  done
  return 0
}

# hosts_exec NS CMD [ARGS...]: replaces the calling shell (run it in a subshell) with CMD in
# network namespace NS, in a UTS and IPC namespace of its own, with hostname NS ('_' read as '-').
hosts_exec() {
  # shellcheck disable=SC2016 # the inner bash expands $0 and $@
  exec ip netns exec "$1" unshare --uts --ipc /bin/bash -c 'hostname "${0//_/-}" && exec "$@"' "$@"
}

# hosts_shape RATE: every host's link limited to RATE in both directions with tc's token bucket
# (tbf), e.g. 1gbit or 100mbit, as a switch port of that speed; "unshaped" removes the limit.
# Sets HOSTS_WHY and returns non-zero when tc cannot (iproute2's tc, the sch_tbf module).
hosts_shape() {
  local rate=$1 i err burst
  for ((i = 0; i < ${#HOST_NS[@]}; ++i)); do
    ip netns exec "${HOST_NS[$i]}" tc qdisc del dev eth0 root 2>/dev/null || true
    ip netns exec "$HOSTS_SWITCH" tc qdisc del dev "h$i" root 2>/dev/null || true
    [[ $rate == unshaped ]] && continue
    # A burst of at least one timer tick's worth of bytes (rate / 250 Hz), so the bucket does not
    # cap the rate below RATE; 64 KiB at least. HOSTS_TBF_BURST (bytes) replaces it, for
    # measuring what the bucket's depth does.
    burst=$(/usr/bin/python3 -c 'import sys; r = sys.argv[1].lower(); m = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
u = next(k for k in m if r.endswith(k)); print(max(65536, int(float(r[:-len(u)]) * m[u] / 8 / 250)))' "$rate") || {
      HOSTS_WHY="bad rate '$rate' (use e.g. 100mbit, 1gbit, 10gbit or unshaped)"
      return 1
    }
    [[ -n ${HOSTS_TBF_BURST:-} ]] && burst=$HOSTS_TBF_BURST
    if ! err=$({ ip netns exec "${HOST_NS[$i]}" tc qdisc add dev eth0 root tbf rate "$rate" burst "$burst" latency 50ms &&
      ip netns exec "$HOSTS_SWITCH" tc qdisc add dev "h$i" root tbf rate "$rate" burst "$burst" latency 50ms; } 2>&1); then
      HOSTS_WHY="cannot shape ${HOST_NS[$i]}'s link to $rate with tc tbf: $err"
      return 1
    fi
  done
  return 0
}

# hosts_kill NS: SIGKILL every process in namespace NS at once, as when a machine dies.
hosts_kill() {
  ip netns pids "$1" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
}

# Kills whatever still runs in the namespaces (this script started it) and deletes them; the veths
# go with them.
hosts_down() {
  local ns
  for ns in "${HOST_NS[@]}" ${HOSTS_SWITCH:+"$HOSTS_SWITCH"}; do
    if ip netns list 2>/dev/null | grep -qw "$ns"; then
      hosts_kill "$ns"
      ip netns del "$ns" 2>/dev/null || true
    fi
  done
  HOST_NS=()
  HOST_ADDR=()
  HOSTS_SWITCH=""
  return 0
}
