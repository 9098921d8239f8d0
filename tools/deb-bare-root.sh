#!/usr/bin/env bash
# deb-bare-root.sh: proves the Debian package (tools/deb.sh) on a bare Debian
# root (tools/bare-root.sh: no compiler, no -dev packages, none of this
# machine's libraries), in a copy of it:
#   - `apt-get install ./kvtier_*.deb` pulls its Depends from Debian's mirror;
#   - kvtierd --version and kvtierctl version say the release;
#   - the package made the kvtier user and group, the engines' group
#     kvtier-clients (kvtier a member), the state directory kvtier's alone
#     (0700), and /etc/kvtier/kvtier.yaml root:kvtier 0640;
#   - kvtierd starts as the kvtier user with the package's unit's arguments
#     (no systemd in a chroot: started directly, as the unit would);
#   - a user in group kvtier-clients reaches it through the socket (kvtier:
#     kvtier-clients 0660) and is served (kvtierctl status, as a tenant by
#     uid); a user outside the group is refused by the socket's mode;
#   - that engine user cannot read the config, a tenant's token_file, or the
#     state directory (salts, the disk index); kvtierd --check-config warns
#     about a config with an inline token that group kvtier can read;
#   - `apt-get purge kvtier` removes the binaries, the config and the state.
#
# Usage: tools/deb-bare-root.sh [DEB]   (as root; DEB defaults to a fresh
# tools/deb.sh). Exit status: 0 proven, 1 failed, 0 with "not run" when not
# root.
set -euo pipefail
cd "$(dirname "$0")/.."
CHECK=deb-bare-root
source tools/bare-root-lib.sh
require_root
deb=${1:-$(tools/deb.sh)}
[[ -f "$deb" ]] || fail "no package at $deb"
root=$(realpath -m build/bare-root-deb)
fresh_copy "$(realpath -m "${KVTIER_BARE_ROOT:-build/bare-root}")" "$root"
cp "$deb" "$root/tmp/"
name=$(basename "$deb")
version=$(dpkg-deb -f "$deb" Version)

# Everything below runs in a new mount namespace (its mounts vanish with it)
# on this machine's network (apt needs the mirror).
unshare --mount --fork bash -s "$root" "$name" "$version" <<'INSIDE' || fail "see above"
set -euo pipefail
root=$1 name=$2 version=$3
CHECK=deb-bare-root
source tools/bare-root-lib.sh
mount_root "$root"
as_user() {
  local user=$1
  shift
  in_root setpriv --reuid="$user" --regid="$user" --init-groups "$@"
}

in_root apt-get update -q >/tmp/deb-bare-root.apt.log 2>&1 || { tail -20 /tmp/deb-bare-root.apt.log; fail "apt-get update"; }
in_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "/tmp/$name" >>/tmp/deb-bare-root.apt.log 2>&1 ||
  { tail -30 /tmp/deb-bare-root.apt.log; fail "apt-get install ./$name"; }
say "installed $name: $(in_root dpkg-query -W -f '${Installed-Size}' kvtier) KiB, with $(grep -c '^Setting up' /tmp/deb-bare-root.apt.log) packages set up"

[[ "$(in_root kvtierd --version)" == "kvtierd $version "* ]] || fail "kvtierd --version: $(in_root kvtierd --version)"
in_root getent passwd kvtier >/dev/null || fail "no kvtier user"
in_root getent group kvtier >/dev/null || fail "no kvtier group"
in_root getent group kvtier-clients >/dev/null || fail "no kvtier-clients group"
[[ " $(in_root id -nG kvtier) " == *" kvtier-clients "* ]] || fail "kvtier is not in kvtier-clients: $(in_root id -nG kvtier)"
[[ "$(in_root stat -c '%U:%G %a' /etc/kvtier/kvtier.yaml)" == "root:kvtier 640" ]] ||
  fail "/etc/kvtier/kvtier.yaml is $(in_root stat -c '%U:%G %a' /etc/kvtier/kvtier.yaml)"
[[ "$(in_root stat -c '%U:%G %a' /var/lib/kvtier)" == "kvtier:kvtier 700" ]] ||
  fail "/var/lib/kvtier is $(in_root stat -c '%U:%G %a' /var/lib/kvtier), not kvtier's alone"
[[ -f "$root/usr/lib/systemd/system/kvtierd.service" ]] || fail "no systemd unit"
[[ -f "$root/usr/lib/sysusers.d/kvtier.conf" ]] || fail "no sysusers file"
[[ -n "$(find "$root/usr/lib" -name kvtier.pc | head -1)" ]] || fail "no kvtier.pc"
[[ -f "$root/usr/include/kvtier/client.h" ]] || fail "no headers"

in_root kvtierd --config /etc/kvtier/kvtier.yaml --check-config >/dev/null || fail "the shipped config does not check"
# An engine user in group kvtier-clients, named as a tenant; another user
# outside it; a tenant by token, its token in a file kvtierd alone reads.
in_root useradd --create-home --user-group engine
in_root usermod -a -G kvtier-clients engine
openssl_token=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
printf '%s\n' "$openssl_token" >"$root/etc/kvtier/batch.token"
in_root chown kvtier:kvtier /etc/kvtier/batch.token
in_root chmod 0400 /etc/kvtier/batch.token
in_root useradd --create-home --user-group stranger
uid=$(in_root id -u engine)
cat >"$root/etc/kvtier/kvtier.yaml.test" <<CONFIG
socket:
  path: /run/kvtier/kvtierd.sock
  mode: 0660
  group: kvtier-clients
state_dir: /var/lib/kvtier
tiers:
  host:
    bytes: 64MiB
  disk:
    enabled: true
    paths: [/var/lib/kvtier/disk]
    bytes: 128MiB
    region_bytes: 16MiB
metrics:
  enabled: false
tenants:
  - name: engine
    uid: $uid
  - name: batch
    token_file: /etc/kvtier/batch.token
CONFIG
in_root install -o root -g kvtier -m 0640 /etc/kvtier/kvtier.yaml.test /etc/kvtier/kvtier.yaml
in_root rm /etc/kvtier/kvtier.yaml.test
# What kvtierd.service does: RuntimeDirectory=kvtier, User=kvtier, its ExecStart.
in_root install -d -o kvtier -g kvtier -m 0755 /run/kvtier
exec_start=$(sed -n 's/^ExecStart=//p' "$root/usr/lib/systemd/system/kvtierd.service")
# A simple command in the background: $! is chroot's pid, and chroot, env
# and setpriv each exec the next, so it is kvtierd's.
chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/ \
  setpriv --reuid=kvtier --regid=kvtier --init-groups $exec_start >/tmp/deb-bare-root.kvtierd.log 2>&1 &
daemon=$!
trap 'kill -KILL "$daemon" 2>/dev/null || true' EXIT
await_socket "$root/run/kvtier/kvtierd.sock" "$daemon" /tmp/deb-bare-root.kvtierd.log
[[ "$(in_root stat -c '%U:%G %a' /run/kvtier/kvtierd.sock)" == "kvtier:kvtier-clients 660" ]] ||
  fail "the socket is $(in_root stat -c '%U:%G %a' /run/kvtier/kvtierd.sock)"
status=$(as_user engine kvtierctl --socket /run/kvtier/kvtierd.sock status) || fail "kvtierctl status as engine"
grep -q "scope     tenant engine" <<<"$status" || { echo "$status"; fail "not served as tenant engine"; }
[[ "$(as_user engine kvtierctl --socket /run/kvtier/kvtierd.sock version)" == *"kvtierd   $version"* ]] ||
  fail "kvtierctl version"
if as_user stranger kvtierctl --socket /run/kvtier/kvtierd.sock status >/dev/null 2>&1; then
  fail "a user outside group kvtier-clients reached the socket"
fi
# The token tenant is served (its token from the file), and the engine user
# can read neither the config, nor the token, nor the state.
as_user engine kvtierctl --socket /run/kvtier/kvtierd.sock --token "$openssl_token" status | grep -q "scope     tenant batch" ||
  fail "the token_file tenant is not served"
for private in /etc/kvtier/kvtier.yaml /etc/kvtier/batch.token; do
  if as_user engine cat "$private" >/dev/null 2>&1; then fail "an engine user read $private"; fi
done
if as_user engine ls /var/lib/kvtier >/dev/null 2>&1; then fail "an engine user listed /var/lib/kvtier"; fi
index=$(in_root find /var/lib/kvtier -mindepth 1 -maxdepth 2 | head -1)
[[ -n "$index" ]] || fail "kvtierd wrote nothing under /var/lib/kvtier"
stop_daemon "$daemon" /tmp/deb-bare-root.kvtierd.log
trap - EXIT
say "kvtierd ran as kvtier; served tenants in group kvtier-clients through the socket, refused a user outside it; the engine read no config, token or state"
# An inline token in a config group kvtier can read: --check-config warns.
in_root sh -c "sed 's|token_file: /etc/kvtier/batch.token|token: $openssl_token|' /etc/kvtier/kvtier.yaml >/etc/kvtier/inline.yaml"
in_root chown root:kvtier /etc/kvtier/inline.yaml
in_root chmod 0640 /etc/kvtier/inline.yaml
in_root kvtierd --config /etc/kvtier/inline.yaml --check-config 2>&1 >/dev/null | grep -q "warning: /etc/kvtier/inline.yaml holds tenants' tokens and is mode 0640" ||
  fail "kvtierd --check-config did not warn about an inline token group kvtier can read"
in_root rm /etc/kvtier/inline.yaml
say "kvtierd --check-config warned about an inline token in a config group kvtier can read"

in_root env DEBIAN_FRONTEND=noninteractive apt-get purge -y -q kvtier >>/tmp/deb-bare-root.apt.log 2>&1 || fail "apt-get purge"
for gone in /usr/bin/kvtierd /usr/bin/kvtierctl /usr/include/kvtier /etc/kvtier /var/lib/kvtier \
  /usr/lib/systemd/system/kvtierd.service; do
  [[ ! -e "$root$gone" ]] || fail "$gone is still there after purge"
done
in_root dpkg-query -W kvtier >/dev/null 2>&1 && fail "kvtier is still known to dpkg"
say "purged: nothing of the package is left"
INSIDE
rm -rf "$root"
say "proven: apt install, start as kvtier, reached through the socket's group kvtier-clients, tokens and state private, purged"
