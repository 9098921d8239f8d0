# bare-root-lib.sh: what the bare-root checks (tools/deb-bare-root.sh,
# tools/wheel-bare-root.sh) share; sourced, never run. Set CHECK (the name
# their lines start with) before sourcing it. Outside the root:
#   require_root           exits 0 saying "not run" unless this is root
#   fresh_copy BASE COPY   a fresh copy of the bare root BASE (tools/bare-root.sh
#                          makes it once) at COPY, with this machine's DNS
# Inside `unshare --mount --fork` (the mounts vanish with the namespace):
#   mount_root ROOT        /dev, /proc and a fresh /run in ROOT
#   in_root CMD...         CMD in ROOT as root, with a clean environment
#   await_socket SOCK PID LOG  until SOCK exists (10 s at most) or PID exits
#   stop_daemon PID LOG    SIGTERM, and the exit status must be 0
#   small_tiers            kvtierd's --set arguments for tiers small enough
#                          for a check, without a metrics port
say() { echo "$CHECK: $*"; }
fail() {
  echo "$CHECK: FAILED: $*" >&2
  exit 1
}
require_root() {
  if [[ $(id -u) -ne 0 ]]; then
    say "not run: a chroot needs root"
    exit 0
  fi
}
fresh_copy() {
  tools/bare-root.sh "$1"
  rm -rf "$2"
  cp -a "$1" "$2"
  cp /etc/resolv.conf "$2/etc/resolv.conf"
}
mount_root() {
  mount --make-rprivate /
  mount --rbind /dev "$1/dev"
  mount -t proc proc "$1/proc"
  mount -t tmpfs tmpfs "$1/run"
}
in_root() { chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root "$@"; }
await_socket() {
  local socket=$1 pid=$2 log=$3
  for _ in $(seq 100); do
    [[ -S "$socket" ]] && return 0
    kill -0 "$pid" 2>/dev/null || { cat "$log"; fail "kvtierd exited"; }
    sleep 0.1
  done
  cat "$log"
  fail "no socket after 10 s"
}
stop_daemon() {
  local pid=$1 log=$2 rc=0
  kill -TERM "$pid" 2>/dev/null || { cat "$log"; fail "kvtierd had exited before SIGTERM"; }
  wait "$pid" || rc=$?
  ((rc == 0)) || fail "kvtierd exited $rc on SIGTERM: $(tail -5 "$log")"
}
small_tiers=(--set tiers.host.bytes=64MiB --set tiers.disk.bytes=128MiB --set tiers.disk.region_bytes=16MiB
  --set metrics.enabled=false)
