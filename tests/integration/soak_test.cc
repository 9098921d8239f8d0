// Soak and chaos: many real client processes of several tenants, for a
// bounded time, doing what engines of two models do (compute keys, look up,
// load the hits and check every byte, store the rest, prefetch), with every
// tier under pressure.
//
//   Soak: 32 clients for 60 s (KVTIER_SOAK_SECONDS overrides). No byte is
//   ever wrong, the daemon's RSS stays flat after warm-up, and leases are
//   back to 0 at the end.
//   Chaos: a shorter soak during which kvtierd is SIGKILLed and restarted and
//   clients are SIGKILLed and replaced at random. Clients reconnect by
//   themselves; nothing corrupt is ever served; blocks flushed to disk before
//   each kill are hits after the restart (the disk tier comes back warm).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/block_pattern.h"
#include "kvtier/client.h"
#include "kvtier/shm_kv_cache.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/stats_when.h"

namespace kvtier::testing {
namespace {

constexpr uint32_t kTenants = 3;
constexpr uint32_t kBlockTokens = 16;

std::string Token(uint32_t tenant) { return "soak-token-tenant-" + std::to_string(tenant); }

// Two models on one node: tenants 0 and 1 run one with 16 KiB blocks, tenant
// 2 another with 24 KiB blocks, so the two sizes contend for every tier.
Layout SoakLayout(uint32_t tenant) {
  const bool other = tenant == 2;
  return Layout::Create(LayoutSpec{.model_id = other ? "kvtier/soak-b" : "kvtier/soak",
                                   .num_layers = other ? 3u : 2u,
                                   .kv_kind = KvKind::kSeparateKv,
                                   .num_kv_heads = 2,
                                   .head_dim = 64,
                                   .dtype = DType::kBf16,
                                   .block_tokens = kBlockTokens})
      .value();
}

std::vector<std::string> SoakSets() {
  std::string tenants = "tenants=[";
  for (uint32_t t = 0; t < kTenants; ++t) {
    tenants += (t ? ", " : "") + std::string("{name: t") + std::to_string(t) + ", token: " + Token(t) +
               (t == 0 ? ", admin: true" : "") + "}";
  }
  tenants += "]";
  // 16 and 24 KiB blocks: hbm holds about 100, host 300, disk 700 (16
  // regions of 1 MiB); the clients' prompts need far more, so every tier
  // evicts, demotes and promotes all the time, the disk wraps many times
  // over, and the sizes take extents from each other.
  return {"tiers.hbm.enabled=true",
          "tiers.hbm.bytes=2MiB",
          "tiers.host.bytes=6MiB",
          "tiers.disk.enabled=true",
          "tiers.disk.bytes=16MiB",
          "tiers.disk.region_bytes=1MiB",
          "limits.max_sessions_per_tenant=64",
          tenants};
}

// What one client process did; written to a file the parent reads.
struct ClientReport {
  uint64_t ops = 0;
  uint64_t loaded = 0;
  uint64_t mismatches = 0;
  uint64_t unavailable = 0;  // calls that found the daemon gone (chaos)
};

// One engine: prompts drawn from a per-tenant pool of shared prefixes, so
// clients of a tenant hit each other's blocks. Runs until `until`.
int RunClient(const std::string& socket, uint32_t id, std::chrono::steady_clock::time_point until,
              const std::string& report_path) {
  const uint32_t tenant = id % kTenants;
  ClientReport report;
  auto write_report = [&] {
    std::ofstream(report_path) << report.ops << " " << report.loaded << " " << report.mismatches << " "
                               << report.unavailable << "\n";
  };
  std::unique_ptr<Client> client;
  while (!client && std::chrono::steady_clock::now() < until) {
    Result<std::unique_ptr<Client>> c =
        Client::Connect({.socket_path = socket, .token = Token(tenant), .client_name = "soak-" + std::to_string(id),
                         .reconnect_interval = std::chrono::milliseconds(50)});
    if (c) client = std::move(*c);
    else std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (!client) return 3;
  Result<ShmKvCache> cache = ShmKvCache::Create(SoakLayout(tenant), 64);
  if (!cache) return 4;
  std::optional<CacheId> cache_id;
  std::mt19937_64 rng(1000 + id);
  while (std::chrono::steady_clock::now() < until) {
    if (!cache_id) {
      Result<CacheId> r = client->RegisterKvCache(*cache);
      if (!r) {
        ++report.unavailable;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        continue;
      }
      cache_id = *r;
    }
    // A prompt: one of 40 shared prefixes of the tenant, 2-12 blocks, and a
    // private tail of 0-4 blocks.
    const uint64_t prefix = rng() % 40;
    const uint32_t shared = 2 + static_cast<uint32_t>(rng() % 11);
    const uint32_t tail = static_cast<uint32_t>(rng() % 5);
    std::vector<uint32_t> tokens = PseudoTokens(tenant * 100000 + prefix, shared * kBlockTokens);
    const std::vector<uint32_t> more = PseudoTokens(rng(), tail * kBlockTokens);
    tokens.insert(tokens.end(), more.begin(), more.end());
    Result<std::vector<BlockKey>> keys = client->ComputeKeys(*cache_id, tokens);
    if (!keys) return 5;
    ++report.ops;
    Result<LookupResult> hit = client->Lookup(*cache_id, *keys);
    if (!hit) {
      ++report.unavailable;
      continue;
    }
    const uint32_t n = static_cast<uint32_t>(keys->size());
    std::vector<uint32_t> ids(n);
    for (uint32_t i = 0; i < n; ++i) ids[i] = i;
    if (hit->hits > 0) {
      for (uint32_t i = 0; i < hit->hits; ++i) std::memset(cache->block(i).data(), 0, cache->block(i).size());
      Result<OpResult> loaded = client->Load(*cache_id, std::span(*keys).first(hit->hits),
                                             std::span(ids).first(hit->hits));
      if (loaded) {
        report.loaded += loaded->blocks;
        for (uint32_t i = 0; i < loaded->blocks; ++i) report.mismatches += !MatchesKey((*keys)[i], cache->block(i));
      } else {
        ++report.unavailable;
      }
    }
    if (rng() % 8 == 0) (void)client->Prefetch(*cache_id, *keys);
    const uint32_t from = hit->hits;
    if (from < n) {
      for (uint32_t i = from; i < n; ++i) FillFromKey((*keys)[i], cache->block(i));
      Result<OpResult> stored = client->Store(*cache_id, std::span(*keys).subspan(from), std::span(ids).subspan(from));
      if (!stored && stored.error().code() == StatusCode::kUnavailable) ++report.unavailable;
    }
    if (report.ops % 50 == 0) write_report();
  }
  write_report();
  return report.mismatches == 0 ? 0 : 10;
}

ClientReport ReadReport(const std::string& path) {
  ClientReport r;
  std::ifstream in(path);
  in >> r.ops >> r.loaded >> r.mismatches >> r.unavailable;
  return r;
}

uint64_t RssKiB(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6));
  }
  return 0;
}

uint32_t SoakSeconds() {
  const char* s = std::getenv("KVTIER_SOAK_SECONDS");
  return s != nullptr ? static_cast<uint32_t>(std::atoi(s)) : 60;
}

TEST(SoakTest, ThirtyTwoClientsOfThreeTenantsForAMinute) {
  Result<DaemonProcess> d = DaemonProcess::Start(SoakSets());
  ASSERT_TRUE(d.has_value()) << d.error();
  const uint32_t seconds = SoakSeconds();
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  constexpr uint32_t kClients = 32;
  std::vector<pid_t> pids;
  for (uint32_t i = 0; i < kClients; ++i) {
    const std::string report = d->dir() + "/client-" + std::to_string(i);
    pids.push_back(ForkChild([&, i, report] { return RunClient(d->socket_path(), i, until, report); }));
  }
  // RSS after warm-up (a third of the run) against the end: flat means no
  // growth beyond the index churn's noise.
  std::this_thread::sleep_until(std::chrono::steady_clock::now() + std::chrono::seconds(seconds / 3));
  const uint64_t warm = RssKiB(d->pid());
  uint64_t peak = warm;
  while (std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::seconds(1));
    peak = std::max(peak, RssKiB(d->pid()));
  }
  ClientReport total;
  for (uint32_t i = 0; i < kClients; ++i) {
    EXPECT_EQ(WaitChild(pids[i]), 0) << "client " << i << " saw wrong bytes or failed\n" << d->Log();
    const ClientReport r = ReadReport(d->dir() + "/client-" + std::to_string(i));
    total.ops += r.ops;
    total.loaded += r.loaded;
    total.mismatches += r.mismatches;
  }
  std::printf("soak: %u clients, %u s: %lu prompts, %lu blocks loaded, %lu mismatches; RSS %lu KiB after "
              "warm-up, peak %lu KiB\n",
              kClients, seconds, total.ops, total.loaded, total.mismatches, warm, peak);
  EXPECT_EQ(total.mismatches, 0u);
  EXPECT_GT(total.loaded, 0u);
  EXPECT_LE(peak, warm + warm / 10 + 16 * 1024) << "daemon RSS grew after warm-up";

  Result<std::unique_ptr<Client>> admin = Client::Connect({.socket_path = d->socket_path(), .token = Token(0)});
  ASSERT_TRUE(admin.has_value()) << admin.error();
  const DaemonStats end = StatsWhen(**admin, [](const DaemonStats& s) { return s.leases == 0 && s.mappings == 0; });
  EXPECT_EQ(end.leases, 0u);
  EXPECT_EQ(end.mappings, 0u);
  EXPECT_EQ(end.inflight_ops, 0u);
  EXPECT_EQ(end.Counter("disk_checksum_failures"), 0u);
  EXPECT_GT(end.Counter("disk_demotions"), 0u) << "the disk tier was under pressure too";
  EXPECT_GE(end.Counter("disk_regions_reclaimed"), 10u * 16)
      << "the disk wrapped fewer than ten times";
  EXPECT_EQ(end.Counter("disk_reclaim_failures"), 0u);
  EXPECT_EQ(end.Counter("disk_write_failures"), 0u);
  std::printf("soak: disk wrapped %.1f times (%lu regions reclaimed, %lu blocks carried forward)\n",
              static_cast<double>(end.Counter("disk_regions_reclaimed")) / 16,
              end.Counter("disk_regions_reclaimed"), end.Counter("disk_reinsertions"));
  EXPECT_GT(end.Counter("demotions"), 0u);
  EXPECT_GT(end.Counter("extents_reclaimed"), 0u)
      << "the two block sizes took room from each other";
}

// Blocks in the disk tier now, as the daemon counts them (admin session),
// and the regions it reclaimed since it started.
struct DiskNow {
  uint64_t blocks = 0;
  uint64_t regions_reclaimed = 0;
};
DiskNow DiskState(const std::string& socket) {
  Result<std::unique_ptr<Client>> c = Client::Connect({.socket_path = socket, .token = Token(0)});
  if (!c) return {};
  Result<DaemonStats> s = (*c)->Stats();
  if (!s) return {};
  DiskNow now{.blocks = 0, .regions_reclaimed = s->Counter("disk_regions_reclaimed")};
  for (const TierStats& t : s->tiers) {
    if (t.tier == BlockTier::kDisk) now.blocks = t.blocks;
  }
  return now;
}

TEST(ChaosTest, KillsOfTheDaemonAndOfClientsNeverServeWrongBytes) {
  Result<DaemonProcess> d = DaemonProcess::Start(SoakSets());
  ASSERT_TRUE(d.has_value()) << d.error();
  const uint32_t seconds = std::max(20u, SoakSeconds() / 2);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  constexpr uint32_t kClients = 8;
  std::mt19937 rng(42);
  std::vector<pid_t> pids(kClients);
  uint32_t next_id = 0;
  auto start_client = [&](uint32_t slot) {
    const uint32_t id = next_id++;
    const std::string report = d->dir() + "/client-" + std::to_string(id);
    pids[slot] = ForkChild([&, id, report] { return RunClient(d->socket_path(), id, until, report); });
  };
  for (uint32_t i = 0; i < kClients; ++i) start_client(i);
  uint32_t daemon_kills = 0;
  uint32_t client_kills = 0;
  uint32_t warm_checks = 0;
  uint64_t disk_blocks_after_restarts = 0;
  uint64_t regions_reclaimed = 0;  // summed over the daemon's lives
  while (std::chrono::steady_clock::now() + std::chrono::seconds(3) < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(500 + rng() % 1500));
    if (rng() % 2 == 0) {
      const DiskNow now = DiskState(d->socket_path());
      const uint64_t before = now.blocks;
      regions_reclaimed += now.regions_reclaimed;
      d->Kill();
      ++daemon_kills;
      ASSERT_TRUE(d->Restart().ok()) << d->Log();
      // The disk tier is warm: what was durable on disk before the kill is
      // indexed again (only writes in flight at the kill may be missing).
      const uint64_t after = DiskState(d->socket_path()).blocks;
      EXPECT_GE(after + 256, before) << "disk tier cold after restart " << daemon_kills;
      if (before > 0) {
        EXPECT_GT(after, 0u) << "disk tier cold after restart " << daemon_kills;
      }
      ++warm_checks;
      disk_blocks_after_restarts += after;
    } else {
      const uint32_t slot = rng() % kClients;
      ::kill(pids[slot], SIGKILL);
      EXPECT_EQ(WaitChild(pids[slot]), 128 + SIGKILL);
      ++client_kills;
      start_client(slot);
    }
  }
  regions_reclaimed += DiskState(d->socket_path()).regions_reclaimed;
  uint64_t loaded = 0;
  uint64_t unavailable = 0;
  for (uint32_t i = 0; i < kClients; ++i) {
    const int rc = WaitChild(pids[i]);
    EXPECT_NE(rc, 10) << "a client saw wrong bytes\n" << d->Log();
  }
  for (uint32_t id = 0; id < next_id; ++id) {
    const ClientReport r = ReadReport(d->dir() + "/client-" + std::to_string(id));
    EXPECT_EQ(r.mismatches, 0u) << "client " << id;
    loaded += r.loaded;
    unavailable += r.unavailable;
  }
  std::printf("chaos: %u s, %u daemon kills (%u warm restarts checked, %lu disk blocks indexed after them), "
              "%u client kills, %lu blocks loaded, %lu calls found the daemon gone\n",
              seconds, daemon_kills, warm_checks, disk_blocks_after_restarts, client_kills, loaded, unavailable);
  EXPECT_GE(daemon_kills + client_kills, 3u);
  EXPECT_GT(disk_blocks_after_restarts, 0u) << "no restart found anything on disk";
  std::printf("chaos: %lu disk regions reclaimed (the disk wrapped %.1f times)\n",
              regions_reclaimed, static_cast<double>(regions_reclaimed) / 16);
  EXPECT_GE(regions_reclaimed, 16u * 3) << "the disk wrapped fewer than three times";
  EXPECT_GT(loaded, 0u);
}

}  // namespace
}  // namespace kvtier::testing
