// Client's implementation (its contract is in kvtier/client.h). Past 800 lines
// on purpose: the connection, reconnection with re-registration, fences and
// every call share one lock and one connection state, kept side by side.
#include "kvtier/client.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <map>
#include <variant>

#include "client/cuda_export.h"
#include "client/op_fences.h"
#include "common/mutex.h"
#include "common/version.h"
#include "ipc/seqpacket.h"
#include "ipc/wire.h"

namespace kvtier {

namespace w = wire;
using flatbuffers::FlatBufferBuilder;

namespace {

Status Unavailable(std::string message) { return Status(StatusCode::kUnavailable, std::move(message)); }

BlockTier TierFromWire(w::Tier t) {
  switch (t) {
    case w::Tier::Hbm: return BlockTier::kHbm;
    case w::Tier::Disk: return BlockTier::kDisk;
    case w::Tier::Remote: return BlockTier::kRemote;
    default: return BlockTier::kHost;
  }
}

std::vector<w::Key> KeysToWire(std::span<const BlockKey> keys) {
  std::vector<w::Key> out;
  out.reserve(keys.size());
  for (const BlockKey& k : keys) out.push_back(ipc::ToWire(k));
  return out;
}

// A verified reply; `msg` points into `bytes`.
struct Reply {
  std::vector<uint8_t> bytes;
  const w::Message* msg = nullptr;
};

}  // namespace

std::string_view BlockTierName(BlockTier tier) {
  switch (tier) {
    case BlockTier::kHbm: return "hbm";
    case BlockTier::kHost: return "host";
    case BlockTier::kDisk: return "disk";
    case BlockTier::kRemote: return "remote";
  }
  return "?";
}

Result<BlockTier> ParseBlockTier(std::string_view name) {
  for (BlockTier t : {BlockTier::kHbm, BlockTier::kHost, BlockTier::kDisk}) {
    if (name == BlockTierName(t)) return t;
  }
  return Err(InvalidArgument("tier must be hbm, host or disk, not '" + std::string(name) + "'"));
}

uint64_t DaemonStats::Counter(std::string_view name) const {
  for (const auto& [n, v] : counters) {
    if (n == name) return v;
  }
  return 0;
}

class Client::Impl {
 public:
  struct Cache {
    Layout layout;
    uint32_t num_blocks = 0;
    std::vector<Placement> placements;
    CodecChoice codec = {};
    std::vector<UniqueFd> fds = {};  // our own dups, for re-registration
    std::vector<uint64_t> sizes = {};
    uint32_t namespace_id = 0;  // on the current connection
    std::unique_ptr<ChainHasher> hasher = nullptr;
    std::unique_ptr<CudaExport> cuda = nullptr;  // a cache in GPU memory
  };

  // IPC events per GPU cache: one per op in flight that a stream waits on.
  static constexpr uint32_t kEventsPerCache = 16;

  explicit Impl(ClientOptions options) : options_(std::move(options)) {}

  Status Connect() {
    KVTIER_ASSIGN_OR_RETURN(fences_, OpFences::Create());
    MutexLock lock(&mu_);
    return Reconnect();
  }

  std::string tenant() const {
    MutexLock lock(&mu_);
    return tenant_;
  }
  std::string daemon_release() const {
    MutexLock lock(&mu_);
    return daemon_release_;
  }
  bool connected() const {
    MutexLock lock(&mu_);
    return fd_.valid();
  }

  Result<CacheId> Register(const Layout& layout, uint32_t num_blocks, std::vector<Placement> placements,
                           std::vector<KvRegion> regions, CodecChoice codec) {
    MutexLock lock(&mu_);
    KVTIER_RETURN_IF_ERROR(EnsureConnected());
    auto cache = std::make_unique<Cache>(Cache{.layout = layout, .num_blocks = num_blocks,
                                               .placements = std::move(placements), .codec = codec});
    for (const KvRegion& r : regions) {
      UniqueFd dup(::fcntl(r.memfd, F_DUPFD_CLOEXEC, 0));
      if (!dup) return Err(Status::FromErrno(errno, "dup of a KV cache memfd"));
      cache->fds.push_back(std::move(dup));
      cache->sizes.push_back(r.size_bytes);
    }
    return Add(std::move(cache));
  }

  Result<CacheId> RegisterCuda(const Layout& layout, uint32_t num_blocks, std::vector<Placement> placements,
                               std::vector<CudaKvRegion> regions, CodecChoice codec) {
    MutexLock lock(&mu_);
    KVTIER_RETURN_IF_ERROR(EnsureConnected());
    auto cache = std::make_unique<Cache>(Cache{.layout = layout, .num_blocks = num_blocks,
                                               .placements = std::move(placements), .codec = codec});
    KVTIER_ASSIGN_OR_RETURN(cache->cuda, CudaExport::Create(regions, kEventsPerCache));
    for (const CudaKvRegion& r : regions) cache->sizes.push_back(r.size_bytes);
    return Add(std::move(cache));
  }

  // Registers a new cache on this connection and keeps it for reconnects.
  Result<CacheId> Add(std::unique_ptr<Cache> cache) KVTIER_REQUIRES(mu_) {
    KVTIER_RETURN_IF_ERROR(RegisterOne(*cache));
    caches_.push_back(std::move(cache));
    return static_cast<CacheId>(caches_.size());
  }

  Result<std::vector<BlockKey>> ComputeKeys(CacheId id, std::span<const uint32_t> tokens,
                                            std::span<const ExtraKeys> extra, const std::optional<BlockKey>& parent) {
    MutexLock lock(&mu_);
    KVTIER_ASSIGN_OR_RETURN(Cache * c, Find(id));
    return c->hasher->ComputeKeys(tokens, extra, parent);
  }

  Result<BlockKey> KeyFromEngineHash(CacheId id, std::span<const uint8_t> hash) {
    MutexLock lock(&mu_);
    KVTIER_ASSIGN_OR_RETURN(Cache * c, Find(id));
    return c->hasher->KeyFromEngineHash(hash);
  }

  Result<LookupResult> Lookup(CacheId id, std::span<const BlockKey> keys) {
    MutexLock lock(&mu_);
    KVTIER_ASSIGN_OR_RETURN(Cache * c, ConnectedCache(id));
    FlatBufferBuilder b(64 + keys.size() * 16);
    const std::vector<w::Key> wk = KeysToWire(keys);
    const uint64_t rid = next_id_++;
    KVTIER_ASSIGN_OR_RETURN(Reply r, Call(ipc::FinishMessage(b, rid, w::CreateLookupDirect(b, c->namespace_id, &wk)),
                                          {}, rid, w::Body::LookupReply));
    const w::LookupReply* lr = r.msg->body_as_LookupReply();
    LookupResult out;
    out.hits = lr->hits();
    if (lr->tiers() != nullptr) {
      for (w::Tier t : *lr->tiers()) out.tiers.push_back(TierFromWire(t));
    }
    return out;
  }

  Result<HintResult> Hint(CacheId id, std::span<const BlockKey> keys, const BlockHint& hint) {
    if (hint.last_partial) return Err(InvalidArgument("last_partial is a store's hint, not one for cached blocks"));
    KVTIER_RETURN_IF_ERROR(ipc::CheckRetentionHint(hint.priority, hint.next_use_ms));
    MutexLock lock(&mu_);
    KVTIER_ASSIGN_OR_RETURN(Cache * c, ConnectedCache(id));
    FlatBufferBuilder b(64 + keys.size() * 16);
    const std::vector<w::Key> wk = KeysToWire(keys);
    const uint64_t rid = next_id_++;
    KVTIER_ASSIGN_OR_RETURN(
        Reply r, Call(ipc::FinishMessage(b, rid,
                                         w::CreateHintDirect(b, c->namespace_id, &wk, static_cast<int8_t>(hint.priority),
                                                             hint.next_use_ms, hint.session_over)),
                      {}, rid, w::Body::HintReply));
    const w::HintReply* hr = r.msg->body_as_HintReply();
    return HintResult{.hinted = hr->hinted(), .refused = hr->refused()};
  }

  Result<uint32_t> Prefetch(CacheId id, std::span<const BlockKey> keys) {
    MutexLock lock(&mu_);
    KVTIER_ASSIGN_OR_RETURN(Cache * c, ConnectedCache(id));
    FlatBufferBuilder b(64 + keys.size() * 16);
    const std::vector<w::Key> wk = KeysToWire(keys);
    const uint64_t rid = next_id_++;
    KVTIER_ASSIGN_OR_RETURN(Reply r, Call(ipc::FinishMessage(b, rid, w::CreatePrefetchDirect(b, c->namespace_id, &wk)),
                                          {}, rid, w::Body::PrefetchReply));
    return r.msg->body_as_PrefetchReply()->resident();
  }

  // Starts a Load or Store; with `wait`, returns its OpResult instead.
  // `ordered` (GPU caches): the op is ordered against the engine's `stream`
  // (which may be 0, the legacy default stream) through one of the cache's
  // events (CudaExport).
  Result<std::variant<OpHandle, OpResult>> StartOp(bool load, bool wait, CacheId id, std::span<const BlockKey> keys,
                                                   std::span<const uint32_t> block_ids,
                                                   const std::optional<BlockKey>& parent, bool ordered = false,
                                                   CudaStream stream = nullptr,
                                                   const BlockEventInfo* events = nullptr,
                                                   const BlockHint* hint = nullptr) {
    MutexLock lock(&mu_);
    const BlockHint h = hint != nullptr ? *hint : BlockHint{};
    if (h.session_over) return Err(InvalidArgument("session_over is a hint for cached blocks (Hint), not a store's"));
    KVTIER_RETURN_IF_ERROR(ipc::CheckRetentionHint(h.priority, h.next_use_ms));
    if (keys.size() != block_ids.size()) {
      return Err(InvalidArgument(std::to_string(keys.size()) + " keys but " + std::to_string(block_ids.size()) +
                                 " block ids"));
    }
    if (events != nullptr) {
      KVTIER_RETURN_IF_ERROR(ipc::CheckBlockEventSizes({.keys = keys.size(),
                                                        .hash_bytes = events->hash_bytes,
                                                        .hashes = events->engine_hashes.size(),
                                                        .parent = events->parent_hash.size(),
                                                        .tokens = events->token_ids.size(),
                                                        .block_size = events->block_size,
                                                        .lora_name = events->lora_name.size()}));
    }
    KVTIER_ASSIGN_OR_RETURN(Cache * c, ConnectedCache(id));
    if (ordered && c->cuda == nullptr) {
      return Err(InvalidArgument("a CUDA stream was given for a cache that is not in GPU memory"));
    }
    // An event slot stays ours until Wait returns the op's result: the
    // engine may wait on a load's OpHandle::event until then, and the daemon
    // watches a store's record until its copies start.
    int32_t event = -1;
    if (ordered) {
      if (std::optional<int32_t> slot = c->cuda->AcquireEvent()) event = *slot;
    }
    auto release = [&] {
      if (event >= 0) c->cuda->ReleaseEvent(event);
      event = -1;
    };
    uint32_t completion = 0;  // the value the store's completion slot gets (the event's slot)
    if (ordered && !load) {
      // The store's copies must read what the engine's stream wrote: they
      // wait for this record, or, with every event busy, for the stream here.
      const Status st = event >= 0 ? c->cuda->Record(event, stream) : c->cuda->Synchronize(stream);
      if (!st.ok()) {
        release();
        return Err(st);
      }
      if (event >= 0) completion = c->cuda->NextCompletionValue(event);
    }
    // From here on, a failure cancels the op's copies (which the daemon
    // may have started) before returning: the caller may reuse the blocks.
    const OpFences::Fence fence = fences_->Open(daemon_);
    FlatBufferBuilder b(128 + keys.size() * 20);
    const std::vector<w::Key> wk = KeysToWire(keys);
    const std::vector<uint32_t> ids(block_ids.begin(), block_ids.end());
    const uint64_t rid = next_id_++;
    std::vector<uint8_t> bytes;
    if (load) {
      bytes = ipc::FinishMessage(b, rid,
                                 w::CreateLoadDirect(b, c->namespace_id, &wk, &ids, wait, event,
                                                     static_cast<int32_t>(fence.slot), fence.generation));
    } else {
      const w::Key p = parent ? ipc::ToWire(*parent) : w::Key();
      std::vector<uint8_t> hashes, parent_hash;
      std::vector<uint32_t> tokens;
      std::string lora;
      if (events != nullptr) {
        hashes.assign(events->engine_hashes.begin(), events->engine_hashes.end());
        parent_hash.assign(events->parent_hash.begin(), events->parent_hash.end());
        tokens.assign(events->token_ids.begin(), events->token_ids.end());
        lora = events->lora_name;
      }
      bytes = ipc::FinishMessage(
          b, rid,
          w::CreateStoreDirect(b, c->namespace_id, &wk, &ids, parent ? &p : nullptr, wait, event, event, completion,
                               events != nullptr ? &hashes : nullptr, events != nullptr ? events->hash_bytes : 0,
                               parent_hash.empty() ? nullptr : &parent_hash, tokens.empty() ? nullptr : &tokens,
                               events != nullptr ? events->block_size : 0, lora.empty() ? nullptr : lora.c_str(),
                               static_cast<int8_t>(h.priority), h.next_use_ms, h.last_partial,
                               static_cast<int32_t>(fence.slot), fence.generation));
    }
    if (wait) {
      Result<Reply> r = Call(std::move(bytes), {}, rid, w::Body::OpResult);
      release();  // the op is over (or, on error, never started)
      if (!r) return Err(Abandon(fence, r.error()));
      fences_->Close(fence);
      return FinishOpResult(*r->msg->body_as_OpResult());
    }
    Result<Reply> r = Call(std::move(bytes), {}, rid, w::Body::OpStarted);
    if (!r) {
      release();
      return Err(Abandon(fence, r.error()));
    }
    const w::OpStarted* started = r->msg->body_as_OpStarted();
    OpHandle handle{started->op(), connection_};
    fences_->Track({connection_, handle.op}, fence);
    if (load && event >= 0 && started->event_recorded()) {
      if (Status st = c->cuda->StreamWait(stream, event); !st.ok()) {
        release();
        return Err(st);
      }
      handle.event = c->cuda->event(event);
      handle.event_blocks = started->event_blocks();
    }
    if (!load && event >= 0) {
      // Completes when the daemon writes the value: the store is over.
      Result<CudaEvent> done = c->cuda->CompletionEvent(event, completion);
      if (done) handle.event = *done;  // else no GPU-side completion: Wait
    }
    if (load && handle.event == nullptr) {
      release();  // the daemon never records it for this op
    } else if (event >= 0) {
      op_events_[handle.op] = HeldEvent{c, event, completion};
    }
    return std::variant<OpHandle, OpResult>(handle);
  }

  // Ops holding a GPU cache's event may still have the daemon record or
  // watch it: collect them (for a bounded time) before the events go.
  ~Impl() {
    MutexLock lock(&mu_);
    std::vector<uint64_t> ops;
    for (const auto& [op, held] : op_events_) ops.push_back(op);
    for (uint64_t op : ops) {
      if (!fd_.valid()) break;
      (void)WaitLocked(OpHandle{op, connection_}, std::chrono::seconds(5));
    }
  }

  Result<OpResult> Wait(const OpHandle& op, std::chrono::milliseconds timeout) {
    if (timeout.count() < 0) return Err(InvalidArgument("a Wait's timeout must be >= 0 ms (0: no limit)"));
    MutexLock lock(&mu_);
    return WaitLocked(op, timeout);
  }

  Result<OpResult> WaitLocked(const OpHandle& op, std::chrono::milliseconds timeout) KVTIER_REQUIRES(mu_) {
    if (!fd_.valid() || op.connection != connection_) {
      // Its connection is gone (kvtierd restarted, or a call timed out), and
      // with it the op's result: its copies were cancelled then.
      const OpFences::OpKey key{op.connection, op.op};
      Status lost = Abandon(fences_->Find(key),
                            Unavailable("the connection to kvtierd was lost (it restarted, or a call timed out); "
                                        "the op was lost"));
      if (lost.code() != StatusCode::kAborted) fences_->Untrack(key);
      return Err(std::move(lost));
    }
    FlatBufferBuilder b(64);
    const uint64_t rid = next_id_++;
    const auto ms = static_cast<uint32_t>(std::min<int64_t>(timeout.count(), UINT32_MAX));
    Result<Reply> r = Call(ipc::FinishMessage(b, rid, w::CreateWait(b, op.op, ms)), {}, rid,
                           w::Body::OpResult, std::chrono::milliseconds(ms));
    if (!r) {
      // NotFound: the daemon no longer holds the op, so it is over (its result
      // was taken, or dropped unread after it finished): its event is free.
      if (r.error().code() == StatusCode::kNotFound) {
        ReleaseOpEvent(op.op);
        fences_->Untrack({op.connection, op.op});
      }
      return Err(r.error());
    }
    if (r->msg->body_as_OpResult()->done()) {
      ReleaseOpEvent(op.op);
      fences_->Untrack({op.connection, op.op});
    }
    return ToOpResult(*r->msg->body_as_OpResult());
  }

  Status Cancel(const OpHandle& op, std::chrono::milliseconds timeout) {
    if (timeout.count() < 0) return InvalidArgument("a Cancel's timeout must be >= 0 ms (0: no limit)");
    // No lock of the client's calls: this works while one waits on kvtierd.
    const std::optional<OpFences::Fence> fence = fences_->Find({op.connection, op.op});
    if (!fence) return Status::Ok();  // over (its result collected) or cancelled already
    const auto deadline = timeout.count() > 0 ? std::chrono::steady_clock::now() + timeout
                                              : std::chrono::steady_clock::time_point::max();
    if (!fences_->Cancel(*fence, deadline)) {
      return Status(StatusCode::kDeadlineExceeded,
                    "a copy of op " + std::to_string(op.op) + " is still in progress after " +
                        std::to_string(timeout.count()) +
                        " ms (kvtierd stopped or died in the middle of it): its blocks are not safe to reuse yet");
    }
    fences_->Untrack({op.connection, op.op});
    return Status::Ok();
  }

  Result<DaemonStats> Stats() {
    MutexLock lock(&mu_);
    KVTIER_RETURN_IF_ERROR(EnsureConnected());
    FlatBufferBuilder b(64);
    const uint64_t rid = next_id_++;
    KVTIER_ASSIGN_OR_RETURN(Reply r, Call(ipc::FinishMessage(b, rid, w::CreateStats(b)), {}, rid, w::Body::StatsReply));
    const w::StatsReply* s = r.msg->body_as_StatsReply();
    DaemonStats out;
    if (s->backend() != nullptr) out.backend = s->backend()->str();
    if (s->metrics() != nullptr) out.metrics = s->metrics()->str();
    if (s->scope() != nullptr) out.scope = s->scope()->str();
    if (s->release() != nullptr) out.release = s->release()->str();
    if (s->tiers() != nullptr) {
      for (const w::TierStats* t : *s->tiers()) {
        out.tiers.push_back(TierStats{TierFromWire(t->tier()), t->capacity_bytes(), t->used_bytes(), t->blocks()});
      }
    }
    out.sessions = s->sessions();
    out.leases = s->leases();
    out.mappings = s->mappings();
    out.inflight_ops = s->inflight_ops();
    if (s->counters() != nullptr) {
      for (const w::Counter* c : *s->counters()) {
        out.counters.emplace_back(c->name() != nullptr ? c->name()->str() : "", c->value());
      }
    }
    return out;
  }

  Result<uint64_t> Evict(const std::string& tenant, std::optional<BlockTier> tier,
                         std::optional<LayoutFingerprint> ns) {
    MutexLock lock(&mu_);
    KVTIER_RETURN_IF_ERROR(EnsureConnected());
    FlatBufferBuilder b(128);
    const uint64_t rid = next_id_++;
    const w::Tier wt = tier ? static_cast<w::Tier>(*tier) : w::Tier::None;
    const w::Key fp = ns ? ipc::ToWire(*ns) : w::Key();
    KVTIER_ASSIGN_OR_RETURN(
        Reply r, Call(ipc::FinishMessage(b, rid, w::CreateEvictDirect(b, tenant.c_str(), ns ? &fp : nullptr, wt)),
                      {}, rid, w::Body::EvictReply));
    return r.msg->body_as_EvictReply()->evicted();
  }

  Result<std::vector<NamespaceStats>> ListNamespaces(const std::string& tenant) {
    MutexLock lock(&mu_);
    KVTIER_RETURN_IF_ERROR(EnsureConnected());
    FlatBufferBuilder b(128);
    const uint64_t rid = next_id_++;
    KVTIER_ASSIGN_OR_RETURN(Reply r, Call(ipc::FinishMessage(b, rid, w::CreateListNamespacesDirect(b, tenant.c_str())),
                                          {}, rid, w::Body::NamespaceList));
    std::vector<NamespaceStats> out;
    const w::NamespaceList* list = r.msg->body_as_NamespaceList();
    if (list->namespaces() == nullptr) return out;
    for (const w::NamespaceInfo* n : *list->namespaces()) {
      NamespaceStats ns;
      if (n->fingerprint() != nullptr) ns.fingerprint = ipc::FromWire<LayoutFingerprint>(*n->fingerprint());
      if (n->description() != nullptr) ns.description = n->description()->str();
      ns.blocks = n->blocks();
      if (n->used_bytes() != nullptr) {
        for (flatbuffers::uoffset_t i = 0; i < n->used_bytes()->size() && i < 3; ++i) {
          ns.used_bytes[i] = n->used_bytes()->Get(i);
        }
      }
      out.push_back(std::move(ns));
    }
    return out;
  }

  Result<VerifyStatus> VerifyDisk(bool start) {
    MutexLock lock(&mu_);
    KVTIER_RETURN_IF_ERROR(EnsureConnected());
    FlatBufferBuilder b(64);
    const uint64_t rid = next_id_++;
    KVTIER_ASSIGN_OR_RETURN(Reply r, Call(ipc::FinishMessage(b, rid, w::CreateVerifyDisk(b, start)), {}, rid,
                                          w::Body::VerifyDiskProgress));
    const w::VerifyDiskProgress* p = r.msg->body_as_VerifyDiskProgress();
    return VerifyStatus{p->total(), p->checked(), p->bad(), p->skipped(), p->done()};
  }

  Result<uint64_t> Flush() {
    MutexLock lock(&mu_);
    KVTIER_RETURN_IF_ERROR(EnsureConnected());
    FlatBufferBuilder b(64);
    const uint64_t rid = next_id_++;
    KVTIER_ASSIGN_OR_RETURN(Reply r, Call(ipc::FinishMessage(b, rid, w::CreateFlush(b)), {}, rid, w::Body::FlushReply));
    return r.msg->body_as_FlushReply()->flushed();
  }

  Result<std::vector<TenantStats>> ListTenants() {
    MutexLock lock(&mu_);
    KVTIER_RETURN_IF_ERROR(EnsureConnected());
    FlatBufferBuilder b(64);
    const uint64_t rid = next_id_++;
    KVTIER_ASSIGN_OR_RETURN(Reply r, Call(ipc::FinishMessage(b, rid, w::CreateListTenants(b)), {}, rid,
                                          w::Body::TenantList));
    std::vector<TenantStats> out;
    const w::TenantList* tl = r.msg->body_as_TenantList();
    if (tl->tenants() == nullptr) return out;
    for (const w::TenantInfo* t : *tl->tenants()) {
      TenantStats ts;
      ts.name = t->name() != nullptr ? t->name()->str() : "";
      ts.sessions = t->sessions();
      ts.blocks = t->blocks();
      if (t->used_bytes() != nullptr) {
        for (flatbuffers::uoffset_t i = 0; i < t->used_bytes()->size() && i < 3; ++i) ts.used_bytes[i] = t->used_bytes()->Get(i);
      }
      out.push_back(std::move(ts));
    }
    return out;
  }

 private:
  static Result<OpResult> ToOpResult(const w::OpResult& r) {
    if (!r.done()) return Err(Status(StatusCode::kDeadlineExceeded, "the op is still running"));
    const Status st = ipc::StatusFromWire(r.code(), r.message());
    if (!st.ok()) return Err(st);
    return OpResult{r.blocks(), r.already()};
  }
  static Result<std::variant<OpHandle, OpResult>> FinishOpResult(const w::OpResult& r) {
    KVTIER_ASSIGN_OR_RETURN(OpResult o, ToOpResult(r));
    return std::variant<OpHandle, OpResult>(o);
  }

  Result<Cache*> Find(CacheId id) KVTIER_REQUIRES(mu_) {
    if (id == 0 || id > caches_.size()) return Err(InvalidArgument("unknown cache id " + std::to_string(id)));
    return caches_[id - 1].get();
  }
  Result<Cache*> ConnectedCache(CacheId id) KVTIER_REQUIRES(mu_) {
    KVTIER_RETURN_IF_ERROR(EnsureConnected());
    return Find(id);
  }

  Status EnsureConnected() KVTIER_REQUIRES(mu_) {
    if (fd_.valid()) return Status::Ok();
    if (std::chrono::steady_clock::now() < next_attempt_) {
      return Unavailable("kvtierd is unavailable; reconnecting");
    }
    return Reconnect();
  }

  // Cancels the copies of an op that failed or was lost with `error`, and
  // returns `error` once none runs (or the daemon process that ran them has
  // exited); kAborted when one is still in progress after call_timeout (10 s
  // without one): kvtierd hung in the middle of a copy, and the op's blocks
  // are not safe to reuse.
  Status Abandon(std::optional<OpFences::Fence> fence, Status error) {
    if (!fence) return error;
    const auto wait = options_.call_timeout.count() > 0 ? options_.call_timeout
                                                        : std::chrono::milliseconds(std::chrono::seconds(10));
    if (!fences_->Cancel(*fence, std::chrono::steady_clock::now() + wait)) {
      return Status(StatusCode::kAborted,
                    error.message() + "; and a copy of the op is still in progress after " +
                        std::to_string(wait.count()) +
                        " ms (kvtierd stopped or died in the middle of it): its blocks are not safe to reuse");
    }
    fences_->Close(*fence);
    return error;
  }

  void ReleaseOpEvent(uint64_t op) KVTIER_REQUIRES(mu_) {
    auto it = op_events_.find(op);
    if (it == op_events_.end()) return;
    it->second.cache->cuda->ReleaseEvent(it->second.slot);
    op_events_.erase(it);
  }

  void Disconnect() KVTIER_REQUIRES(mu_) {
    // Ops of this connection are lost, and so are their events' uses. No
    // daemon will write their stores' completions now: write them here, so
    // that no engine stream waits forever.
    for (auto& [op, held] : op_events_) {
      if (held.completion != 0) held.cache->cuda->Complete(held.slot, held.completion);
      held.cache->cuda->ReleaseEvent(held.slot);
    }
    op_events_.clear();
    // Nor will it answer for their copies: none may start now.
    fences_->CancelAll(connection_);
    fd_.Reset();
    next_attempt_ = std::chrono::steady_clock::now() + options_.reconnect_interval;
  }

  // Connects, says Hello and re-registers every cache.
  Status Reconnect() KVTIER_REQUIRES(mu_) {
    Result<UniqueFd> fd = ipc::Connect(options_.socket_path);
    if (!fd) {
      Disconnect();
      return fd.error();
    }
    fd_ = std::move(*fd);
    ++connection_;
    daemon_ = OpFences::PeerProcess(fd_.get());
    // Large batches (thousands of keys) exceed the default socket buffer;
    // the kernel caps this at net.core.wmem_max, which is fine.
    const int sndbuf = 1 << 20;
    ::setsockopt(fd_.get(), SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf));
    FlatBufferBuilder b(256);
    const uint64_t rid = next_id_++;
    const auto hello = w::CreateHelloDirect(b, ipc::kProtocolVersion,
                                            options_.token.empty() ? nullptr : options_.token.c_str(),
                                            options_.client_name.c_str());
    Result<Reply> r = Call(ipc::FinishMessage(b, rid, hello), {}, rid, w::Body::Welcome);
    if (!r) {
      Disconnect();
      return r.error();
    }
    const w::Welcome* welcome = r->msg->body_as_Welcome();
    std::vector<uint8_t> secret;
    if (welcome->hash_secret() != nullptr) secret.assign(welcome->hash_secret()->begin(), welcome->hash_secret()->end());
    Result<Secret> s = Secret::FromBytes(std::move(secret));
    if (!s) {
      Disconnect();
      return s.error().WithContext("the daemon's hash secret");
    }
    hash_secret_ = std::move(*s);
    tenant_ = welcome->tenant() != nullptr ? welcome->tenant()->str() : "";
    daemon_release_ = welcome->release() != nullptr ? welcome->release()->str() : "";
    for (auto& cache : caches_) {
      if (Status st = RegisterOne(*cache); !st.ok()) {
        Disconnect();
        return st.WithContext("re-registering a KV cache after reconnecting");
      }
    }
    return Status::Ok();
  }

  Status RegisterOne(Cache& c) KVTIER_REQUIRES(mu_) {
    FlatBufferBuilder b(1024);
    std::vector<flatbuffers::Offset<w::MemoryRegion>> regions;
    std::vector<int> fds;
    for (size_t i = 0; i < c.fds.size(); ++i) {
      regions.push_back(w::CreateMemoryRegion(b, w::MemoryKind::HostMemfd, c.sizes[i], static_cast<int>(i)));
      fds.push_back(c.fds[i].get());
    }
    std::vector<w::CudaEventHandle> events;
    if (c.cuda != nullptr) {
      for (const CudaExport::Region& r : c.cuda->regions()) {
        const std::vector<uint8_t> handle(r.handle.begin(), r.handle.end());
        const std::vector<uint8_t> uuid(r.device_uuid.begin(), r.device_uuid.end());
        regions.push_back(w::CreateMemoryRegionDirect(b, w::MemoryKind::CudaIpc, r.size_bytes, -1, &handle, r.offset,
                                                      r.device, &uuid));
      }
      for (const IpcEventHandle& h : c.cuda->event_handles()) {
        events.emplace_back(flatbuffers::span<const uint8_t, 64>(h.data(), h.size()));
      }
    }
    const int completion_index = c.cuda != nullptr ? static_cast<int>(fds.size()) : -1;
    if (c.cuda != nullptr) fds.push_back(c.cuda->completion_fd());
    const auto fence_index = static_cast<int>(fds.size());
    fds.push_back(fences_->fd());
    std::vector<w::Placement> placements;
    for (const Placement& p : c.placements) placements.push_back(ipc::PlacementToWire(p));
    const uint64_t rid = next_id_++;
    const auto body = w::CreateRegisterKvCacheDirect(b, ipc::LayoutToWire(b, c.layout), c.num_blocks, &regions,
                                                     &placements, c.cuda != nullptr ? &events : nullptr,
                                                     completion_index, static_cast<w::Codec>(c.codec.kind),
                                                     c.codec.fp8_group, fence_index);
    KVTIER_ASSIGN_OR_RETURN(Reply r, Call(ipc::FinishMessage(b, rid, body), fds, rid, w::Body::Registered));
    c.namespace_id = r.msg->body_as_Registered()->namespace_id();
    c.hasher = std::make_unique<ChainHasher>(*hash_secret_, c.layout);
    return Status::Ok();
  }

  // Sends a request and reads until its reply. A transport failure drops the
  // connection and returns kUnavailable; no reply within call_timeout (plus
  // `also`: a Wait's own time) drops it and returns kDeadlineExceeded; an
  // Error reply is returned as its status; a reply of another type than
  // `expect` is kInternal.
  Result<Reply> Call(std::vector<uint8_t> bytes, std::span<const int> fds, uint64_t id,
                     w::Body expect, std::chrono::milliseconds also = {}) KVTIER_REQUIRES(mu_) {
    if (Status st = ipc::SendMessage(fd_.get(), bytes, fds); !st.ok()) {
      Disconnect();
      return Err(Unavailable("lost kvtierd: " + st.message()));
    }
    const bool bounded = options_.call_timeout.count() > 0;
    const auto deadline = std::chrono::steady_clock::now() + options_.call_timeout + also;
    while (true) {
      if (bounded) {
        const auto left = std::chrono::ceil<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        pollfd pfd{.fd = fd_.get(), .events = POLLIN, .revents = 0};
        const int ready =
            left.count() > 0
                ? ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left.count(), INT_MAX)))
                : 0;
        if (ready < 0 && errno == EINTR) continue;
        if (ready == 0) {
          Disconnect();  // a late reply must not be read as the next call's
          return Err(Status(StatusCode::kDeadlineExceeded,
                            "kvtierd did not answer within " +
                                std::to_string((options_.call_timeout + also).count()) +
                                " ms (call_timeout); the connection is dropped"));
        }
      }
      Result<ipc::ReceivedMessage> m = ipc::ReceiveMessage(fd_.get(), ipc::kMaxReplyBytes);
      if (!m || m->eof || m->truncated) {
        Disconnect();
        return Err(Unavailable(!m ? "lost kvtierd: " + m.error().message()
                                  : m->eof ? "kvtierd closed the connection" : "oversized reply from kvtierd"));
      }
      Result<const w::Message*> msg = ipc::VerifyMessage(m->bytes);
      if (!msg) {
        Disconnect();
        return Err(msg.error().WithContext("reply from kvtierd"));
      }
      // id 0: the daemon could not read our request (it then closes).
      if ((*msg)->id() != id && (*msg)->id() != 0) continue;  // a late reply to an abandoned call
      if ((*msg)->body_type() == w::Body::Error) {
        const w::Error* e = (*msg)->body_as_Error();
        return Err(ipc::StatusFromWire(e->code(), e->message()));
      }
      if ((*msg)->body_type() != expect) {
        return Err(Internal(std::string("unexpected reply ") + w::EnumNameBody((*msg)->body_type())));
      }
      Reply reply;
      reply.msg = *msg;
      reply.bytes = std::move(m->bytes);  // the heap buffer, and so msg, stay put
      return reply;
    }
  }

  const ClientOptions options_;
  mutable Mutex mu_;
  UniqueFd fd_ KVTIER_GUARDED_BY(mu_);
  uint64_t connection_ KVTIER_GUARDED_BY(mu_) = 0;
  // The daemon process at the other end of fd_ (OpFences::PeerProcess).
  std::shared_ptr<const UniqueFd> daemon_ KVTIER_GUARDED_BY(mu_);
  uint64_t next_id_ KVTIER_GUARDED_BY(mu_) = 1;
  std::chrono::steady_clock::time_point next_attempt_ KVTIER_GUARDED_BY(mu_);
  std::string tenant_ KVTIER_GUARDED_BY(mu_);
  std::string daemon_release_ KVTIER_GUARDED_BY(mu_);
  std::optional<Secret> hash_secret_ KVTIER_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Cache>> caches_ KVTIER_GUARDED_BY(mu_);
  // Ops holding an event slot of a GPU cache, until Wait returns their result.
  struct HeldEvent {
    Cache* cache = nullptr;
    int32_t slot = -1;
    uint32_t completion = 0;  // a store's completion value, or 0
  };
  std::map<uint64_t, HeldEvent> op_events_ KVTIER_GUARDED_BY(mu_);
  // Set by Connect, before any other call.
  std::unique_ptr<OpFences> fences_;
};

Result<std::unique_ptr<Client>> Client::Connect(ClientOptions options) {
  if (options.socket_path.empty()) return Err(InvalidArgument("ClientOptions.socket_path is required"));
  auto impl = std::make_unique<Impl>(std::move(options));
  KVTIER_RETURN_IF_ERROR(impl->Connect());
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

std::string Client::tenant() const { return impl_->tenant(); }
std::string Client::daemon_release() const { return impl_->daemon_release(); }
const char* Client::release() { return kVersion; }
bool Client::connected() const { return impl_->connected(); }

Result<CacheId> Client::RegisterKvCache(const Layout& layout, uint32_t num_blocks, std::vector<Placement> placements,
                                        std::vector<KvRegion> regions, CodecChoice codec) {
  return impl_->Register(layout, num_blocks, std::move(placements), std::move(regions), codec);
}

Result<CacheId> Client::RegisterKvCache(const ShmKvCache& cache, CodecChoice codec) {
  return impl_->Register(cache.layout(), cache.num_blocks(), cache.placements(),
                         {KvRegion{cache.fd(), cache.size_bytes()}}, codec);
}

Result<CacheId> Client::RegisterCudaKvCache(const Layout& layout, uint32_t num_blocks,
                                            std::vector<Placement> placements, std::vector<CudaKvRegion> regions,
                                            CodecChoice codec) {
  return impl_->RegisterCuda(layout, num_blocks, std::move(placements), std::move(regions), codec);
}

Result<std::vector<BlockKey>> Client::ComputeKeys(CacheId cache, std::span<const uint32_t> tokens,
                                                  std::span<const ExtraKeys> extra,
                                                  const std::optional<BlockKey>& parent) {
  return impl_->ComputeKeys(cache, tokens, extra, parent);
}

Result<BlockKey> Client::KeyFromEngineHash(CacheId cache, std::span<const uint8_t> hash) {
  return impl_->KeyFromEngineHash(cache, hash);
}

Result<LookupResult> Client::Lookup(CacheId cache, std::span<const BlockKey> keys) { return impl_->Lookup(cache, keys); }
Result<uint32_t> Client::Prefetch(CacheId cache, std::span<const BlockKey> keys) { return impl_->Prefetch(cache, keys); }

Result<OpHandle> Client::LoadAsync(CacheId cache, std::span<const BlockKey> keys, std::span<const uint32_t> block_ids) {
  KVTIER_ASSIGN_OR_RETURN(auto v, impl_->StartOp(true, false, cache, keys, block_ids, std::nullopt));
  return std::get<OpHandle>(v);
}

Result<OpHandle> Client::StoreAsync(CacheId cache, std::span<const BlockKey> keys, std::span<const uint32_t> block_ids,
                                    const std::optional<BlockKey>& parent, const BlockEventInfo* events,
                                    const BlockHint* hint) {
  KVTIER_ASSIGN_OR_RETURN(auto v,
                          impl_->StartOp(false, false, cache, keys, block_ids, parent, false, nullptr, events, hint));
  return std::get<OpHandle>(v);
}

Result<OpHandle> Client::LoadAsync(CacheId cache, std::span<const BlockKey> keys, std::span<const uint32_t> block_ids,
                                   CudaStream stream) {
  KVTIER_ASSIGN_OR_RETURN(auto v, impl_->StartOp(true, false, cache, keys, block_ids, std::nullopt, true, stream));
  return std::get<OpHandle>(v);
}

Result<OpHandle> Client::StoreAsync(CacheId cache, std::span<const BlockKey> keys, std::span<const uint32_t> block_ids,
                                    const std::optional<BlockKey>& parent, CudaStream stream,
                                    const BlockEventInfo* events, const BlockHint* hint) {
  KVTIER_ASSIGN_OR_RETURN(auto v,
                          impl_->StartOp(false, false, cache, keys, block_ids, parent, true, stream, events, hint));
  return std::get<OpHandle>(v);
}

Result<OpResult> Client::Wait(const OpHandle& op, std::chrono::milliseconds timeout) { return impl_->Wait(op, timeout); }
Status Client::Cancel(const OpHandle& op, std::chrono::milliseconds timeout) { return impl_->Cancel(op, timeout); }

Result<OpResult> Client::Load(CacheId cache, std::span<const BlockKey> keys, std::span<const uint32_t> block_ids) {
  KVTIER_ASSIGN_OR_RETURN(auto v, impl_->StartOp(true, true, cache, keys, block_ids, std::nullopt));
  return std::get<OpResult>(v);
}

Result<OpResult> Client::Store(CacheId cache, std::span<const BlockKey> keys, std::span<const uint32_t> block_ids,
                               const std::optional<BlockKey>& parent, const BlockEventInfo* events,
                               const BlockHint* hint) {
  KVTIER_ASSIGN_OR_RETURN(auto v,
                          impl_->StartOp(false, true, cache, keys, block_ids, parent, false, nullptr, events, hint));
  return std::get<OpResult>(v);
}

Result<HintResult> Client::Hint(CacheId cache, std::span<const BlockKey> keys, const BlockHint& hint) {
  return impl_->Hint(cache, keys, hint);
}

Result<DaemonStats> Client::Stats() { return impl_->Stats(); }
Result<uint64_t> Client::Evict(const std::string& tenant, std::optional<BlockTier> tier,
                               std::optional<LayoutFingerprint> ns) {
  return impl_->Evict(tenant, tier, ns);
}
Result<std::vector<NamespaceStats>> Client::ListNamespaces(const std::string& tenant) {
  return impl_->ListNamespaces(tenant);
}
Result<VerifyStatus> Client::VerifyDisk(bool start) { return impl_->VerifyDisk(start); }
Result<std::vector<TenantStats>> Client::ListTenants() { return impl_->ListTenants(); }
Result<uint64_t> Client::Flush() { return impl_->Flush(); }

}  // namespace kvtier
