// The tenants: section: who may connect, how each is identified, its salt,
// quotas and rights; and what must differ between tenants.
#include "config/config_sections.h"

#include <unistd.h>

#include <map>
#include <optional>
#include <string>
#include <utility>

#include "common/secret.h"

namespace kvtier::config_yaml {
namespace {

constexpr size_t kMinTokenBytes = 16;

void ReadQuotas(Context* ctx, const YAML::Node& node, const std::string& path, TierQuotas* q) {
  MapReader r(ctx, node, path);
  r.Read("hbm", &q->hbm_bytes, Optional<uint64_t>(ParseSizeNode));
  r.Read("host", &q->host_bytes, Optional<uint64_t>(ParseSizeNode));
  r.Read("disk", &q->disk_bytes, Optional<uint64_t>(ParseSizeNode));
  r.Finish();
}

void ReadTenant(Context* ctx, const YAML::Node& node, const std::string& path, TenantConfig* t) {
  MapReader r(ctx, node, path);
  if (!r.Read("name", &t->name, ParseName)) ctx->Error(path + ".name", node, "is required");
  r.Read("uid", &t->uid, Optional<uint32_t>(ParseUserId));
  r.Read("gid", &t->gid, Optional<uint32_t>(ParseGroupId));
  std::string token;
  const bool has_token = r.Read("token", &token, ParseNonEmpty);
  std::string token_file;
  const bool has_token_file = r.Read("token_file", &token_file, [&](const YAML::Node& n, std::string* p) {
    return ReadTokenFile(n, p, &token);
  });
  if (has_token && has_token_file) {
    ctx->ErrorAt(path + ".token_file", "give token or token_file, not both");
  } else if (has_token || has_token_file) {
    const std::string key = path + (has_token ? ".token" : ".token_file");
    if (token.size() < kMinTokenBytes) {
      ctx->ErrorAt(key, "a token must be at least " + std::to_string(kMinTokenBytes) +
                            " bytes (e.g. openssl rand -hex 32)");
    }
    t->token = token;
  }
  r.Read("salt_file", &t->salt_file, [](const YAML::Node& n, std::string* p) -> ParseResult {
    if (auto e = ParseNonEmpty(n, p); !e.empty()) return e;
    Result<Secret> salt = Secret::LoadFile(*p);
    return salt ? ParseResult() : salt.error().message();
  });
  r.Read("sharing_group", &t->sharing_group, ParseName);
  ReadQuotas(ctx, r.Take("quotas"), path + ".quotas", &t->quotas);
  r.Read("admin", &t->admin, ParseBoolNode);
  r.Read("publish_events", &t->publish_events, ParseBoolNode);
  r.Read("model", &t->model, ParseNonEmpty);
  r.Read("codecs", &t->codecs, [](const YAML::Node& n, std::vector<CodecKind>* out) {
    return ParseList(n, out, [](const YAML::Node& item, CodecKind* v) {
      return ParseEnum<CodecKind>(
          item, {{"none", CodecKind::kNone}, {"lossless", CodecKind::kLossless}, {"fp8", CodecKind::kFp8}}, v);
    });
  });
  r.Finish();
  if (!t->uid && !t->gid && !t->token) {
    ctx->ErrorAt(path, "needs uid, gid, token or token_file to identify the tenant");
  }
}

}  // namespace

void ReadTenants(Context* ctx, const YAML::Node& node, std::vector<TenantConfig>* tenants) {
  if (!node.IsDefined()) {
    TenantConfig local;
    local.name = "local";
    local.uid = static_cast<uint32_t>(::getuid());
    // A node with one tenant: it has no co-tenant to be kept from, and its
    // operator needs kvtierctl's admin calls.
    local.admin = true;
    tenants->assign(1, local);
    return;
  }
  if (!node.IsSequence()) {
    ctx->Error("tenants", node, "expected a list of tenants, got " + Describe(node));
    return;
  }
  if (node.size() == 0) ctx->Error("tenants", node, "at least one tenant is required");
  tenants->clear();
  for (size_t i = 0; i < node.size(); ++i) {
    TenantConfig t;
    ReadTenant(ctx, node[i], "tenants[" + std::to_string(i) + "]", &t);
    tenants->push_back(std::move(t));
  }
  // Across tenants: names, credentials and tokens must be unique, and one
  // salt file must not be shared outside a sharing group.
  std::map<std::string, size_t> names, tokens, salt_scopes_by_file;
  std::map<std::pair<std::optional<uint32_t>, std::optional<uint32_t>>, size_t> creds;
  std::map<std::string, std::string> salt_file_by_scope;
  for (size_t i = 0; i < tenants->size(); ++i) {
    const TenantConfig& t = (*tenants)[i];
    const std::string path = "tenants[" + std::to_string(i) + "]";
    if (t.name.empty()) continue;
    if (auto [it, fresh] = names.emplace(t.name, i); !fresh) {
      ctx->ErrorAt(path + ".name", "'" + t.name + "' is also the name of tenants[" +
                                       std::to_string(it->second) + "]");
    }
    if (t.uid || t.gid) {
      if (auto [it, fresh] = creds.emplace(std::pair(t.uid, t.gid), i); !fresh) {
        ctx->ErrorAt(path + (t.uid ? ".uid" : ".gid"),
                     "the same uid/gid already identifies tenants[" + std::to_string(it->second) + "]");
      }
    }
    if (t.token) {
      if (auto [it, fresh] = tokens.emplace(*t.token, i); !fresh) {
        ctx->ErrorAt(path + ".token", "the same token already identifies tenants[" +
                                          std::to_string(it->second) + "]");
      }
    }
    const std::string scope = t.SaltScope();
    if (auto [it, fresh] = salt_file_by_scope.emplace(scope, t.salt_file); !fresh && it->second != t.salt_file) {
      ctx->ErrorAt(path + ".salt_file", "tenants of sharing group '" + t.sharing_group +
                                            "' must all name the same salt_file (or none)");
    }
    if (!t.salt_file.empty()) {
      auto [it, fresh] = salt_scopes_by_file.emplace(t.salt_file, i);
      if (!fresh && (*tenants)[it->second].SaltScope() != scope) {
        ctx->ErrorAt(path + ".salt_file", "'" + t.salt_file + "' is also the salt of tenants[" +
                                              std::to_string(it->second) +
                                              "], which is not in this tenant's sharing group");
      }
    }
  }
}

}  // namespace kvtier::config_yaml
