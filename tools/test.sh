#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs dependencies, builds Debug
# (assertions on, warnings as errors) into build/debug and runs every test
# with ctest. Exits non-zero on any failure. CI runs this (.ci/run).
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

step "configure ($build_dir, Debug)"
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Debug -DKVTIER_WERROR=ON -DKVTIER_BUILD_TESTS=ON

step "build (-j$jobs)"
cmake --build "$build_dir" -j"$jobs"

# Clang checks the thread-safety annotations (GUARDED_BY, REQUIRES) that g++
# ignores; building is enough; the tests run
# once, on the g++ build.
step "clang -Wthread-safety build (build/clang-tsa)"
CC=clang CXX=clang++ cmake -S . -B build/clang-tsa -DCMAKE_BUILD_TYPE=Debug -DKVTIER_WERROR=ON \
  -DKVTIER_CUDA=OFF -DKVTIER_BUILD_TESTS=ON >/dev/null
cmake --build build/clang-tsa -j"$jobs"

step "test (ctest -j$test_jobs)"
# shellcheck disable=SC2086
ctest --test-dir "$build_dir" --output-on-failure --no-tests=error --timeout 600 \
  -j"$test_jobs" ${KVTIER_CTEST_ARGS:-}
step "install (tools/check-install.sh)"; tools/check-install.sh "$build_dir"
step "all tests passed"
