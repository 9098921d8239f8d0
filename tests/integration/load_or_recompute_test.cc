// Load or recompute (docs/policy.md): a lookup or prefetch that gives the
// engine's prefill rate gets only the hits kvtierd expects to load faster
// than the engine computes them, from its own timings of each tier. Two real
// kvtierd nodes share a standalone Redis; node B reaches it through a link
// that is slow (a proxy that paces replies) and then fast again: B's remote
// hits are left to compute while the link is slow, its host hits still
// loaded, and its remote hits are loaded again once the link is fast.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include "tests/integration/remote_nodes.h"
#include "tests/tiers/remote/slow_proxy.h"

namespace kvtier::testing {
namespace {

// What the engine says it computes: a block of 16 tokens in 4 ms. Through
// the slow link a 64 KiB block takes about 15 ms to fetch (the remote
// tier's bound, 1 s a batch, leaves room for 24 of them); from host, well
// under a millisecond even under sanitizers; through the fast link, about
// one under TSan.
constexpr double kPrefillTokensPerSecond = 4000;
constexpr uint32_t kShared = 32;  // blocks of each prompt node A stores (all in Redis)
constexpr uint32_t kLocal = 8;    // of them, the first ones node B holds itself

class LoadOrRecomputeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<std::unique_ptr<RedisClusterProcess>> redis = RedisClusterProcess::Start({.standalone = true});
    ASSERT_TRUE(redis.has_value()) << redis.error();
    redis_ = std::move(*redis);
    // 4 KiB a millisecond at most: about 4 MB/s, as a congested or distant
    // link (the proxy reads up to 64 KiB at a time and paces each read).
    proxy_ = std::make_unique<SlowProxy>(redis_->node(0), 4 << 10, std::chrono::milliseconds(1));
    dir_ = std::filesystem::temp_directory_path() / ("kvtier-load-or-recompute-" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_ / "a");
    a_ = Node::Start(redis_->seeds(), (dir_ / "a").string());
    ASSERT_NE(a_, nullptr);
    std::filesystem::create_directories(dir_ / "b");
    std::filesystem::copy(dir_ / "a" / "salts", dir_ / "b" / "salts", std::filesystem::copy_options::recursive);
    b_ = Node::Start({proxy_->address()}, (dir_ / "b").string());
    ASSERT_NE(b_, nullptr);
  }
  void TearDown() override {
    a_.reset();
    b_.reset();
    proxy_.reset();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  // Prompt `seed`: all of it stored through A (so in Redis), its first
  // kLocal blocks also through B (so in B's host tier). Its keys.
  std::vector<BlockKey> Prompt(uint64_t seed) {
    std::vector<BlockKey> keys = a_->StoreShared(seed, kShared);
    EXPECT_TRUE(b_->Store(seed, kLocal).has_value());
    return keys;
  }

  std::unique_ptr<RedisClusterProcess> redis_;
  std::unique_ptr<SlowProxy> proxy_;
  std::filesystem::path dir_;
  std::unique_ptr<Node> a_, b_;
};

TEST_F(LoadOrRecomputeTest, ASlowRemoteTierIsRecomputedWhileHostHitsLoadAndIsLoadedAgainOnceFast) {
  Client& b = *b_->client;
  // The first prefetch times the remote tier: 24 blocks fetched through the
  // slow link. It gives no prefill rate, as an engine's first request does
  // before the engine has timed a step: its fetch is a timing all the same.
  const std::vector<BlockKey> first = Prompt(1);
  Result<uint32_t> fetched = b.Prefetch(b_->id, first);
  ASSERT_TRUE(fetched.has_value()) << fetched.error();
  EXPECT_EQ(*fetched, kShared);

  // Now the remote tier is known slow: its hits are left to compute, the
  // host ones still reported, and loaded byte for byte.
  const std::vector<BlockKey> second = Prompt(2);
  Result<LookupResult> slow = b.Lookup(b_->id, second, kPrefillTokensPerSecond);
  ASSERT_TRUE(slow.has_value()) << slow.error();
  EXPECT_EQ(slow->hits, kLocal);
  EXPECT_EQ(slow->recompute, kShared - kLocal);
  for (BlockTier t : slow->tiers) EXPECT_EQ(t, BlockTier::kHost);
  EXPECT_EQ(b_->Counter("recomputed_tokens_remote"), (kShared - kLocal) * kRemoteBlockTokens);
  uint32_t wrong = 0;
  Result<uint32_t> loaded = b_->Load({second.begin(), second.begin() + kLocal}, 100, &wrong);
  ASSERT_TRUE(loaded.has_value()) << loaded.error();
  EXPECT_EQ(*loaded, kLocal);
  EXPECT_EQ(wrong, 0u);
  // A prefetch fetches none of them; without a prefill rate every hit is
  // reported, as before.
  Result<uint32_t> not_fetched = b.Prefetch(b_->id, second, kPrefillTokensPerSecond);
  ASSERT_TRUE(not_fetched.has_value()) << not_fetched.error();
  EXPECT_EQ(*not_fetched, kLocal);
  Result<LookupResult> every = b.Lookup(b_->id, second);
  ASSERT_TRUE(every.has_value()) << every.error();
  EXPECT_EQ(every->hits, kShared);
  EXPECT_EQ(every->recompute, 0u);

  // The link recovers. Within LoadRates::kFirstExploreAfter (doubled for
  // each look that found it still slow: one here) a prefetch fetches the
  // remote hits again, and the timing that gives replaces the slow one.
  proxy_->set_interval(std::chrono::milliseconds(0));
  std::this_thread::sleep_for(std::chrono::milliseconds(2200));
  const std::vector<BlockKey> third = Prompt(3);
  Result<uint32_t> explored = b.Prefetch(b_->id, third, kPrefillTokensPerSecond);
  ASSERT_TRUE(explored.has_value()) << explored.error();
  EXPECT_EQ(*explored, kShared);
  const uint64_t recomputed = b_->Counter("recomputed_tokens_remote");
  const std::vector<BlockKey> fourth = Prompt(4);
  Result<LookupResult> fast = b.Lookup(b_->id, fourth, kPrefillTokensPerSecond);
  ASSERT_TRUE(fast.has_value()) << fast.error();
  EXPECT_EQ(fast->hits, kShared) << b_->daemon.Log();
  EXPECT_EQ(fast->recompute, 0u);
  EXPECT_EQ(b_->Counter("recomputed_tokens_remote"), recomputed);
  Result<uint32_t> remote_loaded = b_->Load(fourth, 100, &wrong);
  ASSERT_TRUE(remote_loaded.has_value()) << remote_loaded.error();
  EXPECT_EQ(*remote_loaded, kShared);
  EXPECT_EQ(wrong, 0u);
}

// A tenant that registers layout after layout keeps the rates of at most
// limits.max_namespaces_per_tenant of them: a co-tenant cannot grow kvtierd
// without bound by asking about ever new layouts.
TEST(LoadOrRecomputeBoundTest, ATenantKeepsTheRatesOfAtMostItsLayoutsLimit) {
  Result<DaemonProcess> d = DaemonProcess::Start({"limits.max_namespaces_per_tenant=3", "tiers.disk.enabled=false"});
  ASSERT_TRUE(d.has_value()) << d.error();
  Result<std::unique_ptr<Client>> c = Client::Connect({.socket_path = d->socket_path(), .client_name = "bound"});
  ASSERT_TRUE(c.has_value()) << c.error();
  std::vector<ShmKvCache> caches;
  for (uint32_t i = 0; i < 8; ++i) {
    const Layout layout = Layout::Create(LayoutSpec{.model_id = "kvtier/rates-" + std::to_string(i), .num_layers = 1,
                                                    .kv_kind = KvKind::kSeparateKv, .num_kv_heads = 1, .head_dim = 64,
                                                    .dtype = DType::kBf16, .block_tokens = 16, .tp_rank = 0,
                                                    .tp_size = 1, .scale_bytes_per_layer = 0})
                              .value();
    Result<ShmKvCache> cache = ShmKvCache::Create(layout, 4);
    ASSERT_TRUE(cache.has_value());
    caches.push_back(std::move(*cache));
    Result<CacheId> id = (*c)->RegisterKvCache(caches.back());
    ASSERT_TRUE(id.has_value()) << id.error();
    Result<std::vector<BlockKey>> keys = (*c)->ComputeKeys(*id, PseudoTokens(i, 32));
    ASSERT_TRUE(keys.has_value());
    ASSERT_TRUE((*c)->Load(*id, *keys, Range(0, 2)).has_value());  // a load keeps its layout's rates
    Result<DaemonStats> s = (*c)->Stats();
    ASSERT_TRUE(s.has_value());
    EXPECT_EQ(s->Counter("load_rates_layouts"), std::min<uint64_t>(i + 1, 3)) << i;
  }
}

}  // namespace
}  // namespace kvtier::testing
