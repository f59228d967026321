#!/usr/bin/env bash
# `make run` in small: `chorus run -n 2 fashion_mnist --max-steps 3 --overwrite` in a scratch
# directory exits 0 and leaves its run under runs/fashion_mnist there. Only the example's common
# flags: the benchmark and fault knobs are tested on bench/fashion_mnist_ddp.
#
#   example_test.sh CHORUS FASHION_MNIST
set -uo pipefail
CHORUS=$(realpath "${1:?usage: example_test.sh CHORUS FASHION_MNIST}")
EXAMPLE=$(realpath "${2:?usage: example_test.sh CHORUS FASHION_MNIST}")
work=$(mktemp -d "${TMPDIR:-/tmp}/chorus-example-test-XXXXXX")
trap 'rm -rf "$work"' EXIT
args=(--max-steps 3 --overwrite)
[[ -n ${FASHION_MNIST_DATA:-} ]] && args+=(--data "$FASHION_MNIST_DATA")

(cd "$work" && timeout -k 5 120 "$CHORUS" run -n 2 "$EXAMPLE" "${args[@]}")
rc=$?
[[ $rc -eq 124 || $rc -eq 137 ]] && { echo "FAIL: the example did not finish within 120 s"; exit 1; }
[[ $rc -eq 0 ]] || { echo "FAIL: the example exited with $rc"; exit 1; }
[[ -n $(ls -A "$work/runs/fashion_mnist" 2>/dev/null) ]] ||
  { echo "FAIL: nothing under runs/fashion_mnist in the working directory"; exit 1; }
echo "PASS: 2 ranks, 3 steps, run kept in runs/fashion_mnist"
