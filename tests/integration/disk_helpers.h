// Helpers for the disk tier's end-to-end tests: a kvtierd configured with a
// small host tier spilling to a disk tier, and a client session over a
// shared-memory KV cache. For tests only.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/block_pattern.h"
#include "kvtier/client.h"
#include "tests/integration/daemon_process.h"

namespace kvtier::testing {

inline constexpr uint32_t kBlockTokens = 16;

inline Layout SmallLayout() {
  // 16 KiB blocks.
  return Layout::Create(LayoutSpec{.model_id = "kvtier/disk-it", .num_layers = 2,
                                   .kv_kind = KvKind::kSeparateKv, .num_kv_heads = 2, .head_dim = 64,
                                   .dtype = DType::kBf16, .block_tokens = kBlockTokens, .tp_rank = 0,
                                   .tp_size = 1, .scale_bytes_per_layer = 0})
      .value();
}

inline std::vector<uint32_t> Prompt(uint64_t seed, uint32_t blocks) {
  return PseudoTokens(seed, blocks * kBlockTokens);
}

inline std::vector<std::string> DiskSets(const std::string& engine, const std::string& extra_host = "2MiB") {
  return {"tiers.disk.enabled=true",
          "tiers.disk.bytes=64MiB",
          "tiers.disk.region_bytes=1MiB",
          "tiers.disk.io_engine=" + engine,
          "tiers.host.bytes=" + extra_host,
          "policy.watermarks.host={high: 0.8, low: 0.5}",
          "tenants=[{name: local, uid: " + std::to_string(::getuid()) + ", admin: true}]"};
}

struct DiskSession {
  std::unique_ptr<Client> client;
  std::unique_ptr<ShmKvCache> cache;
  CacheId id = 0;
};

inline DiskSession Open(const DaemonProcess& d) {
  DiskSession s;
  Result<std::unique_ptr<Client>> c =
      Client::Connect({.socket_path = d.socket_path(), .client_name = "disk-it",
                       .reconnect_interval = std::chrono::milliseconds(20)});
  EXPECT_TRUE(c.has_value()) << c.error() << "\n" << d.Log();
  if (!c) return s;
  s.client = std::move(*c);
  s.cache = std::make_unique<ShmKvCache>(ShmKvCache::Create(SmallLayout(), 256).value());
  s.id = s.client->RegisterKvCache(*s.cache).value();
  return s;
}

// Stores `keys` one block per key; returns the keys the daemon acknowledged.
inline std::vector<BlockKey> StoreAck(DiskSession& s, const std::vector<BlockKey>& keys) {
  std::vector<BlockKey> acked;
  for (size_t i = 0; i < keys.size(); i += 16) {
    const size_t n = std::min<size_t>(16, keys.size() - i);
    std::vector<uint32_t> ids(n);
    for (size_t j = 0; j < n; ++j) {
      ids[j] = static_cast<uint32_t>(j);
      FillFromKey(keys[i + j], s.cache->block(ids[j]));
    }
    Result<OpResult> r = s.client->Store(s.id, std::span(keys).subspan(i, n), ids);
    if (r && r->blocks + r->already == n) acked.insert(acked.end(), keys.begin() + i, keys.begin() + i + n);
  }
  return acked;
}

// Loads `key` alone; 1 = hit with exact bytes, 0 = miss, -1 = wrong bytes.
inline int LoadOne(DiskSession& s, const BlockKey& key) {
  auto b = s.cache->block(200);
  std::fill(b.begin(), b.end(), 0);
  Result<OpResult> r = s.client->Load(s.id, std::span(&key, 1), std::vector<uint32_t>{200});
  if (!r || r->blocks == 0) return 0;
  return MatchesKey(key, b) ? 1 : -1;
}

// Flushes until no key is in the host tier only (each is in hbm or on disk):
// then nothing of `keys` can be lost to a host eviction.
inline bool SettleOutOfHost(DiskSession& s, const std::vector<BlockKey>& keys) {
  for (int i = 0; i < 1000; ++i) {
    if (!s.client->Flush()) return false;
    bool settled = true;
    for (const BlockKey& k : keys) {
      Result<LookupResult> l = s.client->Lookup(s.id, std::span(&k, 1));
      if (!l || l->hits != 1 || l->tiers[0] == BlockTier::kHost) {
        settled = false;
        break;
      }
    }
    if (settled) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

// Waits until every key reports the disk tier (after a flush).
inline bool WaitOnDisk(DiskSession& s, const std::vector<BlockKey>& keys) {
  for (int i = 0; i < 1000; ++i) {
    bool all = true;
    for (const BlockKey& k : keys) {
      Result<LookupResult> l = s.client->Lookup(s.id, std::span(&k, 1));
      if (!l || l->hits != 1 || l->tiers[0] != BlockTier::kDisk) {
        all = false;
        break;
      }
    }
    if (all) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

}  // namespace kvtier::testing
