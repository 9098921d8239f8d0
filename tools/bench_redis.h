// Redis baselines for kvtier-bench (tools/bench.cc): a redis-server that the
// bench starts on a private unix socket, a hiredis connection that uses it
// the way a shared-KV-backend user does (one binary key per block, commands
// pipelined: all written, then all replies read), and the `redis` workload:
// 2 MiB blocks stored then loaded through kvtierd and through Redis, the same
// bytes on both sides, byte-verified on both sides.
//
// The server runs with persistence off (--save '' --appendonly no), no TCP
// port, maxmemory set and noeviction, so a full server fails a SET instead of
// dropping blocks. It is killed when its RedisServer is destroyed, and also
// when the bench dies (PR_SET_PDEATHSIG).
//
// Thread-compatible: one thread uses a server and its connections.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "kvtier/client.h"

struct redisContext;

namespace kvtier::bench {

class RedisServer {
 public:
  struct Options {
    // Redis' maxmemory; with noeviction, a SET beyond it fails.
    uint64_t maxmemory_bytes = uint64_t{1} << 30;
  };

  // Starts redis-server (from PATH, else /usr/bin/redis-server) in a new
  // directory under /tmp and waits until it answers PING. Errors: kNotFound
  // when there is no redis-server; kUnavailable when it exits or does not
  // answer within 10 s (its log's tail in the message); an errno status when
  // the directory or process cannot be made.
  static Result<std::unique_ptr<RedisServer>> Start(const Options& options);
  // SIGTERM, wait, remove the directory (kept with KVTIER_KEEP_TEST_DIRS).
  ~RedisServer();
  RedisServer(const RedisServer&) = delete;
  RedisServer& operator=(const RedisServer&) = delete;

  const std::string& socket_path() const { return socket_; }
  // "7.0.15": INFO's redis_version.
  const std::string& version() const { return version_; }

 private:
  RedisServer(std::string dir, pid_t pid)
      : dir_(std::move(dir)), socket_(dir_ + "/redis.sock"), pid_(pid) {}
  std::string dir_, socket_, version_;
  pid_t pid_ = -1;
};

// One hiredis connection (blocking) to a unix socket.
class RedisConnection {
 public:
  // Errors: kUnavailable when the socket does not accept the connection.
  static Result<std::unique_ptr<RedisConnection>> Connect(const std::string& socket_path);
  ~RedisConnection();
  RedisConnection(const RedisConnection&) = delete;
  RedisConnection& operator=(const RedisConnection&) = delete;

  // One command; its reply as a string (status, bulk string or integer).
  // Errors: kIoError when the connection fails, kInternal for an error reply.
  Result<std::string> Command(std::span<const std::string_view> argv);

  // SET keys[i] values[i], pipelined. REQUIRES: the spans have one length.
  // Errors: as Command, for the first failing SET.
  Status PipelinedSet(std::span<const std::string_view> keys,
                      std::span<const std::span<const uint8_t>> values);
  // GET keys[i], pipelined, each value copied into out[i] (an engine's KV
  // cache block, as a load lands there). REQUIRES: the spans have one
  // length. Errors: kNotFound for a missing key, kCorruption for a value
  // whose size is not out[i]'s, else as Command.
  Status PipelinedGet(std::span<const std::string_view> keys,
                      std::span<const std::span<uint8_t>> out);
  // EXISTS of each key, pipelined: the per-key answer a prefix lookup needs.
  // Returns how many leading keys exist (as kvtier's Lookup counts hits).
  Result<uint32_t> PipelinedExists(std::span<const std::string_view> keys);
  // One `EXISTS k1 .. kn`: how many of the keys exist, without saying which.
  Result<uint64_t> CountExisting(std::span<const std::string_view> keys);

 private:
  explicit RedisConnection(redisContext* context) : context_(context) {}
  Status AppendArgv(std::span<const std::string_view> argv);
  redisContext* context_;  // owned
};

// A block key as a Redis key: its 16 bytes, binary (what kvtier's wire
// carries). Valid while `key` lives.
std::string_view RedisKey(const BlockKey& key);

// Redis' side of `kvtier-bench lookup`: starts a Redis of its own, SETs every
// key (1-byte values: EXISTS reads none), then times `reps` round trips of
// one pipeline of EXISTS per key, each checked to find every key, and `reps`
// of one `EXISTS k1 .. kn` (a count only, for reference). Errors: as
// RedisServer::Start, or the first failing command.
struct RedisLookupTimes {
  std::string version;               // the server's
  std::vector<double> pipelined_us;  // per round trip
  std::vector<double> count_us;
};
Result<RedisLookupTimes> RedisLookupMicros(std::span<const BlockKey> keys, uint32_t reps);

// The `redis` workload: per rep, `blocks` blocks of `layout` stored then
// loaded through kvtierd (a memfd ShmKvCache registered with `client`) and
// through a Redis of its own (pipelined SET, then pipelined GET copied into
// the same cache), each side timed store and load apart and verified byte for
// byte; medians over `reps` after one warm-up, progress every rep, and the
// comparisons to stdout and to `json` (when not empty). `daemon` says which
// kvtierd ran (for the config). Returns the exit code: 0, or 1 on any
// failure or a mismatched byte.
int RedisWorkload(kvtier::Client& client, const Layout& layout, uint32_t blocks, uint32_t reps,
                  const std::string& daemon, const std::string& json);

}  // namespace kvtier::bench
