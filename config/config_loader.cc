// LoadConfig: the YAML file, then --set overrides, read section by section
// (config_sections.h) into a Config, then the rules across sections
// (startup_rules.h); every error found is reported, not only the first.
#include "config/config_loader.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <yaml-cpp/yaml.h>

#include "common/default_socket.h"
#include "config/config_sections.h"
#include "config/size.h"
#include "config/startup_rules.h"
#include "config/yaml_reader.h"

namespace kvtier {
namespace config_yaml {
namespace {

// The top level: socket, state_dir, device, limits, metrics and log here;
// the larger sections in files of their own.
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
    s.Read("group", &c->socket.group, Optional<uint32_t>(ParseGroupId));
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
    m.Read("store_layers_timeout_ms", &l.store_layers_timeout_ms,
           [](const YAML::Node& n, uint32_t* v) { return ParseU32(n, 10, 3600000, v); });
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
    m.Read("node_max_map_count", &l.node_max_map_count,
           [](const YAML::Node& n, uint64_t* v) { return ParseUint(n, 1, UINT32_MAX, v); });
    m.Read("node_open_files", &l.node_open_files,
           [](const YAML::Node& n, uint64_t* v) { return ParseUint(n, 1, UINT32_MAX, v); });
    m.Read("node_memory_bytes", &l.node_memory_bytes, ParseSizeNode);
    m.Read("node_guaranteed_fraction", &l.node_guaranteed_fraction, ParseRatio);
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
}  // namespace config_yaml
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
  bool file_has_tokens = false;  // before --set: the file's own
  if (root.IsMap() && root["tenants"].IsSequence()) {
    for (const YAML::Node& tenant : root["tenants"]) file_has_tokens |= tenant.IsMap() && tenant["token"].IsDefined();
  }

  std::vector<std::pair<std::string, std::string>> overridden;
  if (root.IsMap()) {
    for (const std::string& arg : source.overrides) {
      std::string key;
      if (std::string e = config_yaml::ApplyOverride(root, arg, &key); !e.empty()) {
        errors.push_back(e);
      } else {
        overridden.emplace_back(key, arg);
      }
    }
  }

  config_yaml::Context ctx(source.file.value_or(""), std::move(overridden));
  Config config;
  config.socket.path = DaemonDefaultSocket();
  config.file_has_tokens = file_has_tokens;
  config_yaml::ReadAll(&ctx, root, &config);
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

std::optional<std::string> TokenExposure(const Config& config, const ConfigSource& source) {
  if (!config.file_has_tokens || !source.file) return std::nullopt;
  struct stat st{};
  if (::stat(source.file->c_str(), &st) != 0 || (st.st_mode & 0077) == 0) return std::nullopt;
  char mode[8];
  std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
  return *source.file + " holds tenants' tokens and is mode " + mode +
         ": anyone in its group (or everyone) can read them and connect as those tenants. Give "
         "tokens with token_file (a file of one token, readable by kvtierd alone), or chmod 0600 "
         "it (docs/config.md)";
}

std::vector<std::string> KnownConfigKeys() {
  config_yaml::Context ctx("", {});
  Config config;
  // One tenant so that the keys of list items are walked too.
  config_yaml::ReadAll(&ctx, YAML::Load("{tenants: [{name: x, uid: 0}]}"), &config);
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
