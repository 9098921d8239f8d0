// kvtier-bench remote: two kvtierd nodes sharing a Redis Cluster through the
// remote tier, against a plain pipelined client on the same cluster, in the
// same run.
//
//   - store and load of 256 KiB and 2 MiB blocks through kvtierd: engines on
//     node A store prompts (timed until the remote tier has every block:
//     write-through puts, values with their header and checksum), engines
//     on node B, which holds none of them, load them (fetched from the
//     cluster, checked, promoted into B's host tier, copied into the
//     engine's blocks). Two engine threads each side, batches of 16 blocks.
//     Baseline: RedisCluster::Run of raw SET/GET of as many values of the
//     same size (hiredis, pipelined one round trip per node), batches of 16
//     on 2 threads. Bytes per second, goal >= 0.8x.
//   - a 128-block prompt that misses locally: node B's lookup (client to
//     daemon, the remote tier's EXISTS per node, back) against one pipeline
//     of 128 EXISTS: latency and round trips to the cluster (goal: one per
//     node).
//
// Without --seeds it starts a cluster of its own (3 masters, no replicas,
// persistence off) from Debian's redis-server and redis-cli.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tools/bench_engine.h"

namespace kvtier::bench {

struct RemoteBenchOptions {
  std::vector<std::string> seeds;  // host:port; empty: start a cluster
  uint32_t reps = 5;               // median reported; +1 warm-up
  uint64_t bytes_per_rep = uint64_t{64} << 20;
  std::string json;
};

// Starts nodes A and B with `start_daemon`. Returns the exit code: 0, or 1 on
// any failure or a mismatched byte.
int Remote(const RemoteBenchOptions& options, const StartDaemonFn& start_daemon);

}  // namespace kvtier::bench
