#!/usr/bin/env bash
# gpu-check.sh: the checks that need a GPU, in one run on a machine with one
# NVIDIA GPU (written for the H200, sm_90), from the bundle that
# tools/gpu-bundle.sh built on a build machine. Nothing is built or installed
# here: no apt, no network, no compiler. Steps (each says what failed and
# why, and the later ones still run, so one run reports everything):
#
#   1. environment: the machine, the GPU and its driver (nvidia-smi), nvcc
#      (printed only: the check needs no compiler) and the bundle's MANIFEST;
#   2. libraries: every program and library of the bundle finds every shared
#      library it needs (ldd: the bundle's own lib/, the C library, the
#      driver's libcuda);
#   3. gpu tests: the gpu-labelled test programs, with KVTIER_REQUIRE_GPU=1
#      (a test that finds no GPU fails instead of skipping); any failure, any
#      skip, or no test at all fails the check;
#   4. host tests: the host-backend test programs the bundle holds (the real
#      daemon, clients, RocksDB, io_uring), which must pass;
#   5. kvtier-bench gpu (paged gather/scatter vs one contiguous cudaMemcpy)
#      for the vllm-nhd, vllm-hnd and sglang-page-first layouts, each with its
#      JSON file, and their summary table (ratios below target are reported,
#      not failed);
#   6. python: builds the package's extension for this machine's python3
#      against the bundle (python/build-extension.sh: the machine has pybind11
#      and a compiler) and runs the PyTorch end to end (python/gpu_e2e.py: CUDA
#      KV tensors registered through CUDA IPC, blocks stored by one process
#      and loaded back by another, every byte compared), then the model end
#      to end (python/gpu_model_e2e.py, with python/llama_kv.py: a seeded
#      transformers Llama on cuda stores an 8k-token prompt's KV through CUDA
#      IPC, another process loads the shared prefix and decodes; fp32 logits
#      bit-exact against the same computation without kvtier, bf16 within
#      rounding of fp32, a load by layer (each layer's compute waiting for
#      that layer only) giving the whole load's logits bit for bit, and TTFT
#      loaded whole, by layer and recomputed; needs transformers),
#      and the shapes end to end (python/gpu_shapes_e2e.py: MLA's latent
#      cache, and two KV cache groups of vLLM's hybrid manager over the same
#      CUDA memory, stored by one process and loaded by another, byte-exact);
#   7. the verdict: "gpu-check: PASS" or "gpu-check: FAIL (step: reason; ...)".
#
# --expect-no-gpu: the same steps on a machine without a GPU (the bare-root
# proof, tools/gpu-bundle-bare-root.sh): the gpu tests must each report that
# no GPU is usable and kvtier-bench gpu must say "no CUDA device" (exit 3),
# and everything else must pass. That shows that only the GPU is missing, not
# a library or a path.
#
# Expected run time on the GPU machine: well under a minute for the tests,
# seconds for each benchmark, well under a minute for each Python end to end.
# The whole check stays within 225 s (KVTIER_GPU_CHECK_SECONDS): each program
# runs under a timeout (90 s for a test program, 60 s for a benchmark, 120 s
# for the extension's build, 60 s for the torch end to end, 90 s for the
# model one) cut to what is left of that budget, and a program the budget
# leaves no time for is a failure that says so.
#
# Usage: gpu-bundle/gpu-check.sh [--expect-no-gpu]   (the copy in the bundle;
# tools/gpu-check.sh finds ../gpu-bundle). Environment: KVTIER_BUNDLE (the
# bundle's folder), OUT_DIR (default $OUT when set, else BUNDLE/results):
# where gpu-check.log, tests.log, bench.log, python.log and the benchmark
# JSON files go.
# Exit status: 0 PASS, 1 FAIL, 2 usage or no bundle.
set -uo pipefail

expect_gpu=1
for arg in "$@"; do
  case "$arg" in
    --expect-no-gpu) expect_gpu=0 ;;
    *)
      echo "usage: $0 [--expect-no-gpu]" >&2
      exit 2
      ;;
  esac
done

here=$(cd "$(dirname "$0")" && pwd)
bundle=${KVTIER_BUNDLE:-}
if [[ -z "$bundle" ]]; then
  if [[ -x "$here/bin/kvtierd" ]]; then bundle=$here; else bundle=$(cd "$here/.." && pwd)/gpu-bundle; fi
fi
if [[ ! -x "$bundle/bin/kvtierd" || ! -f "$bundle/tests.txt" ]]; then
  echo "gpu-check: FAIL (no bundle at $bundle: run tools/gpu-bundle.sh on a build machine first)" >&2
  exit 2
fi
bundle=$(cd "$bundle" && pwd)
out_dir=${OUT_DIR:-${OUT:-$bundle/results}}
mkdir -p "$out_dir"
out_dir=$(cd "$out_dir" && pwd)
layouts=(vllm-nhd vllm-hnd sglang-page-first)

# Each program's log, the Python build: scratch, removed at the end. What
# comes back in $out_dir is at most seven files (the GPU machine returns
# eight): gpu-check.log, tests.log, bench.log, python.log and the three JSON.
work=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-gpu-check.XXXXXX")
trap 'rm -rf "$work"' EXIT
rm -f "$out_dir/tests.log" "$out_dir/bench.log" "$out_dir/python.log"

export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KVTIER_PROGRAMS_DIR="$bundle/bin"  # where the tests find kvtierd, gpu_client, ...
export TMPDIR=${TMPDIR:-/tmp}

# The whole check stays within this many seconds (a GPU machine is lent for
# minutes): each program's timeout is cut to what is left.
budget_s=${KVTIER_GPU_CHECK_SECONDS:-225}
deadline=$(($(date +%s) + budget_s))
# Seconds a program may run: `cap`, or what is left of the budget if less.
time_for() {  # cap
  local left=$((deadline - $(date +%s)))
  if ((left < $1)); then echo "$left"; else echo "$1"; fi
}

failures=()
step() { printf '\n==> [%s] %s\n' "$(date +%H:%M:%S)" "$*"; }
failed() {  # step, reason
  failures+=("$1: $2")
  echo "FAILED: $1: $2"
}

# The bench JSON file of one layout.
bench_json() { echo "$out_dir/gpu-bench-$1.json"; }
# One row per comparison of a kvtier-bench JSON file (written one comparison
# per line by tools/bench_report.cc):
# name<TAB>kvtier<TAB>baseline<TAB>ratio<TAB>target
json_rows() {
  sed -n 's/^ *{"name": "\([^"]*\)", "kvtier": \([0-9.]*\), "baseline": \([0-9.]*\),.*"ratio": \([0-9.]*\)\(, "target": \([0-9.]*\)\)\{0,1\}}.*$/\1\t\2\t\3\t\4\t\6/p' "$1"
}
# The number in a GoogleTest summary line ("[  PASSED  ] 3 tests.") of a log.
gtest_count() {  # log, PASSED|FAILED|SKIPPED
  local n
  n=$(sed -n "s/^\[  $2 *\] \([0-9]*\) tests\{0,1\}[,.].*/\1/p" "$1" | tail -1)
  echo "${n:-0}"
}

# Runs one test program; records what went wrong as a failure of `label`.
run_tests() {  # label, program
  local label=$1 name=$2 log rc passed failed_n skipped reasons limit
  log=$work/$name.log
  if [[ ! -x "$bundle/bin/$name" ]]; then
    failed "$label tests" "$name is not in the bundle"
    return
  fi
  limit=$(time_for 90)
  if ((limit <= 0)); then
    failed "$label tests" "$name not run: the check's $budget_s s were spent"
    return
  fi
  rc=0
  if [[ "$label" == gpu && $expect_gpu == 1 ]]; then
    KVTIER_REQUIRE_GPU=1 timeout "$limit" "$bundle/bin/$name" >"$log" 2>&1 || rc=$?
  else
    timeout "$limit" "$bundle/bin/$name" >"$log" 2>&1 || rc=$?
  fi
  { echo "==== $name (exit $rc)"; cat "$log"; } >>"$out_dir/tests.log"
  passed=$(gtest_count "$log" PASSED)
  failed_n=$(gtest_count "$log" FAILED)
  skipped=$(gtest_count "$log" SKIPPED)
  printf '%-30s exit %-3s passed %-4s failed %-4s skipped %-4s\n' "$name" "$rc" "$passed" "$failed_n" "$skipped"
  if ((rc == 124)); then
    failed "$label tests" "$name ran past its timeout ($limit s)"
  elif ((rc != 0 || failed_n > 0)); then
    failed "$label tests" "$name exited $rc with $failed_n failed: $(grep -m3 -E '^\[  FAILED  \] [A-Za-z]' "$log" |
      sed 's/^\[  FAILED  \] //' | tr '\n' ' ') (log: $out_dir/tests.log)"
  elif [[ "$label" == gpu && $expect_gpu == 1 ]] && ((skipped > 0 || passed == 0)); then
    failed "gpu tests" "$name: $skipped skipped, $passed passed (on a GPU machine every gpu test must run)"
  elif [[ "$label" == gpu && $expect_gpu == 0 ]]; then
    # No GPU expected: every test skips, saying that no GPU is usable.
    reasons=$(grep -c 'needs a CUDA GPU, and none is usable here' "$log")
    if ((passed > 0 || skipped == 0 || reasons < skipped)); then
      failed "gpu tests" "$name: $passed passed, $skipped skipped, $reasons saying no GPU is usable (expected: every test skipped for want of a GPU)"
    fi
  elif ((passed == 0)); then
    failed "$label tests" "$name ran no test"
  fi
  if ((skipped > 0)) && [[ "$label" == host ]]; then
    grep -A1 -E '^\[ +SKIPPED +\] [A-Za-z]' "$log" | head -6 | sed 's/^/  skipped: /'
  fi
}

# Runs one end-to-end script of the bundle's python/ (python3 SCRIPT KVTIERD,
# the package built here on its path), its output appended to python.log,
# within `cap` seconds or what is left of the budget. Sets e2e_result to its
# verdict line (its last that starts with "label: ") and records a failure
# unless it exited 0.
e2e_result=
run_python_e2e() {  # label ("torch e2e"), cap (s), script
  local label=$1 cap=$2 script=$bundle/python/$3 limit rc=0 from
  if [[ ! -f "$script" ]]; then
    e2e_result="$label: not run ($3 is not in the bundle)"
    failed python "$e2e_result"
    return
  fi
  limit=$(time_for "$cap")
  if ((limit <= 0)); then
    e2e_result="$label: not run (the check's $budget_s s were spent)"
    failed python "$e2e_result"
    return
  fi
  touch "$out_dir/python.log"
  from=$(($(wc -l <"$out_dir/python.log") + 1))
  echo "==== $3 (at most $limit s)" >>"$out_dir/python.log"
  # SIGTERM at the limit (the scripts stop their kvtierd and children then),
  # SIGKILL 10 s later if that did not end it.
  PYTHONPATH="$work/python" timeout -k 10 "$limit" python3 "$script" "$bundle/bin/kvtierd" \
    >>"$out_dir/python.log" 2>&1 || rc=$?
  tail -n +"$from" "$out_dir/python.log" | tail -4
  e2e_result=$(tail -n +"$from" "$out_dir/python.log" | grep "^$label: " | tail -1)
  if ((rc == 124 || rc == 137)); then
    failed python "$label ran past its timeout ($limit s) (log: $out_dir/python.log)"
  elif ((rc != 0)); then
    failed python "$label exited $rc (log: $out_dir/python.log)"
  fi
  e2e_result=${e2e_result:-"$label: exit $rc"}
}

main() {
  local start elf out lines name label layout json rc below=0 kv base ratio target verdict gpus limit python_result
  start=$(date +%s)

  step "environment"
  echo "bundle: $bundle; results: $out_dir; mode: $([[ $expect_gpu == 1 ]] && echo 'GPU machine' || echo 'no GPU expected')"
  uname -srm
  head -5 "$bundle/MANIFEST" 2>/dev/null | sed 's/^/  /'
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader ||
      { [[ $expect_gpu == 1 ]] && failed environment "nvidia-smi could not read the GPUs"; }
  elif [[ $expect_gpu == 1 ]]; then
    failed environment "nvidia-smi not found: no NVIDIA driver on this machine"
  else
    echo "nvidia-smi: not found (no GPU expected)"
  fi
  if command -v nvcc >/dev/null 2>&1 || [[ -x /usr/local/cuda/bin/nvcc ]]; then
    "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)" --version | tail -2
  else
    echo "nvcc: not found (not needed: the bundle is built)"
  fi

  step "libraries (ldd, with the bundle's lib/)"
  lines=0
  for elf in "$bundle"/bin/* "$bundle"/lib/*.so*; do
    [[ -f "$elf" ]] && head -c 4 "$elf" | grep -q ELF || continue
    out=$(ldd "$elf" 2>&1) || true
    # Without a driver, libcuda is missing by design; the programs load it
    # when they look for a GPU.
    if [[ $expect_gpu == 0 ]]; then out=$(grep -v 'libcuda\.so' <<<"$out"); fi
    if grep -qE 'not found|not a dynamic|version .* not found' <<<"$out"; then
      failed libraries "$(basename "$elf"): $(grep -E 'not found' <<<"$out" | sed 's/^[[:space:]]*//' | paste -sd';')"
    fi
    lines=$((lines + 1))
  done
  echo "$lines programs and libraries checked"

  step "gpu tests"
  while read -r label name; do
    [[ "$label" == gpu ]] && run_tests gpu "$name"
  done <"$bundle/tests.txt"

  step "host tests"
  while read -r label name; do
    [[ "$label" == host ]] && run_tests host "$name"
  done <"$bundle/tests.txt"

  step "kvtier-bench gpu"
  if [[ $expect_gpu == 0 ]]; then
    rc=0
    out=$("$bundle/bin/kvtier-bench" gpu --layout vllm-nhd --json "$(bench_json vllm-nhd)" 2>&1) || rc=$?
    echo "$out" | tail -3
    if ((rc != 3)) || ! grep -q 'no CUDA device' <<<"$out"; then
      failed "kvtier-bench gpu" "exited $rc without a GPU (expected 3, \"no CUDA device\")"
    fi
  else
    for layout in "${layouts[@]}"; do
      json=$(bench_json "$layout")
      rm -f "$json"
      echo "-- $layout"
      limit=$(time_for 60)
      if ((limit <= 0)); then
        failed "kvtier-bench gpu" "--layout $layout not run: the check's $budget_s s were spent"
        continue
      fi
      rc=0
      timeout "$limit" "$bundle/bin/kvtier-bench" gpu --layout "$layout" --json "$json" \
        >"$work/bench-$layout.log" 2>&1 || rc=$?
      { echo "==== $layout (exit $rc)"; cat "$work/bench-$layout.log"; } >>"$out_dir/bench.log"
      tail -4 "$work/bench-$layout.log"
      if ((rc != 0)); then
        failed "kvtier-bench gpu" "--layout $layout exited $rc (log: $out_dir/bench.log)"
      elif [[ ! -s "$json" ]]; then
        failed "kvtier-bench gpu" "--layout $layout wrote no $json"
      fi
    done
    printf '\n%-18s %-38s %10s %10s %7s %7s  %s\n' layout comparison kvtier baseline ratio target verdict
    for layout in "${layouts[@]}"; do
      json=$(bench_json "$layout")
      [[ -s "$json" ]] || continue
      while IFS=$'\t' read -r name kv base ratio target; do
        verdict=ok
        if [[ -n "$target" ]] && awk -v r="$ratio" -v t="$target" 'BEGIN { exit !(r < t) }'; then
          verdict="BELOW TARGET"
          below=$((below + 1))
        fi
        printf '%-18s %-38s %10s %10s %6sx %7s  %s\n' "$layout" "$name" "$kv" "$base" "$ratio" "${target:--}" "$verdict"
      done < <(json_rows "$json")
    done
    echo "(kvtier and baseline in GB/s; baseline: one contiguous cudaMemcpyAsync of the same bytes)"
    if ((below > 0)); then echo "$below comparison(s) below target: reported, not a failure"; fi
  fi

  step "python (the package built here, PyTorch and model end to end through CUDA IPC)"
  python_result="not run"
  if [[ ! -d "$bundle/python" ]]; then
    python_result="not run (the bundle holds no Python package)"
  elif ! command -v python3 >/dev/null 2>&1 || ! python3 -c 'import torch' >/dev/null 2>&1; then
    python_result="not run (no python3 with torch here)"
    [[ $expect_gpu == 1 ]] && failed python "no python3 with torch on this machine"
  elif (($(time_for 120) <= 0)); then
    python_result="not run (the check's $budget_s s were spent)"
    failed python "the extension not built: the check's $budget_s s were spent"
  elif ! timeout "$(time_for 120)" "$bundle/python/build-extension.sh" "$work/python" >>"$out_dir/python.log" 2>&1; then
    python_result="failed to build"
    failed python "the extension did not build: $(tail -3 "$out_dir/python.log" | tr '\n' ' ') (log: $out_dir/python.log)"
  elif [[ $expect_gpu == 1 ]]; then
    # Each runs whatever the other's outcome, so one run reports both.
    run_python_e2e "torch e2e" 60 gpu_e2e.py
    python_result=$e2e_result
    run_python_e2e "model e2e" 90 gpu_model_e2e.py
    python_result="$python_result; $e2e_result"
    run_python_e2e "shapes e2e" 60 gpu_shapes_e2e.py
    python_result="$python_result; $e2e_result"
  else
    rc=0
    PYTHONPATH="$work/python" python3 -c 'import kvtier; kvtier.Layout("m", 1, 1, 8, "bf16", 4)' \
      >>"$out_dir/python.log" 2>&1 || rc=$?
    python_result="built and imported (no GPU: the end to end needs one)"
    ((rc == 0)) || failed python "the extension built but does not import (log: $out_dir/python.log)"
  fi
  echo "$python_result"

  step "summary"
  gpus=$(grep -c '^gpu ' "$bundle/tests.txt")
  echo "gpu test programs: $gpus; host test programs: $(grep -c '^host ' "$bundle/tests.txt"); python: $python_result"
  echo "elapsed: $(($(date +%s) - start)) s; log: $out_dir/gpu-check.log"
  if ((${#failures[@]} == 0)); then
    if [[ $expect_gpu == 1 ]]; then
      echo "gpu-check: PASS"
    else
      echo "gpu-check: PASS without a GPU (every gpu test reported that no GPU is usable; everything else passed)"
    fi
    return 0
  fi
  local reasons
  reasons=$(printf '%s; ' "${failures[@]}")
  echo "gpu-check: FAIL (${reasons%; })"
  return 1
}

# The pipeline ends only when tee has written everything, so whoever collects
# $out_dir after this script sees the whole log.
main 2>&1 | tee "$out_dir/gpu-check.log"
exit "${PIPESTATUS[0]}"
