// RedisCluster: runs batches of single-key commands on a Redis Cluster, or on
// one standalone endpoint (a plain Redis, or a proxy), through RedisConnection.
//
// A batch is pipelined: its commands are grouped by the node that serves
// their key's slot, every group is written before any reply is read, so a
// batch costs one round trip per node involved. Redirections are followed as
// the Redis Cluster specification says: MOVED updates the slot map and the
// command is sent again (and the whole map is refreshed from CLUSTER SLOTS
// after the batch), ASK sends ASKING and the command to the named node once,
// TRYAGAIN retries, all within `max_redirects` rounds. A node that cannot be
// reached fails only its own commands (kUnavailable), and its connection is
// made again on the next batch.
//
// One instance per I/O thread: it owns its connections (one per node) and
// its copy of the slot map. Thread-compatible.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "tiers/remote/cluster_slots.h"
#include "tiers/remote/redis_connection.h"

namespace kvtier {

struct RedisClusterOptions {
  std::vector<NodeAddress> seeds;  // REQUIRED: at least one
  std::string user = {};
  std::string password = {};
  std::chrono::milliseconds connect_timeout{1000};
  std::chrono::milliseconds io_timeout{1000};
  uint32_t max_redirects = 5;
};

// One command of a batch: argv[1] is its key. With `value_parts`, the
// command has one more argument, their concatenation, written without a copy
// (RedisConnection::AppendWithParts).
struct RedisCommand {
  std::vector<std::string_view> argv;
  std::vector<std::string_view> value_parts = {};
  // Takes the command's string reply in place (RedisConnection::Next); the
  // reply is then an empty string.
  RedisValueSink* sink = nullptr;
  // The key's place in argv, which routes the command (EVAL's is 3).
  size_t key_index = 1;
};

class RedisCluster {
 public:
  // A batch may take io_timeout plus its value bytes at this pace (Run).
  static constexpr double kMinBytesPerSecond = 100e6;

  // Connects to the first seed that answers and reads the topology
  // (CLUSTER SLOTS); a node without cluster support is a standalone
  // endpoint. Errors: kInvalidArgument without seeds; kUnavailable when no
  // seed answers (each seed's error in the message); kUnauthenticated as
  // RedisConnection::Connect.
  static Result<std::unique_ptr<RedisCluster>> Connect(RedisClusterOptions options);

  // Runs a batch (see the header comment). Result i is command i's final
  // reply: error replies other than redirections are replies (the caller
  // judges OOM, NOPERM, ...); kUnavailable when its node could not be
  // reached, did not answer in time (the batch's bound: io_timeout, plus
  // its values' bytes at kMinBytesPerSecond), or the redirections ran out.
  // REQUIRES: every argv has a key.
  std::vector<Result<RedisReply>> Run(std::span<const RedisCommand> batch);

  // Reads CLUSTER SLOTS again from a node that answers (the known nodes,
  // then the seeds). Errors: kUnavailable when none answers.
  Status RefreshTopology();

  bool standalone() const { return standalone_; }
  const SlotMap& slots() const { return slots_; }

  struct Counters {
    uint64_t round_trips = 0;  // node pipelines written and read
    uint64_t moved = 0;
    uint64_t ask = 0;
    uint64_t tryagain = 0;
    uint64_t refreshes = 0;
    uint64_t connect_failures = 0;
  };
  const Counters& counters() const { return counters_; }

 private:
  explicit RedisCluster(RedisClusterOptions options) : options_(std::move(options)) {}
  // The connection to `node`, made if needed. nullptr when it cannot be.
  RedisConnection* ConnectionTo(const NodeAddress& node, Status* error);
  Status ReadTopology(RedisConnection& conn, const NodeAddress& asked);

  RedisClusterOptions options_;
  bool standalone_ = false;
  NodeAddress standalone_node_;
  SlotMap slots_;
  std::unordered_map<std::string, std::unique_ptr<RedisConnection>> connections_;  // by "host:port"
  Counters counters_;
};

}  // namespace kvtier
