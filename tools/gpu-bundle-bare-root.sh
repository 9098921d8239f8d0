#!/usr/bin/env bash
# gpu-bundle-bare-root.sh: proves here, without a GPU, that the GPU bundle
# lacks nothing but the GPU. Builds the bundle (tools/gpu-bundle.sh), makes a
# minimal Debian root (debootstrap --variant=minbase: the C library, bash,
# coreutils and little else: none of the build machine's libraries), copies
# only the bundle into it, and runs the bundle's gpu-check.sh --expect-no-gpu
# there: chrooted, in new mount, PID and network namespaces, so that nothing
# of this machine's /usr is visible and there is no network. The host-backend
# tests must pass from the bundle, the gpu tests must each report that no GPU
# is usable, and nothing else may fail. tools/test.sh runs it.
#
# Usage: tools/gpu-bundle-bare-root.sh   (as root; the root comes from
# tools/bare-root.sh, once per build/bare-root). Environment: KVTIER_BARE_ROOT
# (default build/bare-root), and tools/bare-root.sh's. The check's log lands in
# build/bare-root-results. Exit status: 0 proven, 1 failed, 0 with "not run"
# when not root (no chroot or namespaces).
set -euo pipefail
cd "$(dirname "$0")/.."

root=$(realpath -m "${KVTIER_BARE_ROOT:-build/bare-root}")
results=build/bare-root-results
say() { echo "bare-root: $*"; }
fail() {
  echo "bare-root: FAILED: $*" >&2
  exit 1
}

if [[ $(id -u) -ne 0 ]]; then
  say "not run: a chroot and new namespaces need root"
  exit 0
fi

tools/gpu-bundle.sh gpu-bundle

tools/bare-root.sh "$root"
say "root: $(du -sh "$root" | cut -f1), $(chroot "$root" dpkg-query -W | wc -l) packages"
for lib in liburing.so.2 librocksdb.so.7.8 libyaml-cpp.so.0.7 libspdlog.so.1.10; do
  if [[ -n "$(find "$root/usr" "$root/lib" -name "$lib*" 2>/dev/null | head -1)" ]]; then
    fail "$root already holds $lib: it is no bare root"
  fi
done

rm -rf "$root/bundle" "$results"
cp -a gpu-bundle "$root/bundle"
# Inside new namespaces: mounts made there vanish with them, the network is
# only a loopback (brought up when this machine has `ip`), and /dev/shm is
# the root's own.
rc=0
unshare --mount --pid --net --fork --mount-proc="$root/proc" bash -c '
  set -e
  root=$1
  mount --make-rprivate /
  mount --rbind /dev "$root/dev"
  mount -t tmpfs -o size=256m tmpfs "$root/dev/shm"
  if command -v ip >/dev/null 2>&1; then ip link set lo up; fi
  exec chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root TMPDIR=/tmp \
    OUT_DIR=/bundle/results /bin/bash /bundle/gpu-check.sh --expect-no-gpu
' bare-root "$root" || rc=$?
mkdir -p "$results"
cp -a "$root/bundle/results/." "$results/" 2>/dev/null || true
if ((rc != 0)); then
  fail "gpu-check.sh --expect-no-gpu exited $rc in the bare root (log: $results/gpu-check.log)"
fi
say "the bundle runs in a bare Debian root with no network; only the GPU is missing"

# The root has no Python. The bundle's Python recipe is proven here instead:
# the extension built from the bundle alone (its headers and libkvtier.so)
# for the test venv's Python, and the package's tests run with it against the
# bundle's kvtierd.
venv_python=build/venv/bin/python
if [[ ! -x "$venv_python" ]]; then
  say "python: not run (no $venv_python: tools/setup-python.sh makes it)"
  exit 0
fi
rm -rf "$results/python"
PATH="$(dirname "$venv_python"):$PATH" gpu-bundle/python/build-extension.sh "$results/python" ||
  fail "the bundle's Python extension did not build"
(cd "$results" && PYTHONPATH="$PWD/python" "$OLDPWD/$venv_python" -c \
  'import kvtier, sys; assert kvtier.__file__.startswith(sys.argv[1]), kvtier.__file__' "$PWD/python") ||
  fail "the bundle's Python extension does not import"
PYTHONPATH="$PWD/$results/python" KVTIER_PROGRAMS_DIR="$PWD/gpu-bundle/bin" \
  "$venv_python" -m pytest client/python/tests/test_client.py -p no:cacheprovider -q ||
  fail "the package's tests with the bundle's extension and kvtierd"
say "proven: the bundle's Python extension builds from the bundle alone and passes the package's tests"
