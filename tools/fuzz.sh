#!/usr/bin/env bash
# Long fuzzing campaigns (the ctest `fuzz` label runs each target briefly).
#
#   tools/fuzz.sh [TARGET] [SECONDS] [JOBS]
#
# TARGET: fuzz_protocol, fuzz_config, fuzz_record or fuzz_recovery (default: all, one after
# another); SECONDS per target (default 600); JOBS parallel fuzzing processes
# (default: the number of CPUs). Builds the asan-ubsan preset (clang, ASan +
# UBSan, the fuzz targets), fuzzes over the seed corpus in tests/fuzz/corpus/
# and keeps what it finds in build/asan-ubsan/fuzz-corpus/TARGET. A crash
# leaves its input as crash-* in build/asan-ubsan/fuzz-artifacts/; reproduce
# it with `build/asan-ubsan/bin/TARGET FILE`. Exit status: 0 when no target
# crashed.
set -euo pipefail
cd "$(dirname "$0")/.."

targets=(fuzz_protocol fuzz_config fuzz_record fuzz_recovery)
if [ $# -ge 1 ] && [ "$1" != all ]; then targets=("$1"); fi
seconds=${2:-600}
jobs=${3:-$(nproc)}

cmake --preset asan-ubsan >/dev/null
cmake --build build/asan-ubsan -j"$(nproc)" --target "${targets[@]}"
export ASAN_OPTIONS=halt_on_error=1:detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
artifacts=build/asan-ubsan/fuzz-artifacts
mkdir -p "$artifacts"
status=0
for t in "${targets[@]}"; do
  corpus=build/asan-ubsan/fuzz-corpus/$t
  mkdir -p "$corpus"
  echo "==> $t: ${seconds}s, $jobs job(s)"
  if ! "build/asan-ubsan/bin/$t" -max_total_time="$seconds" -jobs="$jobs" -workers="$jobs" \
      -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix="$artifacts/" \
      "$corpus" "tests/fuzz/corpus/$t"; then
    echo "==> $t: FAILED (inputs in $artifacts)"
    status=1
  fi
done
exit "$status"
