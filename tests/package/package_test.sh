#!/usr/bin/env bash
# A project of its own (tests/package/consumer) builds against chorus and runs on 2 ranks under
# `chorus run`; every rank must print "rank R ok" (an exact DDP gradient and allreduce result).
#   package_test.sh install      SOURCE_DIR BUILD_DIR WORK_DIR
#       cmake --install of BUILD_DIR into WORK_DIR/prefix, find_package(chorus) from there, the
#       chorus::ddp consumer, launched by the installed `chorus`.
#   package_test.sh subdirectory SOURCE_DIR BUILD_DIR WORK_DIR CHORUS
#       add_subdirectory(SOURCE_DIR) with both consumers generated (so chorus::ddp's link to
#       libtorch must resolve outside chorus's tree), the chorus::comm one built and run.
# WORK_DIR is recreated, and removed again when the test passes.
set -euo pipefail
mode=$1 src=$2 build=$3 work=$4
rm -rf "$work"
mkdir -p "$work"

# step LOG COMMAND...: runs COMMAND with its output in WORK_DIR/LOG, shown if it fails.
step() {
  local log=$work/$1
  shift
  "$@" > "$log" 2>&1 || { tail -n 40 "$log"; echo "FAIL: $*"; exit 1; }
}

configure=(-G Ninja -DCMAKE_BUILD_TYPE=Release)
if command -v ccache > /dev/null; then configure+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi

case "$mode" in
  install)
    step install.log cmake --install "$build" --prefix "$work/prefix"
    # Headers: the public tree and the generated config.h, nothing from src/.
    config_dir=$(dirname "$(find "$work/prefix" -name chorusConfig.cmake | head -n 1)")
    for f in include/chorus/config.h include/chorus/ddp/ddp.h bin/chorus "${config_dir#"$work/prefix/"}/chorusConfigVersion.cmake"; do
      [ -e "$work/prefix/$f" ] || { echo "FAIL: cmake --install did not install $f"; exit 1; }
    done
    stray=$(find "$work/prefix/include" -type f ! -path "$work/prefix/include/chorus/*")
    if [ -n "$stray" ]; then echo "FAIL: installed files outside include/chorus: $stray"; exit 1; fi
    step configure.log cmake -S "$src/tests/package/consumer" -B "$work/consumer" "${configure[@]}" \
         -DCMAKE_PREFIX_PATH="$work/prefix"
    step build.log cmake --build "$work/consumer" --target consumer
    launcher="$work/prefix/bin/chorus"
    program="$work/consumer/consumer"
    ;;
  subdirectory)
    step configure.log cmake -S "$src/tests/package/consumer" -B "$work/consumer" "${configure[@]}" \
         -DCHORUS_SOURCE_DIR="$src"
    step build.log cmake --build "$work/consumer" --target consumer_comm
    launcher=$5
    program="$work/consumer/consumer_comm"
    ;;
  *)
    echo "usage: $0 install|subdirectory SOURCE_DIR BUILD_DIR WORK_DIR [CHORUS]" >&2
    exit 2
    ;;
esac

out=$("$launcher" run -n 2 "$program" 2>&1) || { echo "$out"; echo "FAIL: $program exited non-zero"; exit 1; }
echo "$out"
for r in 0 1; do
  grep -q "rank $r ok" <<< "$out" || { echo "FAIL: rank $r did not report ok"; exit 1; }
done
rm -rf "$work"
echo "PASS ($mode)"
