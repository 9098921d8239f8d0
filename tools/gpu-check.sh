#!/usr/bin/env bash
# gpu-check.sh: the checks that need a GPU, in one run on a machine with one
# NVIDIA GPU (written for an H200, sm_90) and the CUDA toolkit:
#
#   1. prints the GPUs (nvidia-smi -L) and the nvcc version;
#   2. installs the build dependencies (tools/setup-deps.sh) only when a quick
#      check finds one missing;
#   3. configures and builds Release with -DKVTIER_CUDA=ON into build/gpu;
#   4. runs the ctest tests labelled gpu; any failure, any skipped or not-run
#      test, or no gpu test at all fails the check (on a GPU machine a skip
#      means something is wrong);
#   5. runs kvtier-bench gpu (CUDA gather/scatter vs contiguous cudaMemcpy)
#      for the vllm-nhd, vllm-hnd and sglang-page-first layouts, each with
#      its own JSON file;
#   6. prints a summary table from those JSON files and the verdict,
#      "gpu-check: PASS" or "gpu-check: FAIL (reasons)". Ratios below their
#      targets are reported but do not fail the check.
#
# Expected runtime: 2-4 minutes on a 16-core machine with the dependencies
# installed (mostly the build), about one more when apt has to install them;
# it must stay under 5. Steps after a failed test or benchmark still run, so
# one run reports everything.
#
# Environment: KVTIER_CUDA_ARCHS (default 90), OUT_DIR (default $OUT when set,
# else build/gpu/results): where gpu-check.log, the ctest output and the
# benchmark JSON files go. Runs as root on a fresh Debian 12 machine, or as a
# user with the dependencies installed. Exit status: 0 PASS, 1 FAIL.
set -euo pipefail
cd "$(dirname "$0")/.."

build_dir=build/gpu
archs=${KVTIER_CUDA_ARCHS:-90}
out_dir=${OUT_DIR:-${OUT:-$build_dir/results}}
layouts=(vllm-nhd vllm-hnd sglang-page-first)
mkdir -p "$out_dir"
log=$out_dir/gpu-check.log

step() { printf '\n==> [%s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# The JSON file of one layout's benchmark run.
bench_json() {
  if [ "$1" = vllm-nhd ]; then echo "$out_dir/gpu-bench.json"; else echo "$out_dir/gpu-bench-$1.json"; fi
}

deps_present() {
  local tool header
  for tool in cmake pkg-config g++ make; do
    command -v "$tool" >/dev/null 2>&1 || return 1
  done
  pkg-config --exists liburing libxxhash rocksdb hiredis || return 1
  for header in CLI/CLI.hpp tl/expected.hpp gtest/gtest.h benchmark/benchmark.h flatbuffers/flatbuffers.h \
    spdlog/spdlog.h yaml-cpp/yaml.h prometheus/registry.h; do
    [ -e "/usr/include/$header" ] || return 1
  done
}

# One row per comparison of a kvtier-bench JSON file (written one comparison
# per line by tools/bench_report.cc):
# name<TAB>kvtier<TAB>baseline<TAB>ratio<TAB>target
json_rows() {
  sed -n 's/^ *{"name": "\([^"]*\)", "kvtier": \([0-9.]*\), "baseline": \([0-9.]*\),.*"ratio": \([0-9.]*\)\(, "target": \([0-9.]*\)\)\{0,1\}}.*$/\1\t\2\t\3\t\4\t\6/p' "$1"
}

main() {
  local start failures=() nvcc ctest_log rc layout json below=0 name kv base ratio target verdict
  start=$(date +%s)
  set -E
  trap 'echo "gpu-check: FAIL (unexpected failure of: $BASH_COMMAND)"' ERR

  step "environment"
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L || failures+=("nvidia-smi -L failed")
  else
    echo "nvidia-smi: not found"
  fi
  nvcc=${CUDACXX:-/usr/local/cuda/bin/nvcc}
  if [ ! -x "$nvcc" ]; then nvcc=$(command -v nvcc || true); fi
  if [ -z "$nvcc" ]; then
    echo "gpu-check: FAIL (no nvcc: install the CUDA toolkit in /usr/local/cuda or set CUDACXX)"
    return 1
  fi
  "$nvcc" --version
  echo "CUDA architectures: $archs; results in $out_dir"

  step "dependencies"
  if deps_present; then
    echo "dependencies present"
  else
    tools/setup-deps.sh
  fi

  step "configure ($build_dir, Release, CUDA)"
  if ! cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DKVTIER_CUDA=ON \
    -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES="$archs" -DKVTIER_BUILD_TESTS=ON; then
    echo "gpu-check: FAIL (cmake configure)"
    return 1
  fi

  step "build (-j$(nproc))"
  if ! cmake --build "$build_dir" -j"$(nproc)"; then
    echo "gpu-check: FAIL (build)"
    return 1
  fi

  step "gpu tests (ctest -L gpu)"
  ctest_log=$out_dir/ctest-gpu.log
  rc=0
  # A GPU test that cannot find a GPU fails here instead of skipping.
  KVTIER_REQUIRE_GPU=1 ctest --test-dir "$build_dir" -L gpu --output-on-failure --timeout 120 --no-tests=error 2>&1 |
    tee "$ctest_log" || rc=$?
  if [ "$rc" -ne 0 ]; then
    failures+=("gpu tests failed (ctest exit $rc)")
  fi
  if grep -qE 'Skipped|Not Run|\[  SKIPPED \]' "$ctest_log"; then
    failures+=("gpu tests skipped or not run")
  fi
  if grep -q 'No tests were found' "$ctest_log"; then
    failures+=("no tests labelled gpu")
  fi

  for layout in "${layouts[@]}"; do
    json=$(bench_json "$layout")
    step "kvtier-bench gpu --layout $layout"
    rm -f "$json"
    rc=0
    timeout 180 "$build_dir/bin/kvtier-bench" gpu --layout "$layout" --json "$json" || rc=$?
    if [ "$rc" -ne 0 ]; then
      failures+=("kvtier-bench gpu --layout $layout exited $rc")
    elif [ ! -s "$json" ]; then
      failures+=("kvtier-bench gpu --layout $layout wrote no $json")
    fi
  done

  step "summary"
  printf '%-18s %-38s %10s %10s %7s %7s  %s\n' layout comparison kvtier baseline ratio target verdict
  for layout in "${layouts[@]}"; do
    json=$(bench_json "$layout")
    [ -s "$json" ] || continue
    while IFS=$'\t' read -r name kv base ratio target; do
      verdict=PASS
      if [ -n "$target" ] && awk -v r="$ratio" -v t="$target" 'BEGIN { exit !(r < t) }'; then
        verdict="BELOW TARGET"
        below=$((below + 1))
      fi
      printf '%-18s %-38s %10s %10s %6sx %7s  %s\n' "$layout" "$name" "$kv" "$base" "$ratio" "${target:--}" "$verdict"
    done < <(json_rows "$json")
  done
  echo "(kvtier and baseline in GB/s; baseline: one contiguous cudaMemcpyAsync of the same bytes)"
  if [ "$below" -gt 0 ]; then echo "$below comparison(s) below target: informational, not a failure"; fi
  echo "elapsed: $(($(date +%s) - start)) s; log: $log"

  if [ ${#failures[@]} -eq 0 ]; then
    echo "gpu-check: PASS"
    return 0
  fi
  local reasons
  reasons=$(printf '%s; ' "${failures[@]}")
  echo "gpu-check: FAIL (${reasons%; })"
  return 1
}

# The pipeline ends only when tee has written everything, so whoever collects
# $out_dir after this script sees the whole log.
main 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
