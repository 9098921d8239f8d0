#!/usr/bin/env bash
# image-check.sh: proves the sidecar image (tools/image.sh) as a container
# runtime would run it, from outside it:
#   - skopeo takes the archive, and its labels give the version and source;
#   - umoci unpacks it into a runtime bundle (rootfs and config.json: user
#     kvtier, the entrypoint, the volumes);
#   - the entrypoint runs with a host directory as its /run/kvtier volume:
#     under runc where this machine lets it, else (no cgroups or namespaces
#     for runc here) in a chroot of the unpacked rootfs, as the image's user;
#   - kvtierd runs as kvtier, and its socket (kvtier's, 0660, the gid the
#     label io.kvtier.socket-gid gives) appears in the host directory;
#   - a client outside the container stores blocks through that socket,
#     finds them, loads them into other blocks and compares every byte;
#   - SIGTERM stops kvtierd with exit status 0.
#
# Usage: tools/image-check.sh PYTHON [ARCHIVE]   (as root; PYTHON has the
# kvtier package, ARCHIVE defaults to a fresh tools/image.sh). Environment:
# KVTIER_IMAGE_RUNTIME=chroot skips runc. Exit status: 0 proven (or "not
# run" when not root), 1 failed.
set -euo pipefail
cd "$(dirname "$0")/.."
CHECK=image-check
source tools/bare-root-lib.sh
require_root
python=$1
archive=${2:-$(tools/image.sh)}
[[ -f "$archive" ]] || fail "no image archive at $archive"
work=$(realpath -m build/image-check)
rm -rf "$work"
mkdir -p "$work/layout" "$work/run"
version=$("$python" -c 'import kvtier; print(kvtier.__version__)')

skopeo inspect "oci-archive:$archive" >"$work/inspect.json" || fail "skopeo does not take $archive"
for label in "org.opencontainers.image.version\": \"$version" "org.opencontainers.image.source\": \""; do
  grep -q "$label" "$work/inspect.json" || fail "no label $label: $(cat "$work/inspect.json")"
done
tar -C "$work/layout" -xf "$archive"
tag=$(grep -o '"org.opencontainers.image.ref.name":"[^"]*"' "$work/layout/index.json" | cut -d'"' -f4)
umoci unpack --image "$work/layout:$tag" "$work/bundle" >/dev/null || fail "umoci unpack"
rootfs=$work/bundle/rootfs
uid=$(chroot "$rootfs" id -u kvtier)
socket_gid=$("$python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["Labels"].get("io.kvtier.socket-gid", ""))' \
  "$work/inspect.json")
[[ -n "$socket_gid" ]] || fail "no label io.kvtier.socket-gid"
# The runtime spec umoci wrote: the image's user, entrypoint and command.
read -r spec_uid spec_gid args < <("$python" - "$work/bundle/config.json" <<'PY'
import json, shlex, sys
spec = json.load(open(sys.argv[1]))
process = spec["process"]
print(process["user"]["uid"], process["user"]["gid"], shlex.join(process["args"]))
PY
)
[[ "$spec_uid" == "$uid" ]] || fail "the image runs as uid $spec_uid, not kvtier's $uid"
[[ "$args" == "/usr/bin/kvtierd --foreground --config /etc/kvtier/kvtier.yaml" ]] || fail "the entrypoint is $args"
# A small host tier for the test (the shipped config's is 4 GiB), as an
# operator's config volume or extra arguments would.
extra=(--set tiers.host.bytes=64MiB --set metrics.enabled=false)
socket=$work/run/kvtierd.sock
chown "$uid:$spec_gid" "$work/run"

runtime=""
"$python" - "$work/bundle/config.json" "$work/run" "${extra[@]}" <<'PY'
import json, sys
path, run, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
spec = json.load(open(path))
spec["process"]["args"] += extra
spec["process"]["terminal"] = False
# umoci stands an empty tmpfs in for each volume; a runtime gives volumes
# the image's content (the config) or the operator's: here the image's, and
# the host directory for the socket.
volumes = ("/etc/kvtier", "/run/kvtier", "/var/lib/kvtier")
spec["mounts"] = [m for m in spec["mounts"] if m["destination"] not in volumes]
spec["mounts"].append({"destination": "/run/kvtier", "type": "bind", "source": run, "options": ["rbind", "rw"]})
# The host's network: the socket is a file in the shared volume either way.
spec["linux"]["namespaces"] = [n for n in spec["linux"]["namespaces"] if n["type"] != "network"]
json.dump(spec, open(path, "w"), indent=1)
PY
log=$work/kvtierd.log
if [[ "${KVTIER_IMAGE_RUNTIME:-runc}" == runc ]] && command -v runc >/dev/null 2>&1; then
  runc run --bundle "$work/bundle" kvtier-image-check-$$ >"$log" 2>&1 &
  daemon=$!
  for _ in $(seq 100); do
    [[ -S "$socket" ]] && break
    kill -0 "$daemon" 2>/dev/null || break
    sleep 0.1
  done
  if [[ -S "$socket" ]]; then
    runtime=runc
  else
    say "runc could not run it here ($(tail -1 "$log")): a chroot of the unpacked rootfs instead"
    runc delete --force kvtier-image-check-$$ >/dev/null 2>&1 || true
    wait "$daemon" 2>/dev/null || true
  fi
fi
if [[ -z "$runtime" ]]; then
  runtime=chroot
  # As runc would: the volume bound in, /dev and /proc, the image's user.
  unshare --mount --fork bash -s "$rootfs" "$work/run" "$uid" "$spec_gid" "$args" "${extra[@]}" >"$log" 2>&1 <<'INSIDE' &
set -euo pipefail
root=$1 run=$2 uid=$3 gid=$4 args=$5
shift 5
source tools/bare-root-lib.sh
mount_root "$root"
mkdir -p "$root/run/kvtier"
mount --bind "$run" "$root/run/kvtier"
cd "$root/var/lib/kvtier"
exec chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/var/lib/kvtier \
  setpriv --reuid="$uid" --regid="$gid" --init-groups $args "$@"
INSIDE
  daemon=$!
  await_socket "$socket" "$daemon" "$log"
fi
# Until it listens: the socket file comes first, its mode just after.
for _ in $(seq 50); do
  [[ "$(stat -c '%u:%g %a' "$socket")" == "$uid:$socket_gid 660" ]] && break
  sleep 0.1
done
[[ "$(stat -c '%u:%g %a' "$socket")" == "$uid:$socket_gid 660" ]] ||
  fail "the socket is $(stat -c '%u:%g %a' "$socket"), not $uid:$socket_gid 660 (log: $(tail -3 "$log"))"
pid=$(pgrep -f "^/usr/bin/kvtierd --foreground --config /etc/kvtier/kvtier.yaml" | head -1)
[[ -n "$pid" && "$(stat -c %u "/proc/$pid")" == "$uid" ]] || fail "kvtierd does not run as kvtier (pid ${pid:-none})"

"$python" tools/store_load_check.py "$socket" image-check || fail "store and load through the image's socket"
kill -TERM "$pid"
rc=0
wait "$daemon" || rc=$?
[[ "$runtime" != runc ]] || runc delete --force kvtier-image-check-$$ >/dev/null 2>&1 || true
((rc == 0)) || fail "kvtierd exited $rc on SIGTERM: $(tail -5 "$log")"
say "proven ($runtime): the image's kvtierd ran as kvtier, served a client outside through its /run/kvtier volume, stopped cleanly"
