// TenantRegistry: who may connect, and each tenant's secrets and quotas.
//
// A peer is identified from its socket credentials (SO_PEERCRED uid/gid) and
// an optional token from Hello, never from anything else it claims. Tokens
// are compared in constant time. Each tenant has a salt (never sent) keying
// its stored keys and a hash secret (sent in Welcome) keying its chain keys;
// tenants of one sharing group share both, so they hit each other's blocks.
// Secrets not named in the config are generated on first start under
// <state_dir>/salts (mode 0700, files 0600) and reused after restarts.
//
// Owned by the event-loop thread; thread-compatible.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/device_backend.h"
#include "common/secret.h"
#include "common/status.h"
#include "config/config.h"
#include "daemon/node_budget.h"
#include "ipc/seqpacket.h"
#include "tiers/block_cache.h"

namespace kvtier {

struct Tenant {
  TenantId id = 0;
  TenantConfig config;
  Secret salt;
  Secret hash_secret;
  uint32_t sessions = 0;  // live sessions
  // What its registered KV caches map in kvtierd now (limits.max_mappings_
  // per_tenant, max_mapped_bytes_per_tenant): charged at registration, given
  // back when the cache's mapping is released, which may be on a copy worker.
  struct Mapped {
    std::atomic<uint64_t> maps{0};
    std::atomic<uint64_t> bytes{0};
  };
  std::shared_ptr<Mapped> mapped = std::make_shared<Mapped>();
  // Its Evict and ListNamespaces calls (limits.bulk_calls_per_second): a
  // token bucket, and whether one of its evicts is waiting or running.
  double bulk_tokens = -1;  // < 0: full (not used yet)
  std::chrono::steady_clock::time_point bulk_refilled{};
  bool evicting = false;
};

// A tenant's charge for one registered KV cache's maps (Tenant::mapped, and
// the node's budgets of maps and memory), taken by the event loop before
// anything is mapped, then held with the cache's ClientMapping: given back
// when the mapping is released, on whichever thread drops it last.
// Move-only.
class MappedCharge {
 public:
  // `maps` regions of `bytes` in all, `host_bytes` of them the node's memory
  // (memfds; not a GPU's). Errors: kResourceExhausted naming the limit the
  // charge would pass, the tenant's own or the node's.
  static Result<MappedCharge> Take(const Tenant& tenant, const Config::Limits& limits,
                                   std::shared_ptr<NodeBudgets> node, uint64_t maps, uint64_t bytes,
                                   uint64_t host_bytes);
  MappedCharge(MappedCharge&& other) noexcept
      : mapped_(std::move(other.mapped_)),
        node_(std::move(other.node_)),
        tenant_(other.tenant_),
        maps_(other.maps_),
        bytes_(other.bytes_),
        host_bytes_(other.host_bytes_) {}
  MappedCharge& operator=(MappedCharge&&) = delete;
  ~MappedCharge();

  // `mapping`, holding this charge until the last copy of it is dropped
  // (after the mapping itself is released).
  std::shared_ptr<ClientMapping> Hold(std::shared_ptr<ClientMapping> mapping) &&;

 private:
  MappedCharge(std::shared_ptr<Tenant::Mapped> mapped, std::shared_ptr<NodeBudgets> node, TenantId tenant,
               uint64_t maps, uint64_t bytes, uint64_t host_bytes)
      : mapped_(std::move(mapped)),
        node_(std::move(node)),
        tenant_(tenant),
        maps_(maps),
        bytes_(bytes),
        host_bytes_(host_bytes) {}

  std::shared_ptr<Tenant::Mapped> mapped_;  // null once moved from
  std::shared_ptr<NodeBudgets> node_;
  TenantId tenant_ = 0;
  uint64_t maps_ = 0;
  uint64_t bytes_ = 0;
  uint64_t host_bytes_ = 0;
};

class TenantRegistry {
 public:
  // Loads or creates every tenant's secrets. Errors name the tenant and file.
  static Result<std::unique_ptr<TenantRegistry>> Create(const Config& config);

  // The tenant a peer is, or kUnauthenticated. With a token, the token must
  // match a tenant (and that tenant's uid/gid, if it has them); without one,
  // a tenant without a token whose uid/gid match. The message does not say
  // which tenants exist.
  Result<Tenant*> Authenticate(const ipc::PeerCredentials& peer,
                               std::optional<std::string_view> token);

  Tenant* FindByName(std::string_view name);
  Tenant& Get(TenantId id) { return *tenants_[id]; }
  const std::vector<std::unique_ptr<Tenant>>& tenants() const { return tenants_; }

  // Applies reloadable settings (quotas) of a new config; tenants are matched
  // by name. Returns the names of settings that need a restart to change.
  std::vector<std::string> Reload(const Config& config);

  static TenantQuota QuotaOf(const TenantConfig& t);

 private:
  TenantRegistry() = default;
  // Keyed digest of a token, so comparisons take the same time whatever the
  // token's length or content.
  std::array<uint8_t, 16> TokenDigest(std::string_view token) const;

  std::vector<std::unique_ptr<Tenant>> tenants_;
  std::vector<std::optional<std::array<uint8_t, 16>>> token_digests_;  // per tenant
  std::optional<Secret> token_key_;
};

}  // namespace kvtier
