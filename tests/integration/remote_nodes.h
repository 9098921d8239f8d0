// Helpers for the tests that run kvtierd nodes on a Redis Cluster the test
// starts (remote_nodes_test, remote_faults_test): a node is a real daemon
// with the remote tier, a client and an engine KV cache of its own.
//
// For tests only; thread-compatible (a thread of traffic connects its own
// Client).
#pragma once

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/block_pattern.h"
#include "kvtier/client.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/stats_when.h"
#include "tests/programs.h"
#include "tools/redis_cluster_process.h"

namespace kvtier::testing {

inline constexpr uint32_t kRemoteBlockTokens = 16;
inline constexpr uint32_t kRemoteEngineBlocks = 256;

inline Layout RemoteLayout() {
  // 64 KiB blocks: 4 layers x (K, V) x 16 tokens x 4 heads x 64 dims x bf16.
  return Layout::Create(LayoutSpec{.model_id = "kvtier/remote-nodes", .num_layers = 4,
                                   .kv_kind = KvKind::kSeparateKv, .num_kv_heads = 4, .head_dim = 64,
                                   .dtype = DType::kBf16, .block_tokens = kRemoteBlockTokens, .tp_rank = 0,
                                   .tp_size = 1, .scale_bytes_per_layer = 0})
      .value();
}

inline std::vector<uint32_t> Range(uint32_t first, uint32_t n) {
  std::vector<uint32_t> v(n);
  for (uint32_t i = 0; i < n; ++i) v[i] = first + i;
  return v;
}

// The YAML list of `nodes` ("[host:port,...]"), for tiers.remote.seeds.
inline std::string SeedList(const std::vector<NodeAddress>& nodes) {
  std::string list = "[";
  for (const NodeAddress& n : nodes) list += (list.size() > 1 ? "," : "") + n.ToString();
  return list + "]";
}

// A client of a node, with its own engine KV cache registered.
struct Engine {
  std::unique_ptr<Client> client;
  std::unique_ptr<ShmKvCache> cache;
  CacheId id = 0;

  // Connects to the daemon on `socket_path` and registers a cache.
  Status Connect(const std::string& socket_path) {
    KVTIER_ASSIGN_OR_RETURN(client, Client::Connect({.socket_path = socket_path, .client_name = "remote-nodes-test"}));
    KVTIER_ASSIGN_OR_RETURN(ShmKvCache c, ShmKvCache::Create(RemoteLayout(), kRemoteEngineBlocks));
    cache = std::make_unique<ShmKvCache>(std::move(c));
    KVTIER_ASSIGN_OR_RETURN(id, client->RegisterKvCache(*cache));
    return Status::Ok();
  }

  uint64_t Counter(std::string_view name) const {
    Result<DaemonStats> s = client->Stats();
    return s ? s->Counter(name) : 0;
  }

  // Polls counter `name` until it reaches `at_least` or 20 s pass; returns
  // its last value (the caller asserts on it). For what the daemon finishes
  // after the call that started it returned: a put, a disk write.
  uint64_t CounterWhen(std::string_view name, uint64_t at_least) const {
    return StatsWhen(
               *client, [&](const DaemonStats& s) { return s.Counter(name) >= at_least; },
               std::chrono::seconds(20))
        .Counter(name);
  }

  Result<std::vector<BlockKey>> Keys(uint64_t seed, uint32_t blocks) const {
    return client->ComputeKeys(id, PseudoTokens(seed, uint64_t{blocks} * kRemoteBlockTokens));
  }

  // Stores prompt `seed`'s first `blocks` blocks (at most kRemoteEngineBlocks),
  // filled from their keys, from engine blocks 0...
  Result<std::vector<BlockKey>> Store(uint64_t seed, uint32_t blocks) {
    KVTIER_ASSIGN_OR_RETURN(std::vector<BlockKey> keys, Keys(seed, blocks));
    for (uint32_t i = 0; i < blocks; ++i) FillFromKey(keys[i], cache->block(i));
    KVTIER_ASSIGN_OR_RETURN(OpResult r, client->Store(id, keys, Range(0, blocks)));
    (void)r;
    return keys;
  }

  // Loads `keys` into engine blocks `first`... (zeroed first); returns the
  // blocks loaded, and counts those whose bytes are not their key's in
  // `wrong` (never expected).
  Result<uint32_t> Load(const std::vector<BlockKey>& keys, uint32_t first, uint32_t* wrong) {
    for (uint32_t i = 0; i < keys.size(); ++i) {
      std::fill(cache->block(first + i).begin(), cache->block(first + i).end(), 0);
    }
    KVTIER_ASSIGN_OR_RETURN(OpResult r, client->Load(id, keys, Range(first, static_cast<uint32_t>(keys.size()))));
    for (uint32_t i = 0; i < r.blocks; ++i) {
      if (!MatchesKey(keys[i], cache->block(first + i))) ++*wrong;
    }
    return r.blocks;
  }
};

// A kvtierd node with the remote tier on `seeds`, no disk tier, its state in
// `state_dir` (whose salts/ may have been copied from another node), and
// `more` --set overrides; in network namespace `netns` (its file) if set.
struct Node : Engine {
  DaemonProcess daemon;

  explicit Node(DaemonProcess d) : daemon(std::move(d)) {}

  static std::unique_ptr<Node> Start(const std::vector<NodeAddress>& seeds, const std::string& state_dir,
                                     std::vector<std::string> more = {}, std::string netns = "") {
    std::vector<std::string> overrides = {"state_dir=" + state_dir,           "tiers.disk.enabled=false",
                                          "tiers.host.bytes=64MiB",           "tiers.remote.enabled=true",
                                          "tiers.remote.seeds=" + SeedList(seeds),
                                          "tiers.remote.key_prefix=test-fleet/"};
    overrides.insert(overrides.end(), more.begin(), more.end());
    Result<DaemonProcess> d = DaemonProcess::Start(overrides, "", std::move(netns));
    EXPECT_TRUE(d.has_value()) << d.error();
    if (!d) return nullptr;
    auto node = std::make_unique<Node>(std::move(*d));
    Status connected = node->Connect(node->daemon.socket_path());
    EXPECT_TRUE(connected.ok()) << connected << "\n" << node->daemon.Log();
    if (!connected.ok()) return nullptr;
    return node;
  }

  // Stores prompt `seed` and waits until the remote tier has all its blocks.
  std::vector<BlockKey> StoreShared(uint64_t seed, uint32_t blocks) {
    const uint64_t before = Counter("remote_writes");
    Result<std::vector<BlockKey>> keys = Store(seed, blocks);
    EXPECT_TRUE(keys.has_value()) << keys.error();
    EXPECT_EQ(CounterWhen("remote_writes", before + blocks), before + blocks) << daemon.Log();
    return keys.value_or(std::vector<BlockKey>{});
  }
};

// kvtierctl status (the real binary) against `d`.
inline std::string CtlStatus(const DaemonProcess& d) {
  const std::string cmd = ProgramPath("kvtierctl") + " --socket " + d.socket_path() + " status 2>&1";
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return out;
  char buf[4096];
  while (::fgets(buf, sizeof(buf), p) != nullptr) out += buf;
  ::pclose(p);
  return out;
}

}  // namespace kvtier::testing
