#!/usr/bin/env bash
# image.sh: builds kvtierd's sidecar container image, an OCI image archive
# (build/image/kvtier-VERSION-oci.tar), and prints its path. No container
# daemon and no base image from a registry: the root is Debian 12's own
# (tools/bare-root.sh, debootstrap), the Debian package (tools/deb.sh) is
# installed into it with apt, and umoci (Debian's package) makes the image:
#   - entrypoint `kvtierd --foreground --config /etc/kvtier/kvtier.yaml`, as
#     user kvtier (the package's), working directory /var/lib/kvtier;
#   - volumes /etc/kvtier (the config, and token files), /run/kvtier (the
#     socket, shared with the engine's container) and /var/lib/kvtier (the
#     state: salts and the disk index, so a restarted sidecar comes back warm);
#   - labels org.opencontainers.image.{version,source,title,description,licenses};
#   - one layer: the root less apt's lists and caches, docs and man pages;
#   - the package's config, less socket.group: the socket is kvtier's own
#     gid (label io.kvtier.socket-gid), which engines' containers join.
# `podman load -i ARCHIVE`, `skopeo copy oci-archive:ARCHIVE docker://...`
# and `ctr image import` take the archive. tools/image-check.sh proves it.
#
# Usage: tools/image.sh [OUT_DIR]   (as root: a chroot and files owned by
# kvtier; default build/image). Environment: KVTIER_DEB (a package to use
# instead of a fresh tools/deb.sh), KVTIER_SOURCE_URL (the source label;
# default: git's remote origin). Exit status: 0 built (or "not run" when not
# root), 1 failed.
set -euo pipefail
cd "$(dirname "$0")/.."
CHECK=image
source tools/bare-root-lib.sh
require_root
for tool in umoci skopeo; do
  command -v "$tool" >/dev/null 2>&1 || fail "no $tool: run tools/setup-deps.sh"
done
out=$(realpath -m "${1:-build/image}")
start=$SECONDS
deb=${KVTIER_DEB:-$(tools/deb.sh)}
[[ -f "$deb" ]] || fail "no package at $deb"
version=$(dpkg-deb -f "$deb" Version)
# The source: $KVTIER_SOURCE_URL (a release's), else this clone's origin.
source_url=${KVTIER_SOURCE_URL:-$(git config --get remote.origin.url 2>/dev/null || echo unknown)}
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)

rm -rf "$out"
mkdir -p "$out"
rootfs=$out/rootfs
fresh_copy "$(realpath -m "${KVTIER_BARE_ROOT:-build/bare-root}")" "$rootfs"
cp "$deb" "$rootfs/tmp/kvtier.deb"
rm -f /tmp/image-apt.log
unshare --mount --fork bash -s "$rootfs" <<'INSIDE' || { tail -20 /tmp/image-apt.log; fail "installing the package into the root (log: /tmp/image-apt.log)"; }
set -euo pipefail
root=$1
source tools/bare-root-lib.sh
mount_root "$root"
in_root apt-get update -q >>/tmp/image-apt.log 2>&1
in_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends /tmp/kvtier.deb >>/tmp/image-apt.log 2>&1
INSIDE
[[ -x "$rootfs/usr/bin/kvtierd" ]] || fail "kvtierd is not in the root"
# What the image does not need: the package file, apt's lists and caches,
# documentation, and this machine's DNS (the runtime gives its own).
rm -rf "$rootfs/tmp/kvtier.deb" "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* \
  "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs/etc/resolv.conf"
touch "$rootfs/etc/resolv.conf"
# The volumes' mount points, kvtier's (the runtime mounts over them).
uid=$(chroot "$rootfs" id -u kvtier)
gid=$(chroot "$rootfs" id -g kvtier)
install -d -o "$uid" -g "$gid" -m 0755 "$rootfs/run/kvtier"
# In a container the socket is the daemon's own group's (gid $gid): an image
# config gives a process no supplementary groups, so kvtierd could not give
# it to kvtier-clients, and engines in other containers join the gid itself
# (Kubernetes: supplementalGroups; docs/deploy-k8s.md). The config volume is
# the sidecar's alone there: no engine reads it.
grep -q '^  group: kvtier-clients' "$rootfs/etc/kvtier/kvtier.yaml" || fail "the package's config names no socket.group"
sed -i "s|^  group: kvtier-clients.*|  # group: unset in the image: the socket is gid $gid's (kvtier), which engines' containers join|" \
  "$rootfs/etc/kvtier/kvtier.yaml"
install -d -o "$uid" -g "$gid" -m 0700 "$rootfs/var/lib/kvtier"

layout=$out/oci
tag=$version
umoci init --layout "$layout"
umoci new --image "$layout:$tag"
bundle=$out/bundle
umoci unpack --image "$layout:$tag" "$bundle" >/dev/null
rm -rf "$bundle/rootfs"
mv "$rootfs" "$bundle/rootfs"
umoci repack --image "$layout:$tag" "$bundle"
umoci config --image "$layout:$tag" \
  --config.user kvtier:kvtier \
  --config.entrypoint /usr/bin/kvtierd --config.cmd --foreground --config.cmd --config \
  --config.cmd /etc/kvtier/kvtier.yaml \
  --config.workingdir /var/lib/kvtier \
  --config.env PATH=/usr/sbin:/usr/bin:/sbin:/bin \
  --config.volume /etc/kvtier --config.volume /run/kvtier --config.volume /var/lib/kvtier \
  --config.label "org.opencontainers.image.version=$version" \
  --config.label "org.opencontainers.image.source=$source_url" \
  --config.label "org.opencontainers.image.revision=$revision" \
  --config.label "org.opencontainers.image.title=kvtier" \
  --config.label "org.opencontainers.image.description=kvtierd, the tiered KV-cache offload daemon, as a sidecar" \
  --config.label "org.opencontainers.image.licenses=Apache-2.0" \
  --config.label "io.kvtier.socket-gid=$gid" \
  --history.created_by "tools/image.sh: Debian 12 minbase and kvtier_${version}_amd64.deb"
umoci gc --layout "$layout"
rm -rf "$bundle"
archive=$out/kvtier-$version-oci.tar
tar -C "$layout" -cf "$archive" .
rm -rf "$layout"
skopeo inspect "oci-archive:$archive" >"$out/inspect.json" || fail "skopeo does not take $archive"
grep -q "\"org.opencontainers.image.version\": \"$version\"" "$out/inspect.json" ||
  fail "the image's labels do not give version $version: $(cat "$out/inspect.json")"
echo "image: $(basename "$archive"): $(($(stat -c %s "$archive") >> 20)) MiB, built in $((SECONDS - start)) s" \
  "(the package included); its socket's gid is $gid" >&2
echo "$archive"
