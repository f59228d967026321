#!/usr/bin/env bash
# A /dev/shm too small for the shared-memory transport (as in a container with the default
# --shm-size): with the transport forced to shm, a clear error at setup on every rank, never a
# SIGBUS or a hang later; with the default, auto, a line saying so and the job runs over TCP.
# Runs `chorus bench` in a private mount namespace whose /dev/shm is a 1 MB tmpfs.
#
#   full_devshm_test.sh CHORUS
#
# Needs root (unshare --mount); exits 77 (skip) where the namespace cannot be made.
set -uo pipefail
CHORUS=${1:?usage: full_devshm_test.sh CHORUS}
[[ $(id -u) -eq 0 ]] || { echo "SKIP: needs root for a private mount namespace"; exit 77; }
unshare --mount true 2>/dev/null || { echo "SKIP: cannot make a mount namespace (unshare --mount)"; exit 77; }

out=$(timeout -k 5 60 unshare --mount sh -c \
  'mount -t tmpfs -o size=1M chorus-test-shm /dev/shm && exec "$0" bench allreduce -n 2 --transport shm --sizes 4K --iters 10 --timeout 10' \
  "$CHORUS" 2>&1)
rc=$?
echo "$out"
[[ $rc -eq 124 || $rc -eq 137 ]] && { echo "FAIL: it hung (killed after 60 s)"; exit 1; }
[[ $rc -ne 0 ]] || { echo "FAIL: it succeeded on a 1 MB /dev/shm"; exit 1; }
for rank in 0 1; do
  grep -q "rank $rank: cannot reserve .* bytes of shared memory" <<<"$out" ||
    { echo "FAIL: no clear error from rank $rank"; exit 1; }
done
grep -q "shm-size" <<<"$out" || { echo "FAIL: the error does not say how to fix it"; exit 1; }
echo "forced shm: exit $rc with a clear error on every rank"

out=$(timeout -k 5 60 unshare --mount sh -c \
  'mount -t tmpfs -o size=1M chorus-test-shm /dev/shm && exec "$0" bench allreduce -n 2 --transport auto --sizes 4K,1M --iters 10 --check --timeout 10' \
  "$CHORUS" 2>&1)
rc=$?
echo "$out"
[[ $rc -eq 0 ]] || { echo "FAIL: auto did not fall back to TCP (exit $rc)"; exit 1; }
grep -q "transport tcp (auto)" <<<"$out" || { echo "FAIL: auto did not pick tcp"; exit 1; }
grep -q "/dev/shm on host .* bytes free but its 2 ranks need .*; using tcp" <<<"$out" ||
  { echo "FAIL: no line saying why"; exit 1; }
echo "PASS: forced shm fails clearly; auto falls back to tcp and says why"
