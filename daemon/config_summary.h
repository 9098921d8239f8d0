// ConfigSummary: the effective configuration as indented text, printed by
// `kvtierd --check-config` and logged at start-up. Secrets (tokens, salts)
// are never printed. Thread-safe.
#pragma once

#include <string>

#include "config/config.h"

namespace kvtier {

std::string ConfigSummary(const Config& config);

}  // namespace kvtier
