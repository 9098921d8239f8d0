// RemoteTier: kvtier's shared tier on a Redis Cluster (or one standalone
// endpoint), below disk. It asks whether blocks exist, fetches them, and
// stores them, one Redis value per block (tiers/remote/remote_value.h), in
// batches pipelined one round trip per node (RedisCluster).
//
// Never in the way of the local tiers:
//   - calls return at once; the network work runs on `io_threads` threads of
//     its own, each with its own connections, and completions come back
//     through Options::post (the owner's event loop);
//   - at most `max_inflight_batches` batches are queued or running; more are
//     refused at once (kResourceExhausted: a miss);
//   - a circuit breaker: `breaker_failures` batches in a row that could not
//     reach the cluster open it; while open every call fails at once with
//     kUnavailable (counted, logged once), and after `breaker_cooldown` one
//     batch probes the cluster again, closing it on success.
// Every failure is a miss to the caller, never a wrong byte: a fetched value
// is served only if it checks (header, key, namespace, length, checksum); a
// value that does not is counted, deleted from the cluster, and a miss.
//
// Threading: every public method may be called from any thread; `done`
// callbacks run through Options::post. Destroying it waits for running
// batches; batches still queued complete with kCancelled.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/key128.h"
#include "common/latency_histogram.h"
#include "common/status.h"
#include "kernels/codec.h"
#include "tiers/remote/circuit_breaker.h"
#include "tiers/remote/put_outcome.h"
#include "tiers/remote/redis_cluster.h"

namespace kvtier {

struct RemoteTierOptions {
  RedisClusterOptions cluster;
  std::string key_prefix = "kvtier:";  // per deployment: two fleets share a cluster by theirs
  uint32_t io_threads = 2;
  uint32_t max_inflight_batches = 64;
  uint64_t max_value_bytes = uint64_t{64} << 20;  // a larger block is not stored remotely
  uint32_t breaker_failures = 3;
  std::chrono::milliseconds breaker_cooldown{2000};
  // REQUIRED: runs a completion on the owner's thread.
  std::function<void(std::function<void()>)> post;
};

// Counters since start; every field is read with relaxed loads.
struct RemoteCounters {
  uint64_t exists_keys = 0;
  uint64_t hits = 0;           // blocks fetched and served
  uint64_t misses = 0;         // blocks asked for and not there (or not fetched)
  uint64_t stores = 0;         // blocks stored
  uint64_t bytes_read = 0;     // value bytes fetched
  uint64_t bytes_written = 0;  // value bytes stored
  uint64_t corrupt = 0;        // values that failed their check (deleted)
  uint64_t errors_unavailable = 0;  // batches that could not reach the cluster
  uint64_t errors_rejected = 0;     // commands the cluster refused (OOM, NOPERM, ...)
  uint64_t refused_busy = 0;        // batches refused: too many in flight
  uint64_t refused_breaker = 0;     // batches refused: breaker open
  uint64_t topology_refreshes = 0;
  uint64_t redirects = 0;           // MOVED and ASK followed
  uint64_t round_trips = 0;         // node pipelines written and read
  uint64_t breaker_opened = 0;
  bool breaker_open = false;
  LatencyHistogram batch_latency;   // per batch, on the I/O thread
};

class RemoteTier {
 public:
  using Done = std::function<void(Result<uint32_t>)>;

  // Starts the I/O threads. The cluster need not be reachable yet: each
  // thread connects on its first batch (and after a failure, on the next).
  // Errors: kInvalidArgument for no seed, no post, zero threads or bounds.
  static Result<std::unique_ptr<RemoteTier>> Start(RemoteTierOptions options);
  ~RemoteTier();
  RemoteTier(const RemoteTier&) = delete;
  RemoteTier& operator=(const RemoteTier&) = delete;

  // How many leading `keys` have a value in the cluster (EXISTS; the value
  // is not checked until it is fetched).
  void Exists(std::vector<StoredKey> keys, Done done);
  // Fetches leading blocks of `keys` into `out` (out[i]: exactly block i's
  // size; valid until `done` runs) while each exists and checks; `done` gets
  // how many. Bytes past that count in `out` are unspecified. With
  // `checksums` (sized like keys, valid until `done` runs), each fetched
  // block's XXH3-64, as checked, is written there. A value stored by a
  // codec is decoded into `out` on the I/O thread; it must be `codec`'s (the
  // namespace's: lossless or fp8), else it is corrupt (a miss, deleted).
  void Get(LayoutFingerprint ns, std::vector<StoredKey> keys, std::vector<std::span<uint8_t>> out, Done done,
           std::vector<uint64_t>* checksums = nullptr, CodecParams codec = {});
  // How a payload of Put is stored: the block's bytes, or a codec's output
  // of a block of `raw_bytes`.
  struct Form {
    CodecKind codec = CodecKind::kNone;
    uint64_t raw_bytes = 0;
  };
  using PutOutcome = RemotePutOutcome;
  // Stores each block (payloads valid until `done` runs); `done` gets how
  // many were stored (a refused one is counted in errors_rejected). `forms`
  // (empty: every payload raw) says what each payload is. `outcomes`, when
  // given, holds keys.size() kNotReached and gets each block's outcome
  // before `done` runs.
  void Put(LayoutFingerprint ns, std::vector<StoredKey> keys,
           std::vector<std::span<const uint8_t>> payloads, Done done, std::vector<Form> forms = {},
           std::vector<PutOutcome>* outcomes = nullptr);

  RemoteCounters counters() const;
  const RemoteTierOptions& options() const { return options_; }

 private:
  enum class Kind : uint8_t { kExists, kGet, kPut };
  struct Batch {
    Kind kind = Kind::kExists;
    LayoutFingerprint ns = {};
    std::vector<StoredKey> keys = {};
    std::vector<std::span<uint8_t>> out = {};
    std::vector<std::span<const uint8_t>> payloads = {};
    Done done = {};
    std::vector<uint64_t>* checksums = nullptr;
    CodecParams codec = {};  // kGet: the namespace's
    std::vector<Form> forms = {};  // kPut
    std::vector<PutOutcome>* outcomes = nullptr;  // kPut
  };
  struct Worker;

  explicit RemoteTier(RemoteTierOptions options);
  void Submit(Batch batch);
  void Finish(Batch& batch, Result<uint32_t> result);
  void Loop(Worker& worker);
  // Runs one batch on `worker`'s cluster; kUnavailable when it cannot be reached.
  Result<uint32_t> Execute(Worker& worker, Batch& batch);
  Result<uint32_t> DoExists(RedisCluster& cluster, const Batch& batch);
  // `coder`: the worker's, for a namespace with a codec (else null).
  Result<uint32_t> DoGet(RedisCluster& cluster, BlockCodec* coder, Batch& batch);
  Result<uint32_t> DoPut(RedisCluster& cluster, const Batch& batch);

  RemoteTierOptions options_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Batch> queue_;
  uint32_t inflight_ = 0;  // queued or running
  bool stopping_ = false;
  CircuitBreaker breaker_;
  bool refusal_logged_ = false;  // under mu_: a node refused us (AUTH), said once
  // Under mu_; the breaker keeps its own counters.
  RemoteCounters counters_;
  std::vector<std::unique_ptr<Worker>> workers_;
};

// The command that deletes `key` only while it still holds `value` (the
// bytes a fetch found corrupt): an EVAL of a compare-and-delete. For
// RemoteTier, and its test.
RedisCommand DeleteIfUnchanged(std::string_view key, std::string_view value);

}  // namespace kvtier
