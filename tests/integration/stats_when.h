// StatsWhen: polls a daemon's Stats until a condition holds, for tests that
// wait for the daemon to notice something (a dead client, a finished move).
//
// Test-only; thread-compatible.
#pragma once

#include <chrono>
#include <thread>

#include "kvtier/client.h"

namespace kvtier::testing {

// Polls every 10 ms until `pred(stats)` holds or `timeout` passes; returns
// the last stats read (the caller asserts on them).
template <typename Pred>
DaemonStats StatsWhen(Client& c, Pred pred, std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  DaemonStats s;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  do {
    if (Result<DaemonStats> r = c.Stats(); r) {
      s = *r;
      if (pred(s)) return s;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  } while (std::chrono::steady_clock::now() < deadline);
  return s;
}

}  // namespace kvtier::testing
