// LoadConfig: reads kvtierd's YAML config, applies --set overrides and
// validates everything (docs/config.md lists every key with its default),
// including what start-up would refuse from the config alone
// (config/startup_rules.h), so --check-config refuses it too.
//
// Errors name the key, where it came from (file and line, or the --set
// argument) and what is wrong; all errors found are reported, one per line.
// Unknown keys, wrong types, zero or negative sizes, inconsistent values and
// missing files (token and salt files) are errors.
// Thread-safe (no shared state; reads files and the user database).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "config/config.h"

namespace kvtier {

struct ConfigSource {
  // YAML file; unset means the built-in defaults.
  std::optional<std::string> file = std::nullopt;
  // "dotted.key=<YAML value>" overrides applied on top, in order, e.g.
  // "tiers.host.bytes=64GiB", "tiers.disk.paths=[/nvme0/kvtier,/nvme1/kvtier]".
  std::vector<std::string> overrides = {};
};

// Returns the validated config. Errors: kInvalidArgument whose message lists
// every problem as "<where>: <key>: <what>", one per line, where <where> is
// "FILE:LINE" or "--set KEY=VALUE".
Result<Config> LoadConfig(const ConfigSource& source);

// Why the config file's tokens are exposed, if they are: it writes a token
// inline (not token_file) and is readable by more than its owner. A
// warning (kvtierd --check-config and start-up print it), not an error.
std::optional<std::string> TokenExposure(const Config& config, const ConfigSource& source);

// Every key (not section) the loader knows, dotted, list items as
// "tenants[].name"; for
// checking that docs/config.md documents all of them.
std::vector<std::string> KnownConfigKeys();

// Names used in config values and logs.
const char* LogLevelName(LogLevel level);
const char* DeviceBackendName(DeviceBackendKind kind);

}  // namespace kvtier
