#!/usr/bin/env bash
# gpu-bundle.sh: builds what tools/gpu-check.sh runs on a GPU machine, here,
# and collects it into one folder that travels with the working tree. The GPU
# machine has the NVIDIA driver, nvcc, CMake and Python but no package
# registry and none of Debian's libraries, so nothing is built or installed
# there: the bundle carries the programs and every shared library they need
# beyond the C library and the driver.
#
#   1. builds Release with -DKVTIER_CUDA=ON for sm_90 (KVTIER_CUDA_ARCHS) into
#      build/gpu-bundle: kvtierd, kvtierctl, kvtier-bench, libkvtier and the
#      test programs the check runs (the gpu-labelled ones, and a few
#      host-backend ones that prove the bundle's libraries and paths);
#   2. installs libkvtier, its headers and the programs into the bundle
#      (cmake --install), and adds the test programs to its bin/;
#   3. copies in every shared library that ldd finds for those programs,
#      except the C library's own (the loader, libc, libm, ...: every Linux
#      machine has them, tied to its kernel) and the driver's (libcuda, which
#      must be the machine's own);
#   4. adds the Python package's sources with the recipe that builds them
#      there against the bundle (client/python/build-extension.sh), the PyTorch
#      end-to-end script (client/python/tests/gpu_e2e.py) and the model one
#      (client/python/tests/gpu_model_e2e.py, with the llama_kv.py it imports);
#   5. writes tests.txt (label and program, one per line), MANIFEST (what it
#      holds, the build, the newest C library symbol version it needs) and
#      copies tools/gpu-check.sh in; prints what it holds and its size, and
#      fails if the bundle is over 48 MiB (the working tree that travels is at
#      most 64 MiB).
#
# Usage: tools/gpu-bundle.sh [BUNDLE_DIR]   (default gpu-bundle, git-ignored).
# Needs the CUDA toolkit (/usr/local/cuda or CUDACXX) and the build
# dependencies (tools/setup-deps.sh). Environment: KVTIER_CUDA_ARCHS,
# KVTIER_BUNDLE_BUILD_DIR, KVTIER_WERROR (ON: warnings are errors, as
# tools/test.sh builds). Exit status: 0 built, 1 failed.
set -euo pipefail
cd "$(dirname "$0")/.."

bundle=${1:-gpu-bundle}
build_dir=${KVTIER_BUNDLE_BUILD_DIR:-build/gpu-bundle}
archs=${KVTIER_CUDA_ARCHS:-90}
max_bytes=$((48 << 20))
nvcc=${CUDACXX:-/usr/local/cuda/bin/nvcc}
# The programs the check runs, by label: gpu tests need a GPU (and skip,
# saying why, without one); host tests run anywhere and prove that the
# bundle's libraries and paths are complete.
gpu_tests=(copy_kernels_gpu_test codec_kernels_gpu_test cuda_backend_gpu_test cuda_ipc_gpu_test)
# Host tests that prove the bundle's libraries and paths there: the daemon
# and clients (host_path_test), RocksDB and io_uring (disk_integration_test),
# the host backend and the kernels' CPU emulation. tiers_test (9 MiB, pure
# tier logic that CI runs) was left out once the bundle neared 48 MiB.
host_tests=(devices_test copy_kernel_emulation_test codec_kernel_emulation_test host_path_test disk_integration_test)
programs=(kvtierd kvtierctl kvtier-bench gpu_client c_api_example)

say() { echo "gpu-bundle: $*"; }
fail() {
  echo "gpu-bundle: FAILED: $*" >&2
  exit 1
}

[[ -x "$nvcc" ]] || nvcc=$(command -v nvcc || true)
[[ -n "$nvcc" ]] || fail "no nvcc: install the CUDA toolkit in /usr/local/cuda or set CUDACXX"

mkdir -p "$(dirname "$build_dir")"
say "configure $build_dir (Release, CUDA architectures $archs)"
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DKVTIER_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc" \
  -DCMAKE_CUDA_ARCHITECTURES="$archs" -DKVTIER_BUILD_TESTS=ON -DKVTIER_PYTHON=OFF \
  -DKVTIER_WERROR="${KVTIER_WERROR:-OFF}" >"$build_dir.configure.log" 2>&1 ||
  { cat "$build_dir.configure.log"; fail "cmake configure"; }
say "build (-j$(nproc))"
cmake --build "$build_dir" -j"$(nproc)" --target kvtier_shared "${programs[@]}" "${gpu_tests[@]}" \
  "${host_tests[@]}" || fail "build"

rm -rf "$bundle"
cmake --install "$build_dir" --prefix "$bundle" >/dev/null || fail "cmake --install"
# The installed static archives, CMake package files and pkg-config file are
# for building against libkvtier elsewhere; the check needs none of them.
find "$bundle/lib" -name '*.a' -delete
for t in "${programs[@]}" "${gpu_tests[@]}" "${host_tests[@]}"; do
  [[ -x "$bundle/bin/$t" ]] || install -m 0755 "$build_dir/bin/$t" "$bundle/bin/$t"
done
strip --strip-unneeded "$bundle"/bin/* "$bundle"/lib/*.so* 2>/dev/null || true

# Shared libraries: what ldd resolves for every program and library in the
# bundle, less the C library's and the driver's. A library ldd cannot find
# here would be missing there too.
is_c_library() {  # soname
  case "$1" in
    ld-linux*.so* | libc.so* | libm.so* | libmvec.so* | libpthread.so* | libdl.so* | librt.so* | \
      libresolv.so* | libutil.so* | libanl.so* | linux-vdso.so*) return 0 ;;
  esac
  return 1
}
is_driver_library() {
  case "$1" in libcuda.so* | libnvidia-*.so*) return 0 ;; esac
  return 1
}
mapfile -t elves < <(find "$bundle/bin" "$bundle/lib" -maxdepth 1 -type f -exec sh -c \
  'head -c 4 "$1" | grep -q ELF && echo "$1"' _ {} \;)
declare -A copied=()
missing=()
for elf in "${elves[@]}"; do
  while read -r name arrow path _; do
    [[ "$arrow" == "=>" ]] || continue
    if is_c_library "$name" || is_driver_library "$name"; then continue; fi
    if [[ "$path" == "not" ]]; then
      missing+=("$name (needed by $(basename "$elf"))")
      continue
    fi
    [[ -n "${copied[$name]:-}" || -e "$bundle/lib/$name" ]] && continue
    cp -L "$path" "$bundle/lib/$name"
    copied[$name]=$path
  done < <(LD_LIBRARY_PATH="$bundle/lib" ldd "$elf" 2>/dev/null || true)
done
((${#missing[@]} == 0)) || fail "libraries ldd cannot find here: ${missing[*]}"
# The libraries just copied may need more libraries themselves.
for lib in "${!copied[@]}"; do
  while read -r name arrow path _; do
    [[ "$arrow" == "=>" ]] || continue
    if is_c_library "$name" || is_driver_library "$name" || [[ -e "$bundle/lib/$name" ]]; then continue; fi
    [[ "$path" != "not" ]] || fail "$name (needed by $lib) not found"
    cp -L "$path" "$bundle/lib/$name"
    copied[$name]=$path
  done < <(LD_LIBRARY_PATH="$bundle/lib" ldd "$bundle/lib/$lib" 2>/dev/null || true)
done
strip --strip-unneeded "$bundle"/lib/*.so* 2>/dev/null || true

# The Python package, built there against its own Python (the machine has
# pybind11 and, with nvcc, a host compiler): its sources, the recipe, the
# PyTorch and model end-to-end scripts (the latter imports llama_kv.py from
# its own folder), and the one header of Debian's that the public headers use
# (tl/expected.hpp).
if [[ -f client/python/src/module.cc ]]; then
  mkdir -p "$bundle/python/src/kvtier" "$bundle/include/tl"
  cp client/python/src/*.cc client/python/src/*.h "$bundle/python/src/"
  cp client/python/src/kvtier/*.py client/python/src/kvtier/*.pyi client/python/src/kvtier/py.typed "$bundle/python/src/kvtier/"
  install -m 0755 client/python/build-extension.sh "$bundle/python/"
  cp client/python/tests/gpu_e2e.py client/python/tests/gpu_model_e2e.py client/python/tests/gpu_shapes_e2e.py \
    client/python/tests/llama_kv.py \
    "$bundle/python/"
  expected=$(echo '#include <tl/expected.hpp>' | g++ -std=c++20 -x c++ -M - 2>/dev/null | grep -o '[^ ]*tl/expected.hpp' | head -1)
  [[ -n "$expected" ]] || fail "tl/expected.hpp not found (libexpected-dev)"
  cp "$expected" "$bundle/include/tl/"
fi

{
  for t in "${gpu_tests[@]}"; do echo "gpu $t"; done
  for t in "${host_tests[@]}"; do echo "host $t"; done
} >"$bundle/tests.txt"
install -m 0755 tools/gpu-check.sh "$bundle/gpu-check.sh"

# The newest symbol versions of the C library and libstdc++ the bundle
# needs: the GPU machine's must be at least these.
newest_version() {  # prefix (GLIBC_ or GLIBCXX_)
  for elf in "$bundle"/bin/* "$bundle"/lib/*.so*; do objdump -T "$elf" 2>/dev/null; done |
    grep -o "$1[0-9.]*" | sort -t. -k1,1 -k2,2n -k3,3n -u | tail -1
}
glibc=$(newest_version GLIBC_2)
size=$(du -sb "$bundle" | cut -f1)
{
  echo "kvtier GPU bundle"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release && echo "$PRETTY_NAME"), $(g++ --version | head -1)"
  echo "cuda: $("$nvcc" --version | grep -o 'release [0-9.]*'), architectures $archs"
  echo "needs: the C library with $glibc, the NVIDIA driver (libcuda.so.1) for the gpu steps"
  echo "size: $size bytes"
  echo "bin:"
  (cd "$bundle/bin" && ls -1) | sed 's/^/  /'
  echo "lib (bundled shared libraries: ldd's findings less the C library's and the driver's):"
  (cd "$bundle/lib" && ls -1 -- *.so* 2>/dev/null) | sed 's/^/  /'
  if [[ -d "$bundle/python" ]]; then
    echo "python: the package's sources, build-extension.sh, gpu_e2e.py, gpu_model_e2e.py, gpu_shapes_e2e.py and llama_kv.py" \
      "(built there for its own Python)"
  fi
  echo "tests (label, program):"
  sed 's/^/  /' "$bundle/tests.txt"
} >"$bundle/MANIFEST"

cat "$bundle/MANIFEST"
du -sh "$bundle"/* | sed 's/^/  /'
((size <= max_bytes)) || fail "the bundle is $size bytes; at most $max_bytes (48 MiB) travel with the working tree"
say "$bundle is $((size >> 20)) MiB ($size bytes): ready. On the GPU machine: $bundle/gpu-check.sh"
