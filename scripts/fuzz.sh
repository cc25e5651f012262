#!/usr/bin/env bash
# The recorded fuzz runs (docs/fuzzing.md): every target (or those named)
# under libFuzzer with ASan+UBSan, RUNS inputs each (default 1e6), one after
# another, starting from the target's seeds and whatever corpus an earlier
# run left. Not part of CI (minutes per target); CI runs the deterministic
# suite 'fuzz'.
#
#   scripts/fuzz.sh [TARGET...]       env: RUNS, LF_BUILD (build-lf), BUILD_DIR (build), CORPUS (build-lf/corpus)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${RUNS:-1000000}
lf=${LF_BUILD:-build-lf}
std=${BUILD_DIR:-build}
corpus=${CORPUS:-$lf/corpus}
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(vfio_user_server vfio_caps am_header verbs_wire key_section rkey roce_wire bootstrap_frames mesh sim_control tool_args)
command -v clang++ > /dev/null || { echo "fuzz.sh: needs clang (apt-get install clang)" >&2; exit 2; }
[ -d "$lf" ] || CC=clang CXX=clang++ meson setup "$lf" -Dlibfuzzer=true -Db_sanitize=address,undefined \
  -Db_lundef=false -Dpython=disabled
[ -d "$std" ] || meson setup "$std"
ninja -C "$lf" $(printf 'tests/fuzz/fuzz_%s ' "${targets[@]}")
ninja -C "$std" $(printf 'tests/fuzz/fuzz_%s ' "${targets[@]}")
mkdir -p "$corpus" "$lf/fuzz-logs"
for t in "${targets[@]}"; do
  mkdir -p "$corpus/$t"
  "$std/tests/fuzz/fuzz_$t" --dump-seeds "$corpus/$t" > /dev/null
  start=$(date +%s)
  set +e
  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 \
    "$lf/tests/fuzz/fuzz_$t" -runs="$runs" -max_len=4096 -rss_limit_mb=4096 -print_final_stats=1 \
    -artifact_prefix="$lf/fuzz-logs/$t-" "$corpus/$t" > "$lf/fuzz-logs/$t.log" 2>&1
  rc=$?
  set -e
  secs=$(( $(date +%s) - start ))
  cov=$(grep -oE 'cov: [0-9]+ ft: [0-9]+ corp: [0-9]+/[0-9a-zA-Z]+' "$lf/fuzz-logs/$t.log" | tail -1 || true)
  eps=$(grep average_exec_per_sec "$lf/fuzz-logs/$t.log" | awk '{print $2}' || true)
  echo "$t: rc=$rc, $runs runs in ${secs} s (${eps:-?} execs/s), ${cov:-no coverage line}; log $lf/fuzz-logs/$t.log"
done
