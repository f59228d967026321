# shellcheck shell=bash
# Shared by the launch-engine integration tests (sourced, not run).
#
# Exit codes follow ctest's SKIP_RETURN_CODE: 0 passed, 77 skipped (the engine cannot run here;
# the reason is printed), anything else failed. CHORUS_REQUIRE_ENGINES=1 turns skips into
# failures, for machines where the engines must run.

skip() {
  if [ "${CHORUS_REQUIRE_ENGINES:-0}" = 1 ]; then
    echo "FAIL (CHORUS_REQUIRE_ENGINES=1): $*" >&2
    exit 1
  fi
  echo "SKIP: $*"
  exit 77
}

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

# Drops the variables of any launcher this test itself runs under (chorus run, torchrun, an outer
# Slurm job or mpirun), so the ranks see only what the engine under test sets.
clean_launcher_env() {
  local v
  for v in RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK MASTER_ADDR MASTER_PORT \
           CHORUS_JOB_TOKEN CHORUS_STORE_EXTERNAL CHORUS_STORE_PREFIX CHORUS_RESTART_COUNT \
           CHORUS_STORE_ADDR CHORUS_STORE_PORT \
           CHORUS_ERROR_FILE; do
    unset "$v"
  done
  for v in $(compgen -e); do
    case "$v" in SLURM_* | SLURMD_* | OMPI_* | PMIX_* | PMI_*) unset "$v" ;; esac
  done
}

# Prints the last lines of each file given, for a failure's context.
show_tail() {
  local f
  for f in "$@"; do
    [ -s "$f" ] || continue
    echo "---- last lines of $f" >&2
    tail -n 25 "$f" >&2
  done
}

# check_metrics FILE WORLD STEPS: rank 0's --metrics-json says the job had WORLD ranks and
# trained STEPS steps.
check_metrics() {
  local file=$1 world=$2 steps=$3
  [ -s "$file" ] || fail "no metrics file $file: rank 0 did not finish"
  python3 - "$file" "$world" "$steps" <<'PY' || exit 1
import json, sys
path, world, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
try:
    m = json.load(open(path))
except ValueError as e:
    sys.exit(f"FAIL: {path} is not JSON ({e}); two processes may have written it at once")
if m.get("world_size") != world:
    hint = ""
    if m.get("world_size") == 1:
        hint = (": each process trained alone, as a job of its own. fashion_mnist_ddp must take the "
                "engine's variables (SLURM_PROCID in a step, OMPI_COMM_WORLD_RANK) as 'started by "
                "a launcher' rather than starting ranks itself")
    sys.exit(f"FAIL: world_size {m.get('world_size')} in {path}, expected {world}{hint}")
if m.get("steps") != steps:
    sys.exit(f"FAIL: steps {m.get('steps')} in {path}, expected {steps}")
print(f"metrics: world_size {m['world_size']}, steps {m['steps']}, "
      f"test accuracy {m.get('test_accuracy')}")
PY
}

# run_job OUT LIMIT_S NAME CMD...: runs CMD in the background with output to OUT (so that an
# interrupt reaches the caller's trap at once; the caller's EXIT trap kills "$job"), waits, prints
# OUT, and fails naming NAME when CMD timed out after LIMIT_S or exited non-zero. FAIL_CONTEXT, if
# set, names files whose last lines are shown on failure.
run_job() {
  local out=$1 limit=$2 name=$3 rc
  shift 3
  timeout -k 10 "$limit" "$@" > "$out" 2>&1 &
  job=$!
  wait "$job"
  rc=$?
  job=
  cat "$out"
  case $rc in
    0) return 0 ;;
    124 | 137) show_tail ${FAIL_CONTEXT:-}; fail "$name did not finish within $limit s" ;;
    *) show_tail ${FAIL_CONTEXT:-}; fail "$name exited with $rc" ;;
  esac
}
