// The engine's retention hints (issue 19, docs/policy.md) end to end: a real
// kvtierd with a small host tier and a real client. A hinted workload keeps
// what was hinted while unhinted blocks of the same age go; a finished
// session's blocks go before older ones, and so do blocks their engine
// keeps a copy of (exclusive caching); a partial tail block is never
// stored; bad hints are refused with what is wrong.
#include <gtest/gtest.h>

#include "common/block_pattern.h"
#include "kvtier/client.h"
#include "kvtier/shm_kv_cache.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/stats_when.h"

namespace kvtier::testing {
namespace {

constexpr uint32_t kBlockTokens = 16;
constexpr uint32_t kHostBlocks = 128;  // 2 MiB of 16 KiB blocks
constexpr uint32_t kPrompt = 16;       // blocks per prompt

Layout SmallLayout() {
  // 16 KiB blocks: 2 layers x (K, V) x 16 tokens x 2 heads x 64 dims x bf16.
  return Layout::Create(LayoutSpec{.model_id = "kvtier/hints", .num_layers = 2,
                                   .kv_kind = KvKind::kSeparateKv, .num_kv_heads = 2, .head_dim = 64,
                                   .dtype = DType::kBf16, .block_tokens = kBlockTokens, .tp_rank = 0,
                                   .tp_size = 1, .scale_bytes_per_layer = 0})
      .value();
}

std::vector<uint32_t> Range(uint32_t first, uint32_t n) {
  std::vector<uint32_t> v(n);
  for (uint32_t i = 0; i < n; ++i) v[i] = first + i;
  return v;
}

class HintsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<DaemonProcess> d = DaemonProcess::Start(
        {"tiers.hbm.enabled=false", "tiers.disk.enabled=false", "tiers.host.bytes=2MiB",
         "policy.watermarks.host={high: 1.0, low: 0.99}", "policy.hints.max_share=0.5"});
    ASSERT_TRUE(d.has_value()) << d.error();
    daemon_.emplace(std::move(*d));
    auto c = Client::Connect({.socket_path = daemon_->socket_path(), .client_name = "hints-test"});
    ASSERT_TRUE(c.has_value()) << c.error();
    client_ = std::move(*c);
    auto cache = ShmKvCache::Create(SmallLayout(), kPrompt + 1);
    ASSERT_TRUE(cache.has_value()) << cache.error();
    cache_.emplace(std::move(*cache));
    auto id = client_->RegisterKvCache(*cache_);
    ASSERT_TRUE(id.has_value()) << id.error();
    id_ = *id;
  }

  std::vector<BlockKey> Keys(uint32_t seed, uint32_t blocks = kPrompt) {
    auto k = client_->ComputeKeys(id_, PseudoTokens(seed, blocks * kBlockTokens));
    EXPECT_TRUE(k.has_value());
    return k ? *k : std::vector<BlockKey>{};
  }
  // Stores a prompt's blocks (filled from their keys); returns how many
  // were newly stored.
  uint32_t Store(const std::vector<BlockKey>& keys, const BlockHint* hint = nullptr) {
    for (size_t i = 0; i < keys.size(); ++i) FillFromKey(keys[i], cache_->block(static_cast<uint32_t>(i)));
    auto r = client_->Store(id_, keys, Range(0, static_cast<uint32_t>(keys.size())), std::nullopt, nullptr, hint);
    EXPECT_TRUE(r.has_value()) << r.error();
    return r ? r->blocks : 0;
  }
  uint32_t Hits(const std::vector<BlockKey>& keys) {
    auto r = client_->Lookup(id_, keys);
    EXPECT_TRUE(r.has_value()) << r.error();
    return r ? r->hits : 0;
  }
  // Unhinted prompts of seeds first.. that store `blocks` blocks in all.
  void Flood(uint32_t first, uint32_t blocks) {
    for (uint32_t s = first; blocks > 0; ++s) {
      const uint32_t n = std::min(blocks, kPrompt);
      EXPECT_EQ(Store(Keys(s, n)), n);
      blocks -= n;
    }
  }

  std::optional<DaemonProcess> daemon_;
  std::unique_ptr<Client> client_;
  std::optional<ShmKvCache> cache_;
  CacheId id_ = 0;
};

TEST_F(HintsTest, AHintedWorkloadKeepsWhatWasHinted) {
  // Three prompts stored one after the other: one kept for its next turn,
  // one kept by priority, and an unhinted one; then more unhinted blocks
  // than the tier holds.
  const auto next_turn = Keys(1), important = Keys(2), plain = Keys(3);
  const BlockHint kept{.next_use_ms = 600'000};
  const BlockHint high{.priority = 1};
  EXPECT_EQ(Store(next_turn, &kept), kPrompt);
  EXPECT_EQ(Store(important, &high), kPrompt);
  EXPECT_EQ(Store(plain), kPrompt);
  Flood(100, 2 * kHostBlocks);
  EXPECT_EQ(Hits(next_turn), kPrompt) << daemon_->Log();
  EXPECT_EQ(Hits(important), kPrompt);
  EXPECT_EQ(Hits(plain), 0u) << "the control, as old as the hinted ones, went";
  // The next turn came: kept no more, it ages like any block.
  ASSERT_EQ(Hits(next_turn), kPrompt);
  const DaemonStats s = client_->Stats().value();
  EXPECT_EQ(s.Counter("hinted"), 2 * kPrompt);
  EXPECT_EQ(s.Counter("hints_refused"), 0u);
  Flood(300, 2 * kHostBlocks);
  EXPECT_EQ(Hits(next_turn), 0u);
  EXPECT_EQ(Hits(important), kPrompt) << "priority lasts";
}

TEST_F(HintsTest, AFinishedSessionGoesBeforeOlderBlocks) {
  const auto older = Keys(1), session = Keys(2);
  EXPECT_EQ(Store(older), kPrompt);
  EXPECT_EQ(Store(session), kPrompt);
  auto over = client_->Hint(id_, session, BlockHint{.session_over = true});
  ASSERT_TRUE(over.has_value()) << over.error();
  EXPECT_EQ(over->hinted, kPrompt);
  // Fill the tier, then a prompt more: the finished session's blocks go,
  // not the older ones.
  Flood(100, kHostBlocks - 2 * kPrompt + kPrompt);
  EXPECT_EQ(Hits(session), 0u);
  EXPECT_EQ(Hits(older), kPrompt);
  // Keys not cached are skipped.
  auto none = client_->Hint(id_, Keys(999), BlockHint{.priority = -1});
  ASSERT_TRUE(none.has_value());
  EXPECT_EQ(none->hinted, 0u);
}

// Exclusive caching: a store's blocks the engine keeps a copy of go before
// older blocks; those whose engine let go of its copy since are kvtier's
// only copies, and stay as long as any unhinted block.
TEST_F(HintsTest, BlocksTheEngineHoldsGoFirstAndThoseItLetGoOfStay) {
  const auto held = Keys(1), let_go = Keys(2), older = Keys(3);
  EXPECT_EQ(Store(older), kPrompt);
  const BlockHint holds{.engine_holds = true};
  EXPECT_EQ(Store(held, &holds), kPrompt);
  EXPECT_EQ(Store(let_go, &holds), kPrompt);
  auto dropped = client_->Hint(id_, let_go, BlockHint{.engine_dropped = true});
  ASSERT_TRUE(dropped.has_value()) << dropped.error();
  EXPECT_EQ(dropped->hinted, kPrompt);
  auto again = client_->Hint(id_, older, BlockHint{.engine_dropped = true});
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->hinted, 0u) << "not held for an engine: nothing to let go of";
  // Fill the tier, then a prompt more: the held blocks go, not the older
  // ones nor those let go of.
  Flood(100, kHostBlocks - 3 * kPrompt + kPrompt);
  EXPECT_EQ(Hits(held), 0u);
  EXPECT_EQ(Hits(let_go), kPrompt);
  EXPECT_EQ(Hits(older), kPrompt);
  const DaemonStats s = client_->Stats().value();
  EXPECT_EQ(s.Counter("engine_held"), 2 * kPrompt);
  EXPECT_EQ(s.Counter("engine_dropped"), kPrompt);
  EXPECT_EQ(s.Counter("hinted"), 0u) << "an engine's copy is no application's hint";
  // Each is for one call only.
  EXPECT_EQ(client_->Hint(id_, older, BlockHint{.engine_holds = true}).error().code(), StatusCode::kInvalidArgument);
  const BlockHint wrong{.engine_dropped = true};
  auto store = client_->Store(id_, older, Range(0, kPrompt), std::nullopt, nullptr, &wrong);
  ASSERT_FALSE(store.has_value());
  EXPECT_EQ(store.error().code(), StatusCode::kInvalidArgument);
}

// A load into an engine that keeps what it loads (Load.engine_holds): the
// loaded blocks go before older ones, as a store's held blocks do; a load
// without it is a use that keeps them. A load takes no other hint.
TEST_F(HintsTest, BlocksLoadedIntoAnEngineThatKeepsThemGoFirst) {
  const auto loaded_held = Keys(1), loaded = Keys(2), older = Keys(3);
  EXPECT_EQ(Store(loaded_held), kPrompt);
  EXPECT_EQ(Store(loaded), kPrompt);
  EXPECT_EQ(Store(older), kPrompt);
  const BlockHint holds{.engine_holds = true};
  auto held = client_->Load(id_, loaded_held, Range(0, kPrompt), &holds);
  ASSERT_TRUE(held.has_value()) << held.error();
  EXPECT_EQ(held->blocks, kPrompt);
  for (uint32_t i = 0; i < kPrompt; ++i) EXPECT_TRUE(MatchesKey(loaded_held[i], cache_->block(i))) << "block " << i;
  auto used = client_->Load(id_, loaded, Range(0, kPrompt));
  ASSERT_TRUE(used.has_value()) << used.error();
  EXPECT_EQ(used->blocks, kPrompt);
  EXPECT_EQ(client_->Stats().value().Counter("engine_held"), kPrompt);
  // Fill the tier, then a prompt more: the blocks the engine keeps go, not
  // the older ones nor those loaded by one that does not keep them.
  Flood(100, kHostBlocks - 3 * kPrompt + kPrompt);
  EXPECT_EQ(Hits(loaded_held), 0u) << daemon_->Log();
  EXPECT_EQ(Hits(loaded), kPrompt);
  EXPECT_EQ(Hits(older), kPrompt);
  const BlockHint priority{.priority = 1, .engine_holds = true};
  auto refused = client_->Load(id_, older, Range(0, kPrompt), &priority);
  ASSERT_FALSE(refused.has_value());
  EXPECT_EQ(refused.error().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.error().message().find("engine_holds only"), std::string::npos) << refused.error();
}

TEST_F(HintsTest, KeepHintsHoldAtMostTheirShareOfTheTier) {
  // max_share 0.5 of 128 blocks: the fifth prompt hinted high is refused,
  // and kept as unhinted.
  const BlockHint high{.priority = 1};
  for (uint32_t s = 1; s <= 5; ++s) EXPECT_EQ(Store(Keys(s), &high), kPrompt);
  const DaemonStats s = client_->Stats().value();
  EXPECT_EQ(s.Counter("hinted"), 5 * kPrompt);
  EXPECT_EQ(s.Counter("hints_refused"), 5 * kPrompt - kHostBlocks / 2);
  auto again = client_->Hint(id_, Keys(5), high);
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->hinted, kPrompt);
  EXPECT_EQ(again->refused, kPrompt);
}

// Two tenants hint against each other: each keeps at most its part of the
// tier's share (here half of it each: no quotas, two tenants), so the first
// to hint cannot refuse the other's hints. Before, the share was the
// tier's alone: tenant a took it whole and every hint of b was refused.
TEST(HintsTenantsTest, NoTenantTakesAnotherTenantsPartOfTheShare) {
  const std::string token_a(32, 'a'), token_b(32, 'b');
  Result<DaemonProcess> d = DaemonProcess::Start(
      {"tiers.hbm.enabled=false", "tiers.disk.enabled=false", "tiers.host.bytes=2MiB",
       "policy.watermarks.host={high: 1.0, low: 0.99}", "policy.hints.max_share=0.5",
       "tenants=[{name: a, token: " + token_a + "}, {name: b, token: " + token_b + "}]"});
  ASSERT_TRUE(d.has_value()) << d.error();
  struct Tenant {
    std::unique_ptr<Client> client;
    std::optional<ShmKvCache> cache;
    CacheId id = 0;
    // Stores prompt `seed`, then hints it high; returns the hints refused.
    uint64_t StoreHigh(uint32_t seed) {
      const std::vector<BlockKey> keys = client->ComputeKeys(id, PseudoTokens(seed, kPrompt * kBlockTokens)).value();
      for (size_t i = 0; i < keys.size(); ++i) FillFromKey(keys[i], cache->block(static_cast<uint32_t>(i)));
      auto stored = client->Store(id, keys, Range(0, kPrompt));
      EXPECT_TRUE(stored.has_value()) << stored.error();
      auto hinted = client->Hint(id, keys, BlockHint{.priority = 1});
      EXPECT_TRUE(hinted.has_value()) << hinted.error();
      EXPECT_EQ(hinted.value_or(HintResult{}).hinted, kPrompt);
      return hinted ? hinted->refused : 0;
    }
  };
  std::vector<Tenant> tenants(2);
  for (int i = 0; i < 2; ++i) {
    auto c = Client::Connect({.socket_path = d->socket_path(), .token = i == 0 ? token_a : token_b});
    ASSERT_TRUE(c.has_value()) << c.error();
    tenants[i].client = std::move(*c);
    tenants[i].cache.emplace(ShmKvCache::Create(SmallLayout(), kPrompt).value());
    tenants[i].id = tenants[i].client->RegisterKvCache(*tenants[i].cache).value();
  }
  // 0.5 of 128 blocks is 64 for the tier, 32 for each tenant.
  uint64_t refused_a = 0;
  for (uint32_t s = 1; s <= 4; ++s) refused_a += tenants[0].StoreHigh(s);
  EXPECT_EQ(refused_a, 4 * kPrompt - 32) << d->Log();
  EXPECT_EQ(tenants[1].StoreHigh(100) + tenants[1].StoreHigh(101), 0u) << "b's part is its own";
  EXPECT_EQ(tenants[1].StoreHigh(102), kPrompt) << "and no more";
}

TEST_F(HintsTest, APartialTailBlockIsNeverStored) {
  const auto keys = Keys(7, 3);
  const BlockHint partial{.last_partial = true};
  EXPECT_EQ(Store(keys, &partial), 2u);
  EXPECT_EQ(Hits(keys), 2u);
  EXPECT_EQ(client_->Stats().value().Counter("partial_not_admitted"), 1u);
}

TEST_F(HintsTest, BadHintsAreRefusedWithWhatIsWrong) {
  const auto keys = Keys(8, 2);
  auto refused = [&](const BlockHint& h, bool store) {
    Status st = store ? client_->Store(id_, keys, Range(0, 2), std::nullopt, nullptr, &h).error()
                      : client_->Hint(id_, keys, h).error();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
    return st.message();
  };
  EXPECT_NE(refused({.priority = 2}, true).find("priority 2"), std::string::npos);
  EXPECT_NE(refused({.priority = -5}, false).find("priority -5"), std::string::npos);
  EXPECT_NE(refused({.next_use_ms = 3'600'001}, true).find("next_use_ms"), std::string::npos);
  EXPECT_NE(refused({.session_over = true}, true).find("session_over"), std::string::npos);
  EXPECT_NE(refused({.last_partial = true}, false).find("last_partial"), std::string::npos);
  EXPECT_EQ(Hits(keys), 0u) << "nothing stored";
}

}  // namespace
}  // namespace kvtier::testing
