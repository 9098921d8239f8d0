// Two kvtierd nodes sharing one Redis Cluster (3 masters, a replica each,
// started by the test): a prompt stored through node A is a remote hit on
// node B, byte for byte, and a load there promotes it into B's host tier;
// prefill on A, decode on B. The nodes share their tenants' secrets (the
// salts directory), as a fleet's nodes must to share blocks.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <thread>

#include "common/block_pattern.h"
#include "kvtier/client.h"
#include "tests/integration/daemon_process.h"
#include "tests/programs.h"
#include "tools/redis_cluster_process.h"

namespace kvtier::testing {
namespace {

using ::testing::HasSubstr;

constexpr uint32_t kBlockTokens = 16;

Layout RemoteLayout() {
  // 64 KiB blocks: 4 layers x (K, V) x 16 tokens x 4 heads x 64 dims x bf16.
  return Layout::Create(LayoutSpec{.model_id = "kvtier/remote-nodes", .num_layers = 4,
                                   .kv_kind = KvKind::kSeparateKv, .num_kv_heads = 4, .head_dim = 64,
                                   .dtype = DType::kBf16, .block_tokens = kBlockTokens, .tp_rank = 0,
                                   .tp_size = 1, .scale_bytes_per_layer = 0})
      .value();
}

std::vector<uint32_t> Range(uint32_t first, uint32_t n) {
  std::vector<uint32_t> v(n);
  for (uint32_t i = 0; i < n; ++i) v[i] = first + i;
  return v;
}

std::string Seeds(const RedisClusterProcess& cluster) {
  std::string list = "[";
  for (const NodeAddress& n : cluster.seeds()) list += (list.size() > 1 ? "," : "") + n.ToString();
  return list + "]";
}

struct Node {
  DaemonProcess daemon;
  std::unique_ptr<Client> client = nullptr;
  std::unique_ptr<ShmKvCache> cache = nullptr;
  CacheId id = 0;
};

// A node with the remote tier on `cluster`, no disk tier, its state in
// `state_dir` (whose salts/ may have been copied from another node).
std::unique_ptr<Node> StartNode(const RedisClusterProcess& cluster, const std::string& state_dir) {
  Result<DaemonProcess> d = DaemonProcess::Start({"state_dir=" + state_dir, "tiers.disk.enabled=false",
                                                  "tiers.host.bytes=64MiB", "tiers.remote.enabled=true",
                                                  "tiers.remote.seeds=" + Seeds(cluster),
                                                  "tiers.remote.key_prefix=test-fleet/"});
  EXPECT_TRUE(d.has_value()) << d.error();
  if (!d) return nullptr;
  auto node = std::unique_ptr<Node>(new Node{.daemon = std::move(*d)});
  Result<std::unique_ptr<Client>> c =
      Client::Connect({.socket_path = node->daemon.socket_path(), .client_name = "remote-nodes-test"});
  EXPECT_TRUE(c.has_value()) << c.error() << "\n" << node->daemon.Log();
  if (!c) return nullptr;
  node->client = std::move(*c);
  Result<ShmKvCache> cache = ShmKvCache::Create(RemoteLayout(), 256);
  EXPECT_TRUE(cache.has_value()) << cache.error();
  node->cache = std::make_unique<ShmKvCache>(std::move(*cache));
  Result<CacheId> id = node->client->RegisterKvCache(*node->cache);
  EXPECT_TRUE(id.has_value()) << id.error();
  node->id = id.value_or(0);
  return node;
}

// kvtierctl status (the real binary) against `d`.
std::string CtlStatus(const DaemonProcess& d) {
  const std::string cmd = ProgramPath("kvtierctl") + " --socket " + d.socket_path() + " status 2>&1";
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return out;
  char buf[4096];
  while (::fgets(buf, sizeof(buf), p) != nullptr) out += buf;
  ::pclose(p);
  return out;
}

uint64_t Counter(Client& c, std::string_view name) {
  Result<DaemonStats> s = c.Stats();
  return s ? s->Counter(name) : 0;
}

class RemoteNodesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<std::unique_ptr<RedisClusterProcess>> cluster = RedisClusterProcess::Start({});
    ASSERT_TRUE(cluster.has_value()) << cluster.error();
    cluster_ = std::move(*cluster);
    dir_ = std::filesystem::temp_directory_path() / ("kvtier-remote-nodes-" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_ / "a");
    a_ = StartNode(*cluster_, (dir_ / "a").string());
    ASSERT_NE(a_, nullptr);
    // Node B shares A's tenant secrets (salt and chain secret).
    std::filesystem::create_directories(dir_ / "b");
    std::filesystem::copy(dir_ / "a" / "salts", dir_ / "b" / "salts", std::filesystem::copy_options::recursive);
    b_ = StartNode(*cluster_, (dir_ / "b").string());
    ASSERT_NE(b_, nullptr);
  }
  void TearDown() override {
    a_.reset();
    b_.reset();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  // Stores `blocks` blocks of prompt `seed` through `node`, filled from their
  // keys; waits until the remote tier has them all.
  std::vector<BlockKey> StorePrompt(Node& node, uint64_t seed, uint32_t blocks) {
    Result<std::vector<BlockKey>> keys =
        node.client->ComputeKeys(node.id, PseudoTokens(seed, uint64_t{blocks} * kBlockTokens));
    EXPECT_TRUE(keys.has_value());
    for (uint32_t i = 0; i < blocks; ++i) FillFromKey((*keys)[i], node.cache->block(i));
    const uint64_t before = Counter(*node.client, "remote_writes");
    Result<OpResult> r = node.client->Store(node.id, *keys, Range(0, blocks));
    EXPECT_TRUE(r.has_value()) << r.error();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (Counter(*node.client, "remote_writes") < before + blocks && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_EQ(Counter(*node.client, "remote_writes"), before + blocks) << node.daemon.Log();
    return *keys;
  }

  std::unique_ptr<RedisClusterProcess> cluster_;
  std::filesystem::path dir_;
  std::unique_ptr<Node> a_, b_;
};

TEST_F(RemoteNodesTest, APromptStoredThroughOneNodeIsARemoteHitOnAnotherByteForByte) {
  const std::vector<BlockKey> keys = StorePrompt(*a_, 7, 24);

  // Node B computes the same keys, finds them in the remote tier only...
  Result<std::vector<BlockKey>> b_keys = b_->client->ComputeKeys(b_->id, PseudoTokens(7, 24 * kBlockTokens));
  ASSERT_TRUE(b_keys.has_value());
  ASSERT_EQ(*b_keys, keys);
  Result<LookupResult> hit = b_->client->Lookup(b_->id, keys);
  ASSERT_TRUE(hit.has_value()) << hit.error();
  EXPECT_EQ(hit->hits, 24u);
  EXPECT_THAT(hit->tiers, ::testing::Each(BlockTier::kRemote));

  // ... loads them byte for byte into its own engine blocks ...
  for (uint32_t i = 0; i < 24; ++i) std::fill(b_->cache->block(100 + i).begin(), b_->cache->block(100 + i).end(), 0);
  Result<OpResult> loaded = b_->client->Load(b_->id, keys, Range(100, 24));
  ASSERT_TRUE(loaded.has_value()) << loaded.error();
  ASSERT_EQ(loaded->blocks, 24u) << b_->daemon.Log();
  for (uint32_t i = 0; i < 24; ++i) EXPECT_TRUE(MatchesKey(keys[i], b_->cache->block(100 + i))) << i;

  // ... and holds them in its host tier from then on.
  hit = b_->client->Lookup(b_->id, keys);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->hits, 24u);
  EXPECT_THAT(hit->tiers, ::testing::Each(BlockTier::kHost));
  EXPECT_EQ(Counter(*b_->client, "remote_promotions"), 24u);
  EXPECT_EQ(Counter(*b_->client, "remote_hits"), 24u);
  EXPECT_EQ(Counter(*b_->client, "remote_corrupt"), 0u);
  // kvtierctl status shows the remote tier.
  const std::string status = CtlStatus(b_->daemon);
  EXPECT_THAT(status, HasSubstr("remote    breaker closed; 24 hit(s)")) << status;
  EXPECT_THAT(status, HasSubstr("24 promoted")) << status;

  // A prompt sharing a prefix: local hits first, then the remote tail.
  const std::vector<BlockKey> more = StorePrompt(*a_, 8, 6);
  std::vector<BlockKey> mixed(keys.begin(), keys.begin() + 4);
  mixed.insert(mixed.end(), more.begin(), more.end());
  hit = b_->client->Lookup(b_->id, mixed);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->hits, 10u);
  EXPECT_EQ(hit->tiers[3], BlockTier::kHost);
  EXPECT_EQ(hit->tiers[4], BlockTier::kRemote);
}

TEST_F(RemoteNodesTest, APrefetchFetchesRemoteBlocksIntoHostAhead) {
  const std::vector<BlockKey> keys = StorePrompt(*a_, 11, 12);
  Result<uint32_t> present = b_->client->Prefetch(b_->id, keys);
  ASSERT_TRUE(present.has_value()) << present.error();
  EXPECT_EQ(*present, 12u);
  Result<LookupResult> hit = b_->client->Lookup(b_->id, keys);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->hits, 12u);
  EXPECT_THAT(hit->tiers, ::testing::Each(BlockTier::kHost)) << "fetched by the prefetch";
  Result<OpResult> loaded = b_->client->Load(b_->id, keys, Range(0, 12));
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->blocks, 12u);
  for (uint32_t i = 0; i < 12; ++i) EXPECT_TRUE(MatchesKey(keys[i], b_->cache->block(i))) << i;
}

TEST_F(RemoteNodesTest, PrefillOnOneNodeDecodeOnAnother) {
  // Disaggregated serving: the prefill node stores the prompt's KV; the
  // decode node loads it all and computes no prefill.
  const std::vector<BlockKey> keys = StorePrompt(*a_, 42, 40);
  Result<std::vector<BlockKey>> decode_keys =
      b_->client->ComputeKeys(b_->id, PseudoTokens(42, 40 * kBlockTokens));
  ASSERT_TRUE(decode_keys.has_value());
  Result<OpResult> loaded = b_->client->Load(b_->id, *decode_keys, Range(0, 40));
  ASSERT_TRUE(loaded.has_value()) << loaded.error();
  EXPECT_EQ(loaded->blocks, 40u);
  for (uint32_t i = 0; i < 40; ++i) EXPECT_TRUE(MatchesKey(keys[i], b_->cache->block(i))) << i;
}

TEST_F(RemoteNodesTest, WithTheClusterDownANodeServesItsLocalTiersAndMissesTheRest) {
  const std::vector<BlockKey> keys = StorePrompt(*a_, 9, 8);
  for (size_t i = 0; i < cluster_->size(); ++i) cluster_->Kill(i);
  // Node A still serves what it holds, at once.
  Result<LookupResult> local = a_->client->Lookup(a_->id, keys);
  ASSERT_TRUE(local.has_value());
  EXPECT_EQ(local->hits, 8u);
  // Node B: misses, never an error, and quick once the breaker is open.
  for (int i = 0; i < 5; ++i) {
    const auto start = std::chrono::steady_clock::now();
    Result<LookupResult> miss = b_->client->Lookup(b_->id, keys);
    ASSERT_TRUE(miss.has_value()) << miss.error();
    EXPECT_EQ(miss->hits, 0u);
    if (i >= 4) {
      EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(200));
    }
    Result<OpResult> none = b_->client->Load(b_->id, keys, Range(0, 8));
    ASSERT_TRUE(none.has_value()) << none.error();
    EXPECT_EQ(none->blocks, 0u);
  }
  EXPECT_EQ(Counter(*b_->client, "remote_breaker_open"), 1u);
}

}  // namespace
}  // namespace kvtier::testing
