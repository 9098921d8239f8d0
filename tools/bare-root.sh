#!/usr/bin/env bash
# bare-root.sh: makes a minimal Debian root at ROOT unless one is there
# (debootstrap --variant=minbase of this machine's suite: the C library,
# bash, coreutils, apt, dpkg and little else; none of the build machine's
# libraries, no compiler, no Python). The bare-root checks
# (tools/gpu-bundle-bare-root.sh, tools/deb-bare-root.sh) start from it.
#
# Usage: tools/bare-root.sh ROOT   (as root, with debootstrap from
# tools/setup-deps.sh; fetches about 40 MB from Debian's mirror, once).
# Environment: KVTIER_DEBIAN_MIRROR (default: the first deb.debian.org-style
# URI of apt's sources, else http://deb.debian.org/debian).
set -euo pipefail
root=$(realpath -m "$1")
fail() {
  echo "bare-root: FAILED: $*" >&2
  exit 1
}
if [[ -f "$root/etc/debian_version" && -x "$root/bin/bash" ]]; then
  exit 0
fi
command -v debootstrap >/dev/null 2>&1 || fail "no debootstrap: run tools/setup-deps.sh"
suite=$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")
mirror=${KVTIER_DEBIAN_MIRROR:-$(sed -n 's/^URIs: *\(http[^ ]*\/debian\)$/\1/p' /etc/apt/sources.list.d/*.sources \
  2>/dev/null | head -1)}
mirror=${mirror:-http://deb.debian.org/debian}
echo "bare-root: debootstrap --variant=minbase $suite $root $mirror"
rm -rf "$root"
mkdir -p "$(dirname "$root")"
debootstrap --variant=minbase "$suite" "$root" "$mirror" >"$root.debootstrap.log" 2>&1 ||
  { tail -20 "$root.debootstrap.log"; fail "debootstrap (log: $root.debootstrap.log)"; }
