// kvtier-bench abuse: one tenant's prompt lookups (128 keys) while another
// calls ListNamespaces or Evict as fast as it can, next to the same lookups
// with nobody else calling (the baseline, from the same run). A call that
// walked the whole cache on the event loop shows here as the victim's p99.
// With --sessions N: one tenant's loads beside another's N sessions of
// stores and loads (a process of its own, as an engine is), next to the
// same beside its one session.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace kvtier::bench {

struct AbuseOptions {
  uint32_t blocks = 100000;  // 4 KiB blocks the victim stores first
  uint32_t seconds = 3;      // per phase
  uint32_t reps = 3;         // each phase; medians reported
  // > 0: the sessions mode instead. Tenant B loads 16 blocks of 256 KiB in
  // a loop on one session while tenant A stores and loads the same way on
  // this many sessions, next to A on one session (the baseline, from the
  // same run): a daemon that shared its loop and copy threads by session,
  // not tenant, shows here as B's p99.
  uint32_t sessions = 0;
  std::string json;
};

// Starts a kvtierd with `tiers.host.bytes` and --set overrides; returns its
// socket (the caller stops it).
using StartAbuseDaemonFn = std::function<std::string(uint64_t host_bytes, std::vector<std::string> sets)>;

// Returns the process exit code: 0, or 1 after printing what failed.
int Abuse(const AbuseOptions& options, const StartAbuseDaemonFn& start_daemon);

}  // namespace kvtier::bench
