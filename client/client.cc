// Client's public calls (kvtier/client.h), each handed to Client::Impl
// (client_impl.h, implemented in client_connection.cc, client_calls.cc and
// client_admin.cc), and the tier names.
#include "kvtier/client.h"

#include <algorithm>

#include "client/client_impl.h"
#include "common/version.h"

namespace kvtier {

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

uint32_t Client::max_keys_per_request() const { return impl_->max_keys_per_request(); }

namespace {

// Calls `call` on consecutive pieces of `keys` of at most the daemon's
// max_keys_per_request each (read before every piece: a reconnect may reach
// a daemon with another limit), and `merge` adds each piece's result to the
// total; the next piece is sent while `merge` returns true.
template <typename T, typename Call, typename Merge>
Result<T> Split(const Client& client, std::span<const BlockKey> keys, Call call, Merge merge) {
  T total{};
  size_t done = 0;
  do {
    const size_t n = std::min<size_t>(keys.size() - done, client.max_keys_per_request());
    KVTIER_ASSIGN_OR_RETURN(T part, call(keys.subspan(done, n)));
    const bool whole = merge(total, std::move(part), n);
    done += n;
    if (!whole) break;
  } while (done < keys.size());
  return total;
}

}  // namespace

Result<LookupResult> Client::Lookup(CacheId cache, std::span<const BlockKey> keys, double prefill_tokens_per_s) {
  return Split<LookupResult>(
      *this, keys, [&](auto part) { return impl_->Lookup(cache, part, prefill_tokens_per_s); },
      [](LookupResult& total, LookupResult part, size_t n) {
        total.hits += part.hits;
        total.tiers.insert(total.tiers.end(), part.tiers.begin(), part.tiers.end());
        total.recompute += part.recompute;
        return part.hits == n;
      });
}

Result<uint32_t> Client::Prefetch(CacheId cache, std::span<const BlockKey> keys, double prefill_tokens_per_s) {
  return Split<uint32_t>(
      *this, keys, [&](auto part) { return impl_->Prefetch(cache, part, prefill_tokens_per_s); },
      [](uint32_t& total, uint32_t part, size_t n) {
        total += part;
        return part == n;
      });
}

Result<OpHandle> Client::LoadAsync(CacheId cache, std::span<const BlockKey> keys, std::span<const uint32_t> block_ids,
                                   const BlockHint* hint) {
  KVTIER_ASSIGN_OR_RETURN(auto v, impl_->StartOp(Impl::OpKind::kLoad, false, cache, keys, block_ids, std::nullopt,
                                                 false, nullptr, nullptr, hint));
  return std::get<OpHandle>(v);
}

Result<OpHandle> Client::LoadLayersAsync(CacheId cache, std::span<const BlockKey> keys,
                                        std::span<const uint32_t> block_ids, const BlockHint* hint) {
  KVTIER_ASSIGN_OR_RETURN(auto v, impl_->StartOp(Impl::OpKind::kLoadByLayer, false, cache, keys, block_ids,
                                                 std::nullopt, false, nullptr, nullptr, hint));
  return std::get<OpHandle>(v);
}

Result<bool> Client::WaitLayers(const OpHandle& op, uint32_t layers, std::chrono::milliseconds timeout) {
  return impl_->WaitLayers(op, layers, timeout);
}

Status Client::StreamWaitLayers(const OpHandle& op, uint32_t layers, CudaStream stream) {
  return impl_->StreamWaitLayers(op, layers, stream);
}

Result<OpHandle> Client::StoreAsync(CacheId cache, std::span<const BlockKey> keys, std::span<const uint32_t> block_ids,
                                    const std::optional<BlockKey>& parent, const BlockEventInfo* events,
                                    const BlockHint* hint) {
  KVTIER_ASSIGN_OR_RETURN(auto v,
                          impl_->StartOp(Impl::OpKind::kStore, false, cache, keys, block_ids, parent, false, nullptr, events, hint));
  return std::get<OpHandle>(v);
}

Result<OpHandle> Client::StoreLayersAsync(CacheId cache, std::span<const BlockKey> keys,
                                         std::span<const uint32_t> block_ids, const std::optional<BlockKey>& parent,
                                         const BlockEventInfo* events, const BlockHint* hint) {
  KVTIER_ASSIGN_OR_RETURN(auto v, impl_->StartOp(Impl::OpKind::kStoreByLayer, false, cache, keys, block_ids, parent,
                                                 false, nullptr, events, hint));
  return std::get<OpHandle>(v);
}

Status Client::LayersWritten(const OpHandle& op, uint32_t layers) { return impl_->LayersWritten(op, layers); }

Result<OpHandle> Client::LoadAsync(CacheId cache, std::span<const BlockKey> keys, std::span<const uint32_t> block_ids,
                                   CudaStream stream, const BlockHint* hint) {
  KVTIER_ASSIGN_OR_RETURN(auto v, impl_->StartOp(Impl::OpKind::kLoad, false, cache, keys, block_ids, std::nullopt,
                                                 true, stream, nullptr, hint));
  return std::get<OpHandle>(v);
}

Result<OpHandle> Client::StoreAsync(CacheId cache, std::span<const BlockKey> keys, std::span<const uint32_t> block_ids,
                                    const std::optional<BlockKey>& parent, CudaStream stream,
                                    const BlockEventInfo* events, const BlockHint* hint) {
  KVTIER_ASSIGN_OR_RETURN(auto v,
                          impl_->StartOp(Impl::OpKind::kStore, false, cache, keys, block_ids, parent, true, stream, events, hint));
  return std::get<OpHandle>(v);
}

Result<OpResult> Client::Wait(const OpHandle& op, std::chrono::milliseconds timeout) { return impl_->Wait(op, timeout); }
Status Client::Cancel(const OpHandle& op, std::chrono::milliseconds timeout) { return impl_->Cancel(op, timeout); }

Result<OpResult> Client::Load(CacheId cache, std::span<const BlockKey> keys, std::span<const uint32_t> block_ids,
                              const BlockHint* hint) {
  KVTIER_ASSIGN_OR_RETURN(auto v, impl_->StartOp(Impl::OpKind::kLoad, true, cache, keys, block_ids, std::nullopt,
                                                 false, nullptr, nullptr, hint));
  return std::get<OpResult>(v);
}

Result<OpResult> Client::Store(CacheId cache, std::span<const BlockKey> keys, std::span<const uint32_t> block_ids,
                               const std::optional<BlockKey>& parent, const BlockEventInfo* events,
                               const BlockHint* hint) {
  KVTIER_ASSIGN_OR_RETURN(auto v,
                          impl_->StartOp(Impl::OpKind::kStore, true, cache, keys, block_ids, parent, false, nullptr, events, hint));
  return std::get<OpResult>(v);
}

Result<HintResult> Client::Hint(CacheId cache, std::span<const BlockKey> keys, const BlockHint& hint) {
  return Split<HintResult>(
      *this, keys, [&](auto part) { return impl_->Hint(cache, part, hint); },
      [](HintResult& total, HintResult part, size_t) {
        total.hinted += part.hinted;
        total.refused += part.refused;
        return true;
      });
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
