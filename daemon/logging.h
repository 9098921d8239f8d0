// kvtierd's logging: spdlog to stderr, as text or one JSON object per line.
// Call SetupLogging once at start-up, before other threads log; SetLogLevel
// is thread-safe (SIGHUP reload).
#pragma once

#include "config/config.h"

namespace kvtier {

void SetupLogging(LogFormat format, LogLevel level);
void SetLogLevel(LogLevel level);

}  // namespace kvtier
