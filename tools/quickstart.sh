#!/usr/bin/env bash
# Quickstart on a fresh machine: installs dependencies, builds Release into
# build/release, starts kvtierd on its built-in default configuration (sized
# down for a demo), runs several client processes holding multi-turn
# conversations over shared system prompts, prints what happened in each
# tier, and stops the daemon.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> [%s] %s\n' "$(date +%H:%M:%S)" "$*"; }
bin=build/release/bin

step "dependencies"
tools/setup-deps.sh

step "build (Release, build/release)"
cmake -S . -B build/release -DCMAKE_BUILD_TYPE=Release -DKVTIER_BUILD_TESTS=OFF
cmake --build build/release -j"$(nproc)"

# The built-in defaults, with the tiers sized for a demo: a 16 MiB hbm tier
# (on a machine without a GPU the host backend stands a CPU arena in for it),
# a 32 MiB host tier and a 256 MiB disk tier under ./var/kvtier/disk, so that
# blocks are demoted, promoted and written to disk.
demo_sets=(--set tiers.hbm.enabled=true --set tiers.hbm.bytes=16MiB --set tiers.host.bytes=32MiB
           --set tiers.disk.bytes=256MiB --set tiers.disk.region_bytes=16MiB)
socket=./var/kvtier/kvtierd.sock   # named: the default may be $KVTIER_SOCKET's or $XDG_RUNTIME_DIR's
demo_sets+=(--set "socket.path=$socket")
log=./var/kvtier/kvtierd.log
mkdir -p ./var/kvtier

step "start kvtierd (log: $log)"
# Without --foreground kvtierd returns once it listens, leaving the daemon running.
"$bin/kvtierd" "${demo_sets[@]}" --pid-file ./var/kvtier/kvtierd.pid 2>"$log"
pid=$(cat ./var/kvtier/kvtierd.pid)
trap '[ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null || true' EXIT
echo "kvtierd is running (pid $pid) on $socket"

step "demo: client processes with multi-turn conversations"
"$bin/kvtier-demo" --socket "$socket" --clients 4 --conversations 6 --turns 4

step "kvtierctl stats"
"$bin/kvtierctl" --socket "$socket" stats

step "stop kvtierd"
kill -TERM "$pid"
for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$pid" 2>/dev/null; then echo "kvtierd did not stop" >&2; exit 1; fi
trap - EXIT
tail -n 2 "$log"
echo "done"
