// kvtier-bench remote: the remote tier's client against a plain pipelined
// client on the same Redis Cluster, in the same run.
//
//   - store and load of 256 KiB and 2 MiB blocks: RemoteTier (values with
//     their header and checksums, checked on the way back, batches of 16 on
//     its 2 I/O threads) against RedisCluster::Run of raw SET/GET of the same
//     keys and sizes (hiredis, pipelined one round trip per node, batches of
//     16 on 2 threads): bytes per second, goal >= 0.8x;
//   - a 128-block lookup: RemoteTier::Exists against one pipeline of EXISTS:
//     latency and round trips (goal: one per node).
//
// Not yet through kvtierd: the remote tier is not wired into the daemon.
// Without --seeds it starts a cluster of its own (3 masters, no replicas,
// persistence off) from Debian's redis-server and redis-cli.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvtier::bench {

struct RemoteBenchOptions {
  std::vector<std::string> seeds;  // host:port; empty: start a cluster
  uint32_t reps = 5;               // median reported; +1 warm-up
  uint64_t bytes_per_rep = uint64_t{64} << 20;
  std::string json;
};

// Returns the exit code: 0, or 1 on any failure or a mismatched byte.
int Remote(const RemoteBenchOptions& options);

}  // namespace kvtier::bench
