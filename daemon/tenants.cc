#include "daemon/tenants.h"

#include <sys/stat.h>

#include <cerrno>
#include <filesystem>
#include <map>

#include "common/xxh128.h"
#include "config/size.h"

namespace kvtier {
namespace {

Status MakePrivateDir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::FromErrno(ec.value(), "creating directory " + dir);
  if (::chmod(dir.c_str(), 0700) != 0) return Status::FromErrno(errno, "chmod 0700 " + dir);
  return Status::Ok();
}

}  // namespace

TenantQuota TenantRegistry::QuotaOf(const TenantConfig& t) {
  TenantQuota q;
  q.bytes[static_cast<size_t>(Tier::kHbm)] = t.quotas.hbm_bytes;
  q.bytes[static_cast<size_t>(Tier::kHost)] = t.quotas.host_bytes;
  q.bytes[static_cast<size_t>(Tier::kDisk)] = t.quotas.disk_bytes;
  return q;
}

Result<std::unique_ptr<TenantRegistry>> TenantRegistry::Create(const Config& config) {
  std::unique_ptr<TenantRegistry> r(new TenantRegistry());
  KVTIER_ASSIGN_OR_RETURN(Secret token_key, Secret::Generate());
  r->token_key_ = std::move(token_key);
  const std::string salts_dir = config.state_dir + "/salts";
  KVTIER_RETURN_IF_ERROR(MakePrivateDir(salts_dir));
  // One salt and one hash secret per scope (sharing group or lone tenant).
  std::map<std::string, std::pair<Secret, Secret>> by_scope;
  if (config.tenants.size() > UINT16_MAX) return Err(InvalidArgument("too many tenants"));
  for (const TenantConfig& t : config.tenants) {
    const std::string scope = t.SaltScope();
    auto it = by_scope.find(scope);
    if (it == by_scope.end()) {
      const std::string salt_path = t.salt_file.empty() ? salts_dir + "/" + scope + ".salt" : t.salt_file;
      Result<Secret> salt = t.salt_file.empty() ? Secret::LoadOrCreateFile(salt_path)
                                                : Secret::LoadFile(salt_path);
      if (!salt) return Err(salt.error().WithContext("tenant " + t.name + " salt"));
      Result<Secret> chain = Secret::LoadOrCreateFile(salts_dir + "/" + scope + ".chain");
      if (!chain) return Err(chain.error().WithContext("tenant " + t.name + " hash secret"));
      it = by_scope.emplace(scope, std::pair(std::move(*salt), std::move(*chain))).first;
    }
    auto tenant = std::make_unique<Tenant>(Tenant{.id = static_cast<TenantId>(r->tenants_.size()),
                                                  .config = t,
                                                  .salt = it->second.first,
                                                  .hash_secret = it->second.second,
                                                  .sessions = 0});
    r->token_digests_.push_back(t.token ? std::optional(r->TokenDigest(*t.token)) : std::nullopt);
    r->tenants_.push_back(std::move(tenant));
  }
  return r;
}

std::array<uint8_t, 16> TenantRegistry::TokenDigest(std::string_view token) const {
  const auto* data = reinterpret_cast<const uint8_t*>(token.data());
  return Xxh3_128WithSecret<BlockKey>({data, token.size()}, token_key_->bytes()).bytes;
}

Result<Tenant*> TenantRegistry::Authenticate(const ipc::PeerCredentials& peer,
                                             std::optional<std::string_view> token) {
  auto creds_match = [&](const TenantConfig& t) {
    return (!t.uid || *t.uid == peer.uid) && (!t.gid || *t.gid == peer.gid);
  };
  if (token) {
    // Compare against every configured token without stopping early.
    const std::array<uint8_t, 16> digest = TokenDigest(*token);
    Tenant* found = nullptr;
    for (size_t i = 0; i < tenants_.size(); ++i) {
      if (!token_digests_[i]) continue;
      uint8_t diff = 0;
      for (size_t j = 0; j < digest.size(); ++j) diff |= digest[j] ^ (*token_digests_[i])[j];
      if (diff == 0 && creds_match(tenants_[i]->config)) found = tenants_[i].get();
    }
    if (found != nullptr) return found;
  } else {
    // The most specific match wins: uid and gid over uid or gid alone.
    Tenant* best = nullptr;
    int best_score = 0;
    for (const auto& t : tenants_) {
      if (t->config.token || !creds_match(t->config)) continue;
      const int score = int{t->config.uid.has_value()} + int{t->config.gid.has_value()};
      if (score > best_score) {
        best = t.get();
        best_score = score;
      }
    }
    if (best != nullptr) return best;
  }
  return Err(Status(StatusCode::kUnauthenticated,
                    "no tenant matches uid " + std::to_string(peer.uid) + " gid " +
                        std::to_string(peer.gid) + (token ? " and the token given" : " without a token")));
}

Tenant* TenantRegistry::FindByName(std::string_view name) {
  for (const auto& t : tenants_) {
    if (t->config.name == name) return t.get();
  }
  return nullptr;
}

std::vector<std::string> TenantRegistry::Reload(const Config& config) {
  std::vector<std::string> need_restart;
  if (config.tenants.size() != tenants_.size()) need_restart.push_back("tenants (added or removed)");
  for (const TenantConfig& t : config.tenants) {
    Tenant* mine = FindByName(t.name);
    if (mine == nullptr) continue;
    mine->config.quotas = t.quotas;
    mine->config.codecs = t.codecs;  // for the registrations from now on
    const TenantConfig& old = mine->config;
    if (old.uid != t.uid || old.gid != t.gid || old.token != t.token || old.admin != t.admin ||
        old.sharing_group != t.sharing_group || old.salt_file != t.salt_file) {
      need_restart.push_back("tenants[" + t.name + "] identity, admin, group or salt");
    }
    if (old.publish_events != t.publish_events || old.model != t.model) {
      need_restart.push_back("tenants[" + t.name + "] publish_events or model");
    }
  }
  return need_restart;
}

Result<MappedCharge> MappedCharge::Take(const Tenant& tenant, const Config::Limits& limits,
                                        std::shared_ptr<NodeBudgets> node, uint64_t maps, uint64_t bytes,
                                        uint64_t host_bytes) {
  // Only the event loop adds: what it reads can only fall meanwhile.
  const Tenant::Mapped& now = *tenant.mapped;
  if (now.maps.load() + maps > limits.max_mappings_per_tenant) {
    return Err(Status(StatusCode::kResourceExhausted,
                      "tenant " + tenant.config.name + " would map " + std::to_string(now.maps.load() + maps) +
                          " regions in kvtierd, past limits.max_mappings_per_tenant (" +
                          std::to_string(limits.max_mappings_per_tenant) + "); close KV caches it no longer uses"));
  }
  if (now.bytes.load() + bytes > limits.max_mapped_bytes_per_tenant) {
    return Err(Status(StatusCode::kResourceExhausted,
                      "tenant " + tenant.config.name + " would map " + FormatSize(now.bytes.load() + bytes) +
                          " in kvtierd, past limits.max_mapped_bytes_per_tenant (" +
                          FormatSize(limits.max_mapped_bytes_per_tenant) + ")"));
  }
  KVTIER_RETURN_IF_ERROR(node->maps.Take(tenant.id, tenant.config.name, maps));
  if (Status st = node->memory.Take(tenant.id, tenant.config.name, host_bytes); !st.ok()) {
    node->maps.Give(tenant.id, maps);
    return Err(std::move(st));
  }
  tenant.mapped->maps += maps;
  tenant.mapped->bytes += bytes;
  return MappedCharge(tenant.mapped, std::move(node), tenant.id, maps, bytes, host_bytes);
}

MappedCharge::~MappedCharge() {
  if (!mapped_) return;
  mapped_->maps -= maps_;
  mapped_->bytes -= bytes_;
  node_->maps.Give(tenant_, maps_);
  node_->memory.Give(tenant_, host_bytes_);
}

std::shared_ptr<ClientMapping> MappedCharge::Hold(std::shared_ptr<ClientMapping> mapping) && {
  struct Held {
    MappedCharge charge;
    std::shared_ptr<ClientMapping> mapping;  // released first: declared last
  };
  auto held = std::make_shared<Held>(Held{std::move(*this), std::move(mapping)});
  ClientMapping* raw = held->mapping.get();
  return std::shared_ptr<ClientMapping>(std::move(held), raw);
}

}  // namespace kvtier
