// Client::Impl, the client's connection and state (kvtier/client.h is the
// contract), shared by its source files: client.cc (Client's public calls),
// client_connection.cc (connecting, Hello, re-registering every cache after
// a reconnect, and Call: one request and its reply), client_calls.cc
// (registration, keys, lookups, hints, loads and stores, waits and cancels)
// and client_admin.cc (stats, evict, namespaces, verify, flush, tenants).
// Nothing else includes it. Every call takes mu_: one call at a time on the
// connection, so a reply always answers the request just sent.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "client/cuda_export.h"
#include "client/op_fences.h"
#include "common/mutex.h"
#include "ipc/wire.h"
#include "kvtier/client.h"

namespace kvtier {
namespace client_detail {

namespace w = wire;

inline BlockTier TierFromWire(w::Tier t) {
  switch (t) {
    case w::Tier::Hbm: return BlockTier::kHbm;
    case w::Tier::Disk: return BlockTier::kDisk;
    case w::Tier::Remote: return BlockTier::kRemote;
    default: return BlockTier::kHost;
  }
}

inline std::vector<w::Key> KeysToWire(std::span<const BlockKey> keys) {
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

}  // namespace client_detail

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

  Status Connect();

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
  uint32_t max_keys_per_request() const {
    MutexLock lock(&mu_);
    return max_keys_per_request_;
  }

  Result<CacheId> Register(const Layout& layout, uint32_t num_blocks, std::vector<Placement> placements,
                           std::vector<KvRegion> regions, CodecChoice codec);

  Result<CacheId> RegisterCuda(const Layout& layout, uint32_t num_blocks, std::vector<Placement> placements,
                               std::vector<CudaKvRegion> regions, CodecChoice codec);

  // Registers a new cache on this connection and keeps it for reconnects.
  Result<CacheId> Add(std::unique_ptr<Cache> cache) KVTIER_REQUIRES(mu_);

  Result<std::vector<BlockKey>> ComputeKeys(CacheId id, std::span<const uint32_t> tokens,
                                            std::span<const ExtraKeys> extra, const std::optional<BlockKey>& parent);

  Result<BlockKey> KeyFromEngineHash(CacheId id, std::span<const uint8_t> hash);

  Result<LookupResult> Lookup(CacheId id, std::span<const BlockKey> keys, double prefill_tokens_per_s);

  Result<HintResult> Hint(CacheId id, std::span<const BlockKey> keys, const BlockHint& hint);

  Result<uint32_t> Prefetch(CacheId id, std::span<const BlockKey> keys, double prefill_tokens_per_s);

  // Starts a Load (by layer: Load.by_layer) or Store; with `wait`, returns
  // its OpResult instead. `ordered` (GPU caches): the op is ordered against
  // the engine's `stream` (which may be 0, the legacy default stream)
  // through one of the cache's events (CudaExport).
  enum class OpKind : uint8_t { kLoad, kLoadByLayer, kStore, kStoreByLayer };
  Result<std::variant<OpHandle, OpResult>> StartOp(OpKind kind, bool wait, CacheId id, std::span<const BlockKey> keys,
                                                   std::span<const uint32_t> block_ids,
                                                   const std::optional<BlockKey>& parent, bool ordered = false,
                                                   CudaStream stream = nullptr,
                                                   const BlockEventInfo* events = nullptr,
                                                   const BlockHint* hint = nullptr);

  // Ops holding a GPU cache's event may still have the daemon record or
  // watch it: collect them (for a bounded time) before the events go.
  ~Impl();

  Result<OpResult> Wait(const OpHandle& op, std::chrono::milliseconds timeout);

  Result<OpResult> WaitLocked(const OpHandle& op, std::chrono::milliseconds timeout) KVTIER_REQUIRES(mu_);

  Status Cancel(const OpHandle& op, std::chrono::milliseconds timeout);

  Result<bool> WaitLayers(const OpHandle& op, uint32_t layers, std::chrono::milliseconds timeout);
  Status StreamWaitLayers(const OpHandle& op, uint32_t layers, CudaStream stream);
  Status LayersWritten(const OpHandle& op, uint32_t layers);
  // Sends StoreLayers (no reply awaited).
  Status SendStoreLayers(uint64_t op, uint32_t layers) KVTIER_REQUIRES(mu_);

  Result<DaemonStats> Stats();

  Result<uint64_t> Evict(const std::string& tenant, std::optional<BlockTier> tier,
                         std::optional<LayoutFingerprint> ns);

  Result<std::vector<NamespaceStats>> ListNamespaces(const std::string& tenant);

  Result<VerifyStatus> VerifyDisk(bool start);

  Result<uint64_t> Flush();

  Result<std::vector<TenantStats>> ListTenants();

 private:
  using Reply = client_detail::Reply;

  static Result<OpResult> ToOpResult(const wire::OpResult& r) {
    if (!r.done()) return Err(Status(StatusCode::kDeadlineExceeded, "the op is still running"));
    const Status st = ipc::StatusFromWire(r.code(), r.message());
    if (!st.ok()) return Err(st);
    return OpResult{r.blocks(), r.already()};
  }
  static Result<std::variant<OpHandle, OpResult>> FinishOpResult(const wire::OpResult& r) {
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
  Status Abandon(std::optional<OpFences::Fence> fence, Status error);

  void ReleaseOpEvent(uint64_t op) KVTIER_REQUIRES(mu_);

  void Disconnect() KVTIER_REQUIRES(mu_);

  // Connects, says Hello and re-registers every cache.
  Status Reconnect() KVTIER_REQUIRES(mu_);

  Status RegisterOne(Cache& c) KVTIER_REQUIRES(mu_);

  // Sends a request and reads until its reply. A transport failure drops the
  // connection and returns kUnavailable; no reply within call_timeout (plus
  // `also`: a Wait's own time) drops it and returns kDeadlineExceeded; an
  // Error reply is returned as its status; a reply of another type than
  // `expect` is kInternal.
  Result<Reply> Call(std::vector<uint8_t> bytes, std::span<const int> fds, uint64_t id,
                     wire::Body expect, std::chrono::milliseconds also = {}) KVTIER_REQUIRES(mu_);

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
  bool layer_progress_ KVTIER_GUARDED_BY(mu_) = false;  // Welcome.layer_progress
  bool layer_stores_ KVTIER_GUARDED_BY(mu_) = false;    // Welcome.layer_stores
  // The Welcome's limits.max_keys_per_request (at least 1), of the last
  // daemon reached.
  uint32_t max_keys_per_request_ KVTIER_GUARDED_BY(mu_) = 1;
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
  // GPU streams' waits on fences_'s progress words (StreamWaitLayers),
  // made at the first; ended and torn down before fences_.
  Mutex layer_waits_mu_;
  std::unique_ptr<CudaLayerWaits> layer_waits_ KVTIER_GUARDED_BY(layer_waits_mu_);
};

}  // namespace kvtier
