// kvtier-bench trace: replays a Mooncake request trace (tools/trace_sim.h)
// through kvtierd with K client processes (tools/trace_replay.h: one kvtier
// block per 512-token trace block, chained keys, lookup / load the hit
// prefix / store the rest) and reports its hit rates, per tier and overall,
// and the bytes it moved, next to simulated caches of the same capacity:
// unbounded (the trace's reuse ceiling), LRU and Belady's offline optimum.
//
// Capacity in blocks: each memory tier's bytes / the block's 4 KiB-aligned
// slot, plus the disk's bytes / its record (a 4 KiB header + the block).
//
// Single-threaded driver; the clients are separate processes.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/layout.h"
#include "common/status.h"
#include "tools/bench_engine.h"

namespace kvtier::bench {

struct TraceOptions {
  std::string trace_path;  // REQUIRED: a JSONL trace
  // Tier sizes of a started daemon (0 = tier off; host must be > 0). With a
  // running daemon (`socket`) its own capacities are used instead.
  uint64_t hbm_bytes = 0;
  uint64_t host_bytes = 0;
  uint64_t disk_bytes = 0;
  uint64_t block_bytes = 64 << 10;               // a multiple of 4 KiB
  // The replaying tenant's quotas on a started daemon (0 = none).
  uint64_t host_quota_bytes = 0;
  uint64_t disk_quota_bytes = 0;
  uint32_t clients = 4;                          // 1..kMaxReplayClients (64)
  uint64_t requests = 0;                         // the first N requests in timestamp order; 0 = all
  double speed = 0;                              // 0 = as fast as possible; else x the trace's pace
  std::string dir = "./var/kvtier-bench-trace";  // disk segments (started daemon only)
  std::string socket;                            // a running kvtierd; empty = start one
  std::vector<std::string> sets;                 // extra `--set key=value` for a started daemon
  std::string json;                              // also write the report here
  // A codec (lossless or fp8): the replay runs twice on daemons of its own,
  // with the codec and without (none), the same tier bytes and KV-like block
  // contents, and reports the hit rates side by side.
  CodecKind codec = CodecKind::kNone;
  // Keep each request's partial last block (looked up and stored, as
  // before issue 19); by default only full blocks are, as engines do.
  bool partial_tail = false;
  // An eviction policy (lru, s3fifo, classes): the started daemon runs it
  // (policy.eviction), and a sweep of 1k-20k blocks and the daemon's
  // capacity simulates it through kvtier's own index next to LRU and
  // Belady, on the requests after the tuning split (tools/policy_sim.h).
  std::string policy;
  // With `policy`: replays it and LRU through daemons of their own at
  // 1k-20k blocks, one tier and all three, instead of the one replay.
  bool sweep = false;
  // Another process writes to the disk tier's file system while the clients
  // replay (issue 32's contended disk): fio, sequential 1 MiB O_DIRECT
  // writes at queue depth 8 over a 1 GiB file in `dir`, as fast as it can.
  bool contend = false;
};

// Runs the replay and the simulations and prints (and writes) the report.
// It stops the daemon it started before removing the disk tier's segments.
// Returns the process exit code: 0, or 1 after printing what failed
// (unreadable trace, daemon unreachable, a client's error, wrong bytes).
int Trace(TraceOptions options, const StartDaemonFn& start_daemon);

}  // namespace kvtier::bench
