// The whole configuration schema is read here, one reader per section, so
// that every key, its bound and its error sit in one place (past 800 lines
// on purpose: splitting the sections apart would scatter the schema).
#include "config/config_loader.h"

#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include <yaml-cpp/yaml.h>

#include "common/disk_limits.h"
#include "common/secret.h"
#include "config/size.h"
#include "config/startup_rules.h"

namespace kvtier {
namespace {

constexpr size_t kMinTokenBytes = 16;

// ---------------------------------------------------------------------------
// Where values came from, and the errors found.

class Context {
 public:
  Context(std::string file_name, std::vector<std::pair<std::string, std::string>> overridden)
      : file_name_(std::move(file_name)), overridden_(std::move(overridden)) {}

  // "FILE:LINE", "--set KEY=VALUE" or "defaults".
  std::string Where(const std::string& path, const YAML::Node& node) const {
    // The last override wins, so search from the back.
    for (auto it = overridden_.rbegin(); it != overridden_.rend(); ++it) {
      const std::string& key = it->first;
      // The node itself, something under it, or a map --set created above it.
      const bool under = path.starts_with(key) && (path[key.size()] == '.' || path[key.size()] == '[');
      const bool above = key.starts_with(path + ".");
      if (path == key || under || above) return "--set " + it->second;
    }
    if (node.IsDefined() && node.Mark().line >= 0 && !file_name_.empty()) {
      return file_name_ + ":" + std::to_string(node.Mark().line + 1);
    }
    return file_name_.empty() ? "defaults" : file_name_;
  }

  void Error(const std::string& path, const YAML::Node& node, const std::string& what) {
    if (!locations_.count(path)) Record(path, node);
    errors_.push_back(locations_[path] + ": " + path + ": " + what);
  }
  // At exactly `node` (a duplicate or unknown key).
  void ErrorHere(const std::string& path, const YAML::Node& node, const std::string& what) {
    errors_.push_back(Where(path, node) + ": " + path + ": " + what);
  }
  // For checks across fields, after reading: uses the recorded location.
  void ErrorAt(const std::string& path, const std::string& what) {
    auto it = locations_.find(path);
    const std::string where =
        it != locations_.end() ? it->second : (file_name_.empty() ? "defaults" : file_name_);
    errors_.push_back(where + ": " + path + ": " + what);
  }
  void Record(const std::string& path, const YAML::Node& node) {
    locations_[path] = Where(path, node);
  }
  void Known(const std::string& path) {
    // "tenants[3].name" -> "tenants[].name"
    std::string normalized;
    for (size_t i = 0; i < path.size(); ++i) {
      normalized += path[i];
      if (path[i] == '[') {
        while (i + 1 < path.size() && path[i + 1] != ']') ++i;
      }
    }
    known_.insert(normalized);
  }

  const std::vector<std::string>& errors() const { return errors_; }
  const std::set<std::string>& known() const { return known_; }

 private:
  std::string file_name_;
  std::vector<std::pair<std::string, std::string>> overridden_;  // (dotted key, "key=value")
  std::map<std::string, std::string> locations_;
  std::vector<std::string> errors_;
  std::set<std::string> known_;
};

// ---------------------------------------------------------------------------
// Scalar parsers: YAML node -> value, or a message saying what is wrong.

using ParseResult = std::string;  // empty: OK; otherwise the problem

std::string Describe(const YAML::Node& n) {
  if (n.IsMap()) return "a map";
  if (n.IsSequence()) return "a list";
  if (n.IsNull()) return "nothing";
  return "'" + n.Scalar() + "'";
}

ParseResult ScalarText(const YAML::Node& n, std::string* out) {
  if (!n.IsScalar()) return "expected a value, got " + Describe(n);
  *out = n.Scalar();
  return {};
}

ParseResult ParseBoolNode(const YAML::Node& n, bool* out) {
  std::string text;
  if (auto e = ScalarText(n, &text); !e.empty()) return e;
  if (!YAML::convert<bool>::decode(n, *out)) return "expected true or false, got '" + text + "'";
  return {};
}

ParseResult ParseUint(const YAML::Node& n, uint64_t min, uint64_t max, uint64_t* out) {
  std::string text;
  if (auto e = ScalarText(n, &text); !e.empty()) return e;
  uint64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty()) {
    return "expected a whole number from " + std::to_string(min) + " to " + std::to_string(max) +
           ", got '" + text + "'";
  }
  if (v < min || v > max) {
    return "must be from " + std::to_string(min) + " to " + std::to_string(max) + ", got " + text;
  }
  *out = v;
  return {};
}

ParseResult ParseU32(const YAML::Node& n, uint32_t min, uint32_t max, uint32_t* out) {
  uint64_t v = 0;
  if (auto e = ParseUint(n, min, max, &v); !e.empty()) return e;
  *out = static_cast<uint32_t>(v);
  return {};
}

// A positive byte size.
ParseResult ParseSizeNode(const YAML::Node& n, uint64_t* out) {
  std::string text;
  if (auto e = ScalarText(n, &text); !e.empty()) return e;
  Result<uint64_t> size = ParseSize(text);
  if (!size) return size.error().message();
  if (*size == 0) return "must be a positive size, got '" + text + "'";
  *out = *size;
  return {};
}

ParseResult ParseRatio(const YAML::Node& n, double* out) {
  std::string text;
  if (auto e = ScalarText(n, &text); !e.empty()) return e;
  double v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty() || !(v > 0 && v <= 1)) {
    return "expected a fraction in (0, 1], got '" + text + "'";
  }
  *out = v;
  return {};
}

ParseResult ParseNonEmpty(const YAML::Node& n, std::string* out) {
  if (auto e = ScalarText(n, out); !e.empty()) return e;
  if (out->empty()) return "must not be empty";
  return {};
}

// Names used in file names: tenants and sharing groups.
ParseResult ParseName(const YAML::Node& n, std::string* out) {
  if (auto e = ParseNonEmpty(n, out); !e.empty()) return e;
  const bool ok = out->size() <= 64 && std::all_of(out->begin(), out->end(), [](char c) {
                    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                           (c >= '0' && c <= '9') || c == '_' || c == '-' || c == '.';
                  }) && out->front() != '.';
  if (!ok) return "'" + *out + "' must be 1-64 of A-Z a-z 0-9 _ - . and not start with '.'";
  return {};
}

template <typename Enum>
ParseResult ParseEnum(const YAML::Node& n, const std::vector<std::pair<std::string, Enum>>& values,
                      Enum* out) {
  std::string text;
  if (auto e = ScalarText(n, &text); !e.empty()) return e;
  std::string names;
  for (const auto& [name, value] : values) {
    if (text == name) {
      *out = value;
      return {};
    }
    names += names.empty() ? name : ", " + name;
  }
  return "expected one of " + names + ", got '" + text + "'";
}

// Octal, as for chmod: 0660, 660 or 0o660.
ParseResult ParseMode(const YAML::Node& n, uint32_t* out) {
  std::string text;
  if (auto e = ScalarText(n, &text); !e.empty()) return e;
  std::string_view digits = text;
  if (digits.starts_with("0o")) digits.remove_prefix(2);
  uint32_t v = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v, 8);
  if (ec != std::errc() || end != digits.data() + digits.size() || digits.empty() || v > 0777) {
    return "expected an octal mode such as 0660, got '" + text + "'";
  }
  if ((v & 0600) != 0600) return "the owner needs read and write permission (0600), got '" + text + "'";
  *out = v;
  return {};
}

// A numeric id, or a name that `lookup` resolves (nullopt: no such name).
template <typename Lookup>
ParseResult ParseIdOrName(const YAML::Node& n, uint32_t* out, const char* what, Lookup lookup) {
  std::string text;
  if (auto e = ScalarText(n, &text); !e.empty()) return e;
  uint32_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec == std::errc() && end == text.data() + text.size() && !text.empty()) {
    *out = v;
    return {};
  }
  const std::optional<uint32_t> id = lookup(text);
  if (!id) return std::string("no ") + what + " named '" + text + "' (give a name or a number)";
  *out = *id;
  return {};
}

ParseResult ParseUserId(const YAML::Node& n, uint32_t* out) {
  return ParseIdOrName(n, out, "user", [](const std::string& name) -> std::optional<uint32_t> {
    struct passwd pw {};
    struct passwd* found = nullptr;
    std::vector<char> buf(16384);
    if (getpwnam_r(name.c_str(), &pw, buf.data(), buf.size(), &found) != 0 || found == nullptr) return {};
    return found->pw_uid;
  });
}

ParseResult ParseGroupId(const YAML::Node& n, uint32_t* out) {
  return ParseIdOrName(n, out, "group", [](const std::string& name) -> std::optional<uint32_t> {
    struct group gr {};
    struct group* found = nullptr;
    std::vector<char> buf(65536);
    if (getgrnam_r(name.c_str(), &gr, buf.data(), buf.size(), &found) != 0 || found == nullptr) return {};
    return found->gr_gid;
  });
}

// host:port or [v6]:port; port 0 asks the kernel for a free one (tests).
ParseResult ParseListen(const YAML::Node& n, std::string* out) {
  if (auto e = ParseNonEmpty(n, out); !e.empty()) return e;
  const size_t colon = out->rfind(':');
  const std::string_view host = colon == std::string::npos ? "" : std::string_view(*out).substr(0, colon);
  uint32_t port = 0;
  const std::string_view port_text =
      colon == std::string::npos ? "" : std::string_view(*out).substr(colon + 1);
  const auto [end, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (host.empty() || ec != std::errc() || end != port_text.data() + port_text.size() ||
      port > 65535) {
    return "expected host:port such as 127.0.0.1:9464 or [::1]:9464, got '" + *out + "'";
  }
  return {};
}

ParseResult ReadTokenFile(const YAML::Node& n, std::string* path, std::string* token) {
  if (auto e = ParseNonEmpty(n, path); !e.empty()) return e;
  std::ifstream in(*path, std::ios::binary);
  if (!in) return "cannot read token file '" + *path + "': " + std::strerror(errno);
  std::stringstream ss;
  ss << in.rdbuf();
  *token = ss.str();
  while (!token->empty() && (token->back() == '\n' || token->back() == '\r')) token->pop_back();
  return {};
}

// ---------------------------------------------------------------------------
// MapReader: reads one YAML map, remembering which keys it knows, and reports
// unknown and duplicate keys.

class MapReader {
 public:
  MapReader(Context* ctx, YAML::Node node, std::string path)
      : ctx_(ctx), node_(std::move(node)), path_(std::move(path)) {
    if (node_.IsDefined() && !node_.IsNull() && !node_.IsMap()) {
      ctx_->Error(path_.empty() ? "(top level)" : path_, node_,
                  "expected a map of keys, got " + Describe(node_));
      valid_ = false;
    }
  }

  std::string PathOf(std::string_view key) const {
    return path_.empty() ? std::string(key) : path_ + "." + std::string(key);
  }

  // The value of `key` (undefined when absent); the key becomes known.
  YAML::Node Take(std::string_view key) {
    known_.emplace_back(key);
    ctx_->Known(PathOf(key));
    if (!valid_ || !node_.IsMap()) return YAML::Node(YAML::NodeType::Undefined);
    for (auto it = node_.begin(); it != node_.end(); ++it) {
      if (it->first.IsScalar() && it->first.Scalar() == key) {
        ctx_->Record(PathOf(key), it->first);  // the key's line, even for an empty value
        return it->second;
      }
    }
    return YAML::Node(YAML::NodeType::Undefined);
  }

  // Reads `key` with `parse` when present; returns whether it was present
  // (even if invalid). A key with no value is an error, not the default.
  template <typename T, typename Parse>
  bool Read(std::string_view key, T* out, Parse parse) {
    const YAML::Node n = Take(key);
    if (!n.IsDefined()) return false;
    if (n.IsNull()) {
      ctx_->Error(PathOf(key), n, "has no value");
      return true;
    }
    T value = *out;
    if (const ParseResult e = parse(n, &value); !e.empty()) {
      ctx_->Error(PathOf(key), n, e);
    } else {
      *out = std::move(value);
    }
    return true;
  }

  // Reports keys that no Take() asked for, and keys given twice.
  void Finish() {
    if (!valid_ || !node_.IsMap()) return;
    std::set<std::string> seen;
    for (auto it = node_.begin(); it != node_.end(); ++it) {
      const std::string key = it->first.IsScalar() ? it->first.Scalar() : "?";
      const std::string path = PathOf(key);
      if (!seen.insert(key).second) {
        ctx_->ErrorHere(path, it->first, "given more than once");
      } else if (std::find(known_.begin(), known_.end(), key) == known_.end()) {
        std::string known;
        for (const std::string& k : known_) known += known.empty() ? k : ", " + k;
        ctx_->ErrorHere(path, it->first, "unknown key (known here: " + known + ")");
      }
    }
  }

 private:
  Context* ctx_;
  YAML::Node node_;
  std::string path_;
  bool valid_ = true;
  std::vector<std::string> known_;
};

template <typename T, typename ParseItem>
ParseResult ParseList(const YAML::Node& n, std::vector<T>* out, ParseItem parse_item) {
  if (!n.IsSequence()) return "expected a list such as [a, b], got " + Describe(n);
  std::vector<T> items;
  for (size_t i = 0; i < n.size(); ++i) {
    T item{};
    if (auto e = parse_item(n[i], &item); !e.empty()) return "item " + std::to_string(i) + ": " + e;
    items.push_back(std::move(item));
  }
  *out = std::move(items);
  return {};
}

// Adapts a parser of T into a parser of std::optional<T>.
template <typename T, typename Parse>
auto Optional(Parse parse) {
  return [parse](const YAML::Node& n, std::optional<T>* out) -> ParseResult {
    T value{};
    ParseResult e = parse(n, &value);
    if (e.empty()) *out = value;
    return e;
  };
}

// ---------------------------------------------------------------------------
// Sections.

void ReadWatermarks(Context* ctx, const YAML::Node& node, const std::string& path, Watermarks* w) {
  MapReader r(ctx, node, path);
  r.Read("high", &w->high, ParseRatio);
  r.Read("low", &w->low, ParseRatio);
  r.Finish();
  if (w->low >= w->high) {
    char high[32];
    std::snprintf(high, sizeof(high), "%g", w->high);
    ctx->ErrorAt(path + ".low", "must be below " + path + ".high (" + high + ")");
  }
}

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

// "host:port" with a port of 1..65535 (the host as Redis writes it: a name,
// IPv4, or IPv6 bare or in brackets).
ParseResult ParseSeed(const YAML::Node& n, std::string* out) {
  if (auto e = ParseNonEmpty(n, out); !e.empty()) return e;
  const size_t colon = out->rfind(':');
  uint32_t port = 0;
  const char* end = out->data() + out->size();
  const auto [ptr, ec] =
      colon == std::string::npos ? std::from_chars(end, end, port) : std::from_chars(out->data() + colon + 1, end, port);
  if (colon == std::string::npos || colon == 0 || ec != std::errc() || ptr != end || port == 0 || port > 65535) {
    return "expected host:port (a port of 1-65535), got '" + *out + "'";
  }
  return {};
}

void ReadRemote(Context* ctx, const YAML::Node& node, Config::Tiers::Remote* remote) {
  MapReader h(ctx, node, "tiers.remote");
  h.Read("enabled", &remote->enabled, ParseBoolNode);
  h.Read("seeds", &remote->seeds, [](const YAML::Node& n, std::vector<std::string>* out) {
    return ParseList(n, out, ParseSeed);
  });
  h.Read("user", &remote->user, ParseNonEmpty);
  h.Read("password_file", &remote->password_file, ParseNonEmpty);
  h.Read("key_prefix", &remote->key_prefix, ParseNonEmpty);
  h.Read("write", &remote->write, [](const YAML::Node& n, RemoteWritePolicy* v) {
    return ParseEnum<RemoteWritePolicy>(
        n, {{"store", RemoteWritePolicy::kOnStore}, {"demote", RemoteWritePolicy::kOnDemote}}, v);
  });
  h.Read("connect_timeout_ms", &remote->connect_timeout_ms,
         [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 1, 60000, v); });
  h.Read("timeout_ms", &remote->timeout_ms, [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 1, 60000, v); });
  h.Read("io_threads", &remote->io_threads, [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 1, 64, v); });
  h.Read("max_inflight_batches", &remote->max_inflight_batches,
         [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 1, 65536, v); });
  h.Read("max_value_bytes", &remote->max_value_bytes, ParseSizeNode);
  h.Read("breaker_failures", &remote->breaker_failures,
         [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 1, 1000, v); });
  h.Read("breaker_cooldown_ms", &remote->breaker_cooldown_ms,
         [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 1, 3600000, v); });
  h.Finish();
  if (remote->enabled && remote->seeds.empty()) {
    ctx->ErrorAt("tiers.remote.seeds", "the remote tier is enabled but has no seed nodes (host:port)");
  }
  if (remote->max_value_bytes < (1u << 12) || remote->max_value_bytes > (512ull << 20)) {
    ctx->ErrorAt("tiers.remote.max_value_bytes", "must be between 4KiB and 512MiB (Redis' largest value)");
  }
}

void ReadTiers(Context* ctx, const YAML::Node& node, Config::Tiers* tiers) {
  MapReader r(ctx, node, "tiers");
  ReadRemote(ctx, r.Take("remote"), &tiers->remote);
  {
    MapReader h(ctx, r.Take("hbm"), "tiers.hbm");
    h.Read("enabled", &tiers->hbm.enabled, ParseBoolNode);
    h.Read("devices", &tiers->hbm.devices, [](const YAML::Node& n, std::vector<uint32_t>* out) {
      return ParseList(n, out, [](const YAML::Node& item, uint32_t* v) { return ParseU32(item, 0, 1023, v); });
    });
    h.Read("bytes", &tiers->hbm.bytes, ParseSizeNode);
    h.Finish();
    std::vector<uint32_t> sorted = tiers->hbm.devices;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
      ctx->ErrorAt("tiers.hbm.devices", "lists a device twice");
    }
  }
  {
    MapReader h(ctx, r.Take("host"), "tiers.host");
    h.Read("bytes", &tiers->host.bytes, ParseSizeNode);
    h.Read("prefault", &tiers->host.prefault, ParseBoolNode);
    h.Finish();
  }
  {
    Config::Tiers::Disk& d = tiers->disk;
    MapReader h(ctx, r.Take("disk"), "tiers.disk");
    h.Read("enabled", &d.enabled, ParseBoolNode);
    h.Read("paths", &d.paths, [](const YAML::Node& n, std::vector<std::string>* out) {
      return ParseList(n, out, ParseNonEmpty);
    });
    h.Read("bytes", &d.bytes, ParseSizeNode);
    h.Read("direct_io", &d.direct_io, ParseBoolNode);
    h.Read("queue_depth", &d.queue_depth,
           [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 1, 4096, v); });
    h.Read("region_bytes", &d.region_bytes, ParseSizeNode);
    h.Read("io_engine", &d.io_engine, [](const YAML::Node& n, IoEngineKind* v) {
      return ParseEnum<IoEngineKind>(n, {{"auto", IoEngineKind::kAuto},
                                         {"io_uring", IoEngineKind::kIoUring},
                                         {"threadpool", IoEngineKind::kThreadPool}}, v);
    });
    h.Read("io_threads", &d.io_threads,
           [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 1, 64, v); });
    h.Read("stop_flush_seconds", &d.stop_flush_seconds,
           [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 0, 3600, v); });
    h.Finish();
    if (d.enabled) {
      if (d.paths.empty()) ctx->ErrorAt("tiers.disk.paths", "the disk tier is enabled but has no paths");
      std::set<std::string> unique(d.paths.begin(), d.paths.end());
      if (unique.size() != d.paths.size()) ctx->ErrorAt("tiers.disk.paths", "lists a path twice");
    }
    constexpr uint64_t kAlign = 4096;
    constexpr uint64_t kMinRegion = 1ull << 20;
    if (d.bytes > kMaxDiskPathBytes) {
      ctx->ErrorAt("tiers.disk.bytes", "is " + FormatSize(d.bytes) +
                                           " per path; the disk tier supports at most " +
                                           FormatSize(kMaxDiskPathBytes) + " (2 PiB)");
    }
    if (d.region_bytes % kAlign != 0 || d.region_bytes < kMinRegion) {
      ctx->ErrorAt("tiers.disk.region_bytes", "must be a multiple of 4KiB and at least 1MiB, got " +
                                                  FormatSize(d.region_bytes));
    } else if (d.region_bytes > kMaxDiskRegionBytes) {
      ctx->ErrorAt("tiers.disk.region_bytes",
                   "must be below 16TiB, got " + FormatSize(d.region_bytes));
    } else if (d.bytes / d.region_bytes < 2) {
      ctx->ErrorAt("tiers.disk.bytes", "must hold at least two regions of " +
                                           FormatSize(d.region_bytes) + ", got " + FormatSize(d.bytes));
    }
  }
  {
    Config::Tiers::Compression& c = tiers->compression;
    MapReader h(ctx, r.Take("compression"), "tiers.compression");
    h.Read("threads", &c.threads, [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 0, 256, v); });
    h.Read("max_queued", &c.max_queued, [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 1, 1u << 20, v); });
    h.Read("staging_bytes", &c.staging_bytes, ParseSizeNode);
    h.Finish();
    if (c.staging_bytes < (1ull << 20)) {
      ctx->ErrorAt("tiers.compression.staging_bytes", "must be at least 1MiB, got " + FormatSize(c.staging_bytes));
    }
  }
  r.Finish();
}

void ReadPolicy(Context* ctx, const YAML::Node& node, Config::Policy* p) {
  MapReader r(ctx, node, "policy");
  {
    MapReader w(ctx, r.Take("watermarks"), "policy.watermarks");
    ReadWatermarks(ctx, w.Take("hbm"), "policy.watermarks.hbm", &p->watermarks.hbm);
    ReadWatermarks(ctx, w.Take("host"), "policy.watermarks.host", &p->watermarks.host);
    ReadWatermarks(ctx, w.Take("disk"), "policy.watermarks.disk", &p->watermarks.disk);
    w.Finish();
  }
  r.Read("eviction", &p->eviction, [](const YAML::Node& n, EvictionKind* v) {
    return ParseEnum<EvictionKind>(
        n, {{"lru", EvictionKind::kLru}, {"s3fifo", EvictionKind::kS3Fifo}, {"classes", EvictionKind::kClasses}}, v);
  });
  {
    MapReader h(ctx, r.Take("hints"), "policy.hints");
    h.Read("max_share", &p->hints.max_share, ParseRatio);
    h.Finish();
  }
  r.Read("prefix_aware", &p->prefix_aware, ParseBoolNode);
  r.Read("write_policy", &p->write_policy, [](const YAML::Node& n, WritePolicy* v) {
    return ParseEnum<WritePolicy>(
        n, {{"write_back", WritePolicy::kWriteBack}, {"write_through", WritePolicy::kWriteThrough}}, v);
  });
  // Hit counts saturate at 511 (DiskOnlyBlock::kMaxHits): more could never be met.
  r.Read("disk_promotion_min_hits", &p->disk_promotion_min_hits,
         [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 0, 511, v); });
  {
    MapReader a(ctx, r.Take("disk_admission"), "policy.disk_admission");
    a.Read("min_hits", &p->disk_admission.min_hits,
           [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 0, 511, v); });
    a.Read("reuse", &p->disk_admission.reuse, ParseBoolNode);
    a.Read("learned", &p->disk_admission.learned, ParseBoolNode);
    a.Read("write_budget_per_day", &p->disk_admission.write_budget_bytes_per_day,
           [](const YAML::Node& n, std::optional<uint64_t>* v) -> ParseResult {
             if (n.IsScalar() && n.Scalar() == "unlimited") {
               v->reset();
               return {};
             }
             uint64_t bytes = 0;
             if (auto e = ParseSizeNode(n, &bytes); !e.empty()) return e + " (or 'unlimited')";
             *v = bytes;
             return {};
           });
    a.Finish();
  }
  r.Finish();
}

// A ZMQ endpoint kvtierd binds: tcp://host:port or ipc://path.
ParseResult ParseZmqEndpoint(const YAML::Node& n, std::string* out) {
  if (auto e = ParseNonEmpty(n, out); !e.empty()) return e;
  if (out->starts_with("tcp://")) {
    std::string hostport = out->substr(6);
    return ParseListen(YAML::Node(hostport), &hostport);
  }
  if (out->starts_with("ipc://") && out->size() > 6) return {};
  return "expected tcp://host:port or ipc://path, got '" + *out + "'";
}

void ReadEvents(Context* ctx, const YAML::Node& node, Config::Events* e) {
  MapReader m(ctx, node, "events");
  m.Read("enabled", &e->enabled, ParseBoolNode);
  m.Read("endpoint", &e->endpoint, ParseZmqEndpoint);
  m.Read("replay_endpoint", &e->replay_endpoint, ParseZmqEndpoint);
  m.Read("topic", &e->topic, [](const YAML::Node& n, std::string* v) -> ParseResult {
    if (auto err = ParseNonEmpty(n, v); !err.empty()) return err;
    for (size_t at = v->find('{'); at != std::string::npos; at = v->find('{', at + 1)) {
      const size_t end = v->find('}', at);
      const std::string name = end == std::string::npos ? v->substr(at) : v->substr(at, end - at + 1);
      if (name != "{node}" && name != "{model}" && name != "{tenant}") {
        return "'" + name + "' is not one of {node}, {model}, {tenant}";
      }
    }
    return {};
  });
  m.Read("node", &e->node, ParseNonEmpty);
  m.Read("encoding", &e->encoding, [](const YAML::Node& n, EventEncoding* v) {
    return ParseEnum<EventEncoding>(n, {{"map", EventEncoding::kMap}, {"positional", EventEncoding::kPositional}}, v);
  });
  m.Read("hash", &e->hashes_as_bytes, [](const YAML::Node& n, bool* v) {
    return ParseEnum<bool>(n, {{"u64", false}, {"bytes", true}}, v);
  });
  m.Read("dp_rank", &e->dp_rank, Optional<int32_t>([](const YAML::Node& n, int32_t* v) -> ParseResult {
    uint32_t u = 0;
    if (auto err = ParseU32(n, 0, 1u << 16, &u); !err.empty()) return err;
    *v = static_cast<int32_t>(u);
    return {};
  }));
  m.Read("cadence_ms", &e->cadence_ms, [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 1, 10000, v); });
  m.Read("subscriber_grace_ms", &e->subscriber_grace_ms,
         [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 0, 60000, v); });
  m.Read("max_batch_events", &e->max_batch_events,
         [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 1, 1u << 20, v); });
  m.Read("max_queued_events", &e->max_queued_events, [](const YAML::Node& n, uint64_t* v) -> ParseResult {
    uint32_t u = 0;
    if (auto err = ParseU32(n, 1, 1u << 26, &u); !err.empty()) return err;
    *v = u;
    return {};
  });
  m.Read("buffer_batches", &e->buffer_batches, [](const YAML::Node& n, uint64_t* v) -> ParseResult {
    uint32_t u = 0;
    if (auto err = ParseU32(n, 0, 1u << 24, &u); !err.empty()) return err;
    *v = u;
    return {};
  });
  m.Read("buffer_bytes", &e->buffer_bytes, ParseSizeNode);
  m.Read("send_hwm", &e->send_hwm, [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 1, 1u << 24, v); });
  m.Read("max_metadata_bytes", &e->max_metadata_bytes, ParseSizeNode);
  m.Finish();
  if (!e->replay_endpoint.empty() && e->replay_endpoint == e->endpoint) {
    ctx->ErrorAt("events.replay_endpoint", "must differ from events.endpoint");
  }
}

void ReadAll(Context* ctx, const YAML::Node& root, Config* c) {
  MapReader r(ctx, root, "");
  {
    MapReader s(ctx, r.Take("socket"), "socket");
    s.Read("path", &c->socket.path, [](const YAML::Node& n, std::string* p) -> ParseResult {
      if (auto e = ParseNonEmpty(n, p); !e.empty()) return e;
      if (p->size() >= sizeof(sockaddr_un::sun_path)) {
        return "is " + std::to_string(p->size()) + " bytes; a unix socket path must be under " +
               std::to_string(sizeof(sockaddr_un::sun_path));
      }
      return {};
    });
    s.Read("mode", &c->socket.mode, ParseMode);
    s.Finish();
  }
  r.Read("state_dir", &c->state_dir, ParseNonEmpty);
  {
    MapReader d(ctx, r.Take("device"), "device");
    d.Read("backend", &c->device.backend, [](const YAML::Node& n, DeviceBackendKind* v) {
      return ParseEnum<DeviceBackendKind>(n, {{"auto", DeviceBackendKind::kAuto},
                                              {"host", DeviceBackendKind::kHost},
                                              {"cuda", DeviceBackendKind::kCuda}}, v);
    });
    d.Finish();
  }
  ReadTenants(ctx, r.Take("tenants"), &c->tenants);
  ReadTiers(ctx, r.Take("tiers"), &c->tiers);
  ReadPolicy(ctx, r.Take("policy"), &c->policy);
  {
    Config::Limits& l = c->limits;
    MapReader m(ctx, r.Take("limits"), "limits");
    m.Read("max_message_bytes", &l.max_message_bytes, [](const YAML::Node& n, uint64_t* v) -> ParseResult {
      if (auto e = ParseSizeNode(n, v); !e.empty()) return e;
      if (*v < 4096 || *v > (64ull << 20)) return "must be from 4KiB to 64MiB, got " + FormatSize(*v);
      return {};
    });
    m.Read("max_keys_per_request", &l.max_keys_per_request,
           [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 1, 1u << 20, v); });
    m.Read("max_sessions_per_tenant", &l.max_sessions_per_tenant,
           [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 1, 1u << 16, v); });
    m.Read("max_inflight_ops_per_session", &l.max_inflight_ops_per_session,
           [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 1, 1u << 20, v); });
    m.Read("max_namespaces_per_tenant", &l.max_namespaces_per_tenant,
           [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 1, 1u << 16, v); });
    m.Read("bulk_calls_per_second", &l.bulk_calls_per_second,
           [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 1, 100000, v); });
    m.Read("max_mappings_per_tenant", &l.max_mappings_per_tenant,
           [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 3, 1u << 20, v); });
    m.Read("max_mapped_bytes_per_tenant", &l.max_mapped_bytes_per_tenant,
           [](const YAML::Node& n, uint64_t* v) -> ParseResult {
             if (auto e = ParseSizeNode(n, v); !e.empty()) return e;
             if (*v < (1ull << 20)) return "must be at least 1MiB, got " + FormatSize(*v);
             return {};
           });
    m.Finish();
  }
  ReadEvents(ctx, r.Take("events"), &c->events);
  {
    MapReader m(ctx, r.Take("metrics"), "metrics");
    m.Read("enabled", &c->metrics.enabled, ParseBoolNode);
    m.Read("listen", &c->metrics.listen, ParseListen);
    m.Finish();
  }
  {
    MapReader m(ctx, r.Take("log"), "log");
    m.Read("level", &c->log.level, [](const YAML::Node& n, LogLevel* v) {
      return ParseEnum<LogLevel>(n, {{"trace", LogLevel::kTrace}, {"debug", LogLevel::kDebug},
                                     {"info", LogLevel::kInfo}, {"warn", LogLevel::kWarn},
                                     {"error", LogLevel::kError}, {"critical", LogLevel::kCritical},
                                     {"off", LogLevel::kOff}}, v);
    });
    m.Read("format", &c->log.format, [](const YAML::Node& n, LogFormat* v) {
      return ParseEnum<LogFormat>(n, {{"text", LogFormat::kText}, {"json", LogFormat::kJson}}, v);
    });
    m.Finish();
  }
  r.Finish();
}

// ---------------------------------------------------------------------------
// --set overrides.

bool ValidDottedKey(std::string_view key) {
  if (key.empty() || key.front() == '.' || key.back() == '.') return false;
  char prev = 0;
  for (char c : key) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '.';
    if (!ok || (c == '.' && prev == '.')) return false;
    prev = c;
  }
  return true;
}

// Applies "a.b.c=value" to `root`. Returns "" or what is wrong.
std::string ApplyOverride(YAML::Node& root, const std::string& arg, std::string* key_out) {
  const size_t eq = arg.find('=');
  if (eq == std::string::npos) return "--set " + arg + ": expected KEY=VALUE";
  const std::string key = arg.substr(0, eq);
  *key_out = key;
  if (!ValidDottedKey(key)) {
    return "--set " + arg + ": '" + key +
           "' is not a dotted key such as tiers.host.bytes (list items are set as a whole, "
           "e.g. tenants=[{name: a, uid: 1000}])";
  }
  YAML::Node value;
  try {
    value = YAML::Load(arg.substr(eq + 1));
  } catch (const YAML::Exception& e) {
    return "--set " + arg + ": " + key + ": the value is not valid YAML: " + e.msg;
  }
  if (value.IsNull()) return "--set " + arg + ": " + key + ": has no value";
  YAML::Node cur = root;
  std::string prefix;
  size_t start = 0;
  while (true) {
    const size_t dot = key.find('.', start);
    const std::string seg = key.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    prefix += prefix.empty() ? seg : "." + seg;
    if (dot == std::string::npos) {
      cur[seg] = value;
      return {};
    }
    YAML::Node next = cur[seg];
    if (!next.IsDefined() || next.IsNull()) {
      cur[seg] = YAML::Node(YAML::NodeType::Map);
      next = cur[seg];
    } else if (!next.IsMap()) {
      return "--set " + arg + ": " + prefix + " is not a map, so it has no key '" +
             key.substr(dot + 1) + "'";
    }
    cur.reset(next);
    start = dot + 1;
  }
}

}  // namespace

Result<Config> LoadConfig(const ConfigSource& source) {
  YAML::Node root;
  std::vector<std::string> errors;
  if (source.file) {
    // Open first, for an errno-based message (yaml-cpp only says "bad file").
    const int fd = ::open(source.file->c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return Err(Status::FromErrno(errno, "config file " + *source.file));
    ::close(fd);
    try {
      root = YAML::LoadFile(*source.file);
    } catch (const YAML::Exception& e) {
      return Err(InvalidArgument(*source.file + ":" + std::to_string(e.mark.line + 1) +
                                 ": not valid YAML: " + e.msg));
    }
  }
  if (!root.IsDefined() || root.IsNull()) root = YAML::Node(YAML::NodeType::Map);

  std::vector<std::pair<std::string, std::string>> overridden;
  if (root.IsMap()) {
    for (const std::string& arg : source.overrides) {
      std::string key;
      if (std::string e = ApplyOverride(root, arg, &key); !e.empty()) {
        errors.push_back(e);
      } else {
        overridden.emplace_back(key, arg);
      }
    }
  }

  Context ctx(source.file.value_or(""), std::move(overridden));
  Config config;
  ReadAll(&ctx, root, &config);
  CheckStartupRules(
      config, [&ctx](const std::string& key, const std::string& what) { ctx.ErrorAt(key, what); });
  errors.insert(errors.end(), ctx.errors().begin(), ctx.errors().end());
  if (!errors.empty()) {
    std::string message;
    for (const std::string& e : errors) message += (message.empty() ? "" : "\n") + e;
    return Err(InvalidArgument(std::move(message)));
  }
  return config;
}

std::vector<std::string> KnownConfigKeys() {
  Context ctx("", {});
  Config config;
  // One tenant so that the keys of list items are walked too.
  ReadAll(&ctx, YAML::Load("{tenants: [{name: x, uid: 0}]}"), &config);
  // Leaves only: "tiers.host" is a section, "tiers.host.bytes" a key.
  std::vector<std::string> keys;
  for (const std::string& key : ctx.known()) {
    const bool section = std::any_of(ctx.known().begin(), ctx.known().end(),
                                     [&](const std::string& k) { return k.starts_with(key + "."); });
    if (!section) keys.push_back(key);
  }
  return keys;
}

const char* LogLevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kTrace: return "trace";
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarn: return "warn";
    case LogLevel::kError: return "error";
    case LogLevel::kCritical: return "critical";
    case LogLevel::kOff: return "off";
  }
  return "?";
}

const char* DeviceBackendName(DeviceBackendKind kind) {
  switch (kind) {
    case DeviceBackendKind::kAuto: return "auto";
    case DeviceBackendKind::kHost: return "host";
    case DeviceBackendKind::kCuda: return "cuda";
  }
  return "?";
}

}  // namespace kvtier
