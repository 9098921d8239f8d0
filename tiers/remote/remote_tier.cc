#include "tiers/remote/remote_tier.h"

#include <hiredis/hiredis.h>
#include <pthread.h>
#include <spdlog/spdlog.h>

#include <array>
#include <csignal>
#include <cstring>
#include <optional>
#include <utility>

#include "common/check.h"
#include "tiers/remote/remote_value.h"

namespace kvtier {

struct RemoteTier::Worker {
  std::thread thread;
  std::unique_ptr<RedisCluster> cluster;
  std::unique_ptr<BlockCodec> coder;  // decodes coded values, made on first use
  RedisCluster::Counters seen;  // the cluster's counters already folded into counters_
};

namespace {

// A reply that says the cluster cannot serve now, as opposed to refusing
// this command (OOM, NOPERM, ...).
bool ClusterCannotServe(std::string_view error) {
  return error.starts_with("CLUSTERDOWN") || error.starts_with("LOADING") || error.starts_with("MASTERDOWN") ||
         error.starts_with("TRYAGAIN");
}

}  // namespace

RemoteTier::RemoteTier(RemoteTierOptions options)
    : options_(std::move(options)),
      breaker_({.failures = options_.breaker_failures, .cooldown = options_.breaker_cooldown}) {}

Result<std::unique_ptr<RemoteTier>> RemoteTier::Start(RemoteTierOptions options) {
  if (options.cluster.seeds.empty()) return Err(InvalidArgument("tiers.remote: no seed node"));
  if (!options.post) return Err(InvalidArgument("tiers.remote: no post function"));
  if (options.io_threads == 0 || options.max_inflight_batches == 0 || options.breaker_failures == 0) {
    return Err(InvalidArgument("tiers.remote: io_threads, max_inflight_batches and breaker_failures must be > 0"));
  }
  if (options.max_value_bytes <= RemoteValueHeader::kBytes) {
    return Err(InvalidArgument("tiers.remote: max_value_bytes must exceed the " +
                               std::to_string(RemoteValueHeader::kBytes) + "-byte value header"));
  }
  std::unique_ptr<RemoteTier> tier(new RemoteTier(std::move(options)));
  for (uint32_t i = 0; i < tier->options_.io_threads; ++i) {
    tier->workers_.push_back(std::make_unique<Worker>());
    Worker& w = *tier->workers_.back();
    w.thread = std::thread([t = tier.get(), &w] { t->Loop(w); });
  }
  return tier;
}

RemoteTier::~RemoteTier() {
  std::deque<Batch> left;
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    left.swap(queue_);
  }
  cv_.notify_all();
  for (auto& w : workers_) w->thread.join();
  for (Batch& b : left) Finish(b, Err(StatusCode::kCancelled, "the remote tier is stopping"));
}

void RemoteTier::Exists(std::vector<StoredKey> keys, Done done) {
  Submit(Batch{.kind = Kind::kExists, .keys = std::move(keys), .done = std::move(done), .checksums = nullptr});
}

void RemoteTier::Get(LayoutFingerprint ns, std::vector<StoredKey> keys, std::vector<std::span<uint8_t>> out,
                     Done done, std::vector<uint64_t>* checksums, CodecParams codec) {
  Submit(Batch{.kind = Kind::kGet,
               .ns = ns,
               .keys = std::move(keys),
               .out = std::move(out),
               .done = std::move(done),
               .checksums = checksums,
               .codec = codec});
}

void RemoteTier::Put(LayoutFingerprint ns, std::vector<StoredKey> keys,
                     std::vector<std::span<const uint8_t>> payloads, Done done,
                     std::vector<Form> forms, std::vector<PutOutcome>* outcomes) {
  KVTIER_CHECK(forms.empty() || forms.size() == payloads.size());
  KVTIER_CHECK(outcomes == nullptr || outcomes->size() == keys.size());
  Submit(Batch{.kind = Kind::kPut,
               .ns = ns,
               .keys = std::move(keys),
               .payloads = std::move(payloads),
               .done = std::move(done),
               .checksums = nullptr,
               .forms = std::move(forms),
               .outcomes = outcomes});
}

RemoteCounters RemoteTier::counters() const {
  std::lock_guard lock(mu_);
  RemoteCounters c = counters_;
  const CircuitBreaker::Counters b = breaker_.counters();
  c.errors_unavailable = b.unavailable;
  c.refused_breaker = b.refused;
  c.breaker_opened = b.opened;
  c.breaker_open = b.open;
  return c;
}

void RemoteTier::Submit(Batch batch) {
  Status refused;
  {
    std::lock_guard lock(mu_);
    if (stopping_) {
      refused = Status(StatusCode::kCancelled, "the remote tier is stopping");
    } else if (breaker_.RefuseNow()) {
      refused = Unavailable("the remote tier's circuit breaker is open");
    } else if (inflight_ >= options_.max_inflight_batches) {
      ++counters_.refused_busy;
      refused = Status(StatusCode::kResourceExhausted, "the remote tier has " +
                                                           std::to_string(inflight_) + " batches in flight");
    } else {
      ++inflight_;
      queue_.push_back(std::move(batch));
    }
  }
  if (!refused.ok()) {
    options_.post([done = std::move(batch.done), refused] { done(Err(refused)); });
    return;
  }
  cv_.notify_one();
}

void RemoteTier::Finish(Batch& batch, Result<uint32_t> result) {
  {
    std::lock_guard lock(mu_);
    --inflight_;
  }
  options_.post([done = std::move(batch.done), result = std::move(result)] { done(result); });
}

void RemoteTier::Loop(Worker& worker) {
  // hiredis writes with write(): a node that died must be an EPIPE on this
  // thread, not a SIGPIPE that ends the process (see RedisConnection).
  sigset_t pipe;
  sigemptyset(&pipe);
  sigaddset(&pipe, SIGPIPE);
  ::pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
  while (true) {
    Batch batch;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      batch = std::move(queue_.front());
      queue_.pop_front();
    }
    const auto start = std::chrono::steady_clock::now();
    Result<uint32_t> result = Execute(worker, batch);
    {
      std::lock_guard lock(mu_);
      counters_.batch_latency.RecordSince(start);
    }
    Finish(batch, std::move(result));
  }
}

Result<uint32_t> RemoteTier::Execute(Worker& worker, Batch& batch) {
  if (batch.kind == Kind::kGet && batch.codec.kind != CodecKind::kNone && worker.coder == nullptr) {
    Result<std::unique_ptr<BlockCodec>> coder = BlockCodec::Create();
    if (!coder) return Err(coder.error());
    worker.coder = std::move(*coder);
  }
  std::optional<CircuitBreaker::Ticket> ticket = breaker_.Admit();
  if (!ticket) return Err(Unavailable("the remote tier's circuit breaker is open"));
  if (worker.cluster == nullptr) {
    Result<std::unique_ptr<RedisCluster>> cluster = RedisCluster::Connect(options_.cluster);
    if (!cluster) {
      const bool refused = cluster.error().code() != StatusCode::kUnavailable;  // AUTH, ACL
      if (refused) {
        std::lock_guard lock(mu_);
        ++counters_.errors_rejected;
        if (!std::exchange(refusal_logged_, true)) {
          spdlog::error("tiers.remote: the cluster refused us: {} (every remote call is a miss until it does not)",
                        cluster.error().ToString());
        }
      }
      ticket->Record(refused);
      return Err(cluster.error());
    }
    worker.cluster = std::move(*cluster);
    worker.seen = {};
  }
  RedisCluster& cluster = *worker.cluster;
  Result<uint32_t> result = batch.kind == Kind::kExists ? DoExists(cluster, batch)
                            : batch.kind == Kind::kGet  ? DoGet(cluster, worker.coder.get(), batch)
                                                        : DoPut(cluster, batch);
  ticket->Record(result.has_value() || result.error().code() != StatusCode::kUnavailable);
  const RedisCluster::Counters& now = cluster.counters();
  std::lock_guard lock(mu_);
  counters_.topology_refreshes += now.refreshes - worker.seen.refreshes;
  counters_.redirects += (now.moved + now.ask) - (worker.seen.moved + worker.seen.ask);
  counters_.round_trips += now.round_trips - worker.seen.round_trips;
  worker.seen = now;
  return result;
}

namespace {

std::vector<std::string> RedisKeys(std::string_view prefix, std::span<const StoredKey> keys) {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const StoredKey& k : keys) out.push_back(RemoteKey(prefix, k));
  return out;
}

// The first reply's error when nothing could be asked at all.
Status FirstFailure(const Result<RedisReply>& reply) {
  if (!reply) return reply.error();
  return Unavailable("redis: " + std::string(RedisErrorText(**reply)));
}

}  // namespace

Result<uint32_t> RemoteTier::DoExists(RedisCluster& cluster, const Batch& batch) {
  const std::vector<std::string> keys = RedisKeys(options_.key_prefix, batch.keys);
  std::vector<RedisCommand> commands;
  commands.reserve(keys.size());
  for (const std::string& k : keys) commands.push_back({{"EXISTS", k}});
  std::vector<Result<RedisReply>> replies = cluster.Run(commands);
  uint32_t leading = 0;
  for (; leading < replies.size(); ++leading) {
    const Result<RedisReply>& r = replies[leading];
    if (r && (*r)->type == REDIS_REPLY_INTEGER) {
      if ((*r)->integer != 1) break;
      continue;
    }
    if (leading == 0 && (!r || ClusterCannotServe(RedisErrorText(**r)))) return Err(FirstFailure(r));
    break;
  }
  std::lock_guard lock(mu_);
  counters_.exists_keys += keys.size();
  return leading;
}

namespace {

// Where a GET's value goes: checked and copied into the block's slot
// straight from hiredis' read buffer (CopyRemoteValue: one pass over the
// bytes), or, stored by a codec, checked and decoded into it. A value that
// fails its check is kept for the delete.
class BlockSink final : public RedisValueSink {
 public:
  BlockSink(const LayoutFingerprint& ns, const StoredKey& key, std::span<uint8_t> out, const CodecParams& codec,
            BlockCodec* coder)
      : ns_(ns), key_(key), out_(out), codec_(codec), coder_(coder) {}
  void Take(std::span<const uint8_t> value) override {
    value_bytes_ = value.size();
    Check(value);
    // Kept only when it fails its check: the delete removes just these bytes.
    if (got_.has_value() && !got_->has_value()) failed_value_.assign(value.begin(), value.end());
  }
  // Unset until a value came.
  const std::optional<Result<RemoteValueHeader>>& got() const { return got_; }
  uint64_t value_bytes() const { return value_bytes_; }
  uint64_t checksum() const { return checksum_; }  // of the block as served
  std::string_view failed_value() const { return failed_value_; }
  // A value is its header and the block, or what the namespace's codec
  // made of it: anything longer is refused unread.
  uint64_t max_bytes() const override {
    const uint64_t payload =
        coder_ != nullptr
            ? std::max<uint64_t>(out_.size(), BlockCodec::MaxEncodedBytes(codec_, out_.size()))
            : out_.size();
    return RemoteValueHeader::kBytes + payload;
  }

 private:
  void Check(std::span<const uint8_t> value) {
    Result<RemoteValueHeader> header = DecodeRemoteValueHeader(value);
    if (header && header->codec != RemoteValueHeader::kCodecRaw && coder_ != nullptr) {
      Result<std::pair<RemoteValueHeader, uint64_t>> decoded =
          DecodeRemoteValue(value, ns_, key_, codec_, *coder_, out_);
      if (!decoded) {
        got_ = Err(decoded.error());
        return;
      }
      got_ = decoded->first;
      checksum_ = decoded->second;
      return;
    }
    got_ = CopyRemoteValue(value, ns_, key_, out_);  // a coded value without a codec fails its length check
    if (*got_) checksum_ = (*got_)->payload_checksum;
  }

  const LayoutFingerprint& ns_;
  const StoredKey& key_;
  std::span<uint8_t> out_;
  const CodecParams& codec_;
  BlockCodec* coder_;  // null: the namespace has no codec
  std::optional<Result<RemoteValueHeader>> got_;
  uint64_t value_bytes_ = 0;
  uint64_t checksum_ = 0;
  std::string failed_value_;
};

}  // namespace

RedisCommand DeleteIfUnchanged(std::string_view key, std::string_view value) {
  // Atomic on the node: a valid value another node SET since is kept.
  static constexpr std::string_view kScript =
      "if redis.call('GET', KEYS[1]) == ARGV[1] then "
      "return redis.call('DEL', KEYS[1]) end return 0";
  return RedisCommand{.argv = {"EVAL", kScript, "1", key}, .value_parts = {value}, .key_index = 3};
}

Result<uint32_t> RemoteTier::DoGet(RedisCluster& cluster, BlockCodec* coder, Batch& batch) {
  const std::vector<std::string> keys = RedisKeys(options_.key_prefix, batch.keys);
  std::vector<BlockSink> sinks;
  sinks.reserve(keys.size());
  std::vector<RedisCommand> commands;
  commands.reserve(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    sinks.emplace_back(batch.ns, batch.keys[i], batch.out[i], batch.codec,
                       batch.codec.kind == CodecKind::kNone ? nullptr : coder);
    commands.push_back({.argv = {"GET", keys[i]}, .sink = &sinks.back()});
  }
  std::vector<Result<RedisReply>> replies = cluster.Run(commands);
  uint32_t served = 0;
  uint64_t bytes = 0, corrupt = 0, rejected = 0;
  for (; served < replies.size(); ++served) {
    const Result<RedisReply>& r = replies[served];
    if (!r && r.error().code() == StatusCode::kResourceExhausted) {
      // Longer than its block can be (RedisValueSink::max_bytes): refused
      // before its bytes were read, never served; the cluster was reached.
      ++corrupt;
      spdlog::warn("tiers.remote: {}: {}; a miss", keys[served], r.error().message());
      break;
    }
    if (!r || (*r)->type == REDIS_REPLY_ERROR) {
      if (served == 0 && (!r || ClusterCannotServe(RedisErrorText(**r)))) return Err(FirstFailure(r));
      rejected += r ? 1 : 0;
      break;
    }
    if ((*r)->type != REDIS_REPLY_STRING) break;  // nil: not there (or evicted)
    // Checked as it was copied: what fails its check is never served.
    const std::optional<Result<RemoteValueHeader>>& got = sinks[served].got();
    KVTIER_CHECK(got.has_value());  // a string reply goes to its sink
    const Result<RemoteValueHeader>& header = *got;
    if (!header) {
      // Never served; deleted so that it is not fetched again, unless a
      // valid value replaced it since.
      ++corrupt;
      spdlog::warn("tiers.remote: {}: {}; deleted, a miss", keys[served], header.error().message());
      const RedisCommand del[] = {DeleteIfUnchanged(keys[served], sinks[served].failed_value())};
      (void)cluster.Run(del);
      break;
    }
    if (batch.checksums != nullptr) (*batch.checksums)[served] = sinks[served].checksum();
    bytes += sinks[served].value_bytes();
  }
  std::lock_guard lock(mu_);
  counters_.hits += served;
  counters_.misses += keys.size() - served;
  counters_.bytes_read += bytes;
  counters_.corrupt += corrupt;
  counters_.errors_rejected += rejected;
  return served;
}

Result<uint32_t> RemoteTier::DoPut(RedisCluster& cluster, const Batch& batch) {
  const std::vector<std::string> keys = RedisKeys(options_.key_prefix, batch.keys);
  // Each value is its header and the block's bytes, written as they lie.
  std::vector<std::array<uint8_t, RemoteValueHeader::kBytes>> headers;
  std::vector<RedisCommand> commands;
  std::vector<size_t> index;  // command -> block
  headers.reserve(keys.size());
  uint64_t rejected = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    const std::span<const uint8_t> payload = batch.payloads[i];
    if (payload.size() + RemoteValueHeader::kBytes > options_.max_value_bytes) {
      ++rejected;  // larger than the deployment allows in one value
      if (batch.outcomes != nullptr) (*batch.outcomes)[i] = PutOutcome::kRefused;
      continue;
    }
    const Form form = batch.forms.empty() ? Form{CodecKind::kNone, payload.size()} : batch.forms[i];
    const RemoteValueHeader h{.ns = batch.ns,
                              .key = batch.keys[i],
                              .codec = static_cast<uint16_t>(form.codec),
                              .payload_bytes = payload.size(),
                              .raw_bytes = form.codec == CodecKind::kNone ? payload.size() : form.raw_bytes,
                              .payload_checksum = RemotePayloadChecksum(payload)};
    EncodeRemoteValueHeader(h, headers.emplace_back());
    index.push_back(i);
  }
  for (size_t c = 0; c < index.size(); ++c) {
    const std::span<const uint8_t> payload = batch.payloads[index[c]];
    commands.push_back({.argv = {"SET", keys[index[c]]},
                        .value_parts = {{reinterpret_cast<const char*>(headers[c].data()), headers[c].size()},
                                        {reinterpret_cast<const char*>(payload.data()), payload.size()}}});
  }
  std::vector<Result<RedisReply>> replies = cluster.Run(commands);
  uint32_t stored = 0;
  uint64_t bytes = 0;
  bool reached = replies.empty();
  Status first;
  for (size_t c = 0; c < replies.size(); ++c) {
    const Result<RedisReply>& r = replies[c];
    PutOutcome outcome = PutOutcome::kNotReached;
    if (r && (*r)->type == REDIS_REPLY_STATUS) {
      ++stored;
      bytes += RemoteValueHeader::kBytes + batch.payloads[index[c]].size();
      reached = true;
      outcome = PutOutcome::kStored;
    } else if (r && !ClusterCannotServe(RedisErrorText(**r))) {
      ++rejected;  // OOM (maxmemory with noeviction), NOPERM, ...
      reached = true;
      outcome = PutOutcome::kRefused;
    } else if (first.ok()) {
      first = FirstFailure(r);
    }
    if (batch.outcomes != nullptr) (*batch.outcomes)[index[c]] = outcome;
  }
  std::lock_guard lock(mu_);
  counters_.stores += stored;
  counters_.bytes_written += bytes;
  counters_.errors_rejected += rejected;
  if (!reached) return Err(first);
  return stored;
}

}  // namespace kvtier
