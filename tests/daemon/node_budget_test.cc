// NodeBudget: the node's limits shared between tenants (daemon/node_budget.h).
#include "daemon/node_budget.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

namespace kvtier {
namespace {

using ::testing::HasSubstr;

NodeBudget::Spec MapsSpec(uint64_t node, uint64_t reserve, uint64_t per_tenant, size_t tenants,
                          double fraction = 0.5) {
  return {.label = "vm.max_map_count",
          .limit = "vm.max_map_count",
          .unit = "maps",
          .per_tenant_setting = "limits.max_mappings_per_tenant",
          .remedy = "raise vm.max_map_count",
          .node = node,
          .reserve = reserve,
          .per_tenant_limit = per_tenant,
          .tenants = tenants,
          .guaranteed_fraction = fraction};
}

TEST(NodeBudgetTest, LimitsThatFitTheNodeAreEachGuaranteedWhole) {
  NodeBudget b(MapsSpec(1000, 100, 200, 4));  // 4 x 200 <= 900
  EXPECT_EQ(b.figures().share, 200u);
  for (uint32_t t = 0; t < 4; ++t) EXPECT_TRUE(b.Take(t, "t", 200).ok()) << t;
  EXPECT_EQ(b.figures().used, 800u);
  EXPECT_EQ(b.figures().refusals, 0u);
}

TEST(NodeBudgetTest, PastTheNodeEachIsGuaranteedItsShareAndBorrowsOnlyFromThePool) {
  // 100 for tenants, 4 tenants of limit 60: half of it split into shares of
  // 12, the other 52 lent on demand.
  NodeBudget b(MapsSpec(110, 10, 60, 4));
  const NodeBudgetFigures f = b.figures();
  EXPECT_EQ(f.capacity, 100u);
  EXPECT_EQ(f.share, 12u);
  EXPECT_EQ(f.pool, 52u);

  ASSERT_TRUE(b.Take(0, "a", 60).ok());  // its 12 and 48 of the pool
  // b wants its limit too: its share, and the 4 left in the pool.
  const Status refused = b.Take(1, "b", 60);
  ASSERT_EQ(refused.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.message(), HasSubstr("tenant b would hold 60 maps"));
  EXPECT_THAT(refused.message(), HasSubstr("guaranteed share of 12 maps"));
  EXPECT_THAT(refused.message(), HasSubstr("vm.max_map_count"));
  EXPECT_THAT(refused.message(), HasSubstr("raise vm.max_map_count"));
  ASSERT_TRUE(b.Take(1, "b", 16).ok());
  EXPECT_EQ(b.Take(1, "b", 1).code(), StatusCode::kResourceExhausted);
  // Tenants that used nothing still get their whole share, one at a time.
  for (uint32_t t : {2u, 3u}) {
    for (int i = 0; i < 12; ++i) ASSERT_TRUE(b.Take(t, "c", 1).ok()) << t << " " << i;
    EXPECT_EQ(b.Take(t, "c", 1).code(), StatusCode::kResourceExhausted) << t;
  }
  EXPECT_EQ(b.figures().used, 100u);
  EXPECT_EQ(b.figures().refusals, 4u);

  // What a gives back is lent again.
  b.Give(0, 48);
  EXPECT_TRUE(b.Take(1, "b", 44).ok());
  EXPECT_EQ(b.used(1), 60u);
  // Giving back within its share keeps it for the tenant, not the pool.
  b.Give(2, 12);
  EXPECT_EQ(b.Take(0, "a", 5).code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(b.Take(2, "c", 12).ok());
  EXPECT_TRUE(b.Take(0, "a", 4).ok());
}

TEST(NodeBudgetTest, AGuaranteedFractionOfOneSplitsTheNodeEvenly) {
  NodeBudget b(MapsSpec(100, 0, 60, 4, 1.0));
  EXPECT_EQ(b.figures().share, 25u);
  EXPECT_EQ(b.figures().pool, 0u);
  EXPECT_TRUE(b.Take(0, "a", 25).ok());
  EXPECT_EQ(b.Take(0, "a", 1).code(), StatusCode::kResourceExhausted);
}

TEST(NodeBudgetTest, AReserveAsLargeAsTheNodeLeavesNothingAndSaysSo) {
  NodeBudget b(MapsSpec(100, 150, 10, 2));
  EXPECT_EQ(b.figures().capacity, 0u);
  const Status st = b.Take(0, "a", 1);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(st.message(), HasSubstr("kvtierd's own 150 maps"));
}

// Whatever the others take and give, in any order, a tenant below its share
// always gets the rest of it; and the budget never holds more than its
// capacity.
TEST(NodeBudgetTest, RandomTakesAndGivesNeverBreakAGuaranteeOrTheCapacity) {
  std::mt19937_64 rng(46);
  for (int round = 0; round < 50; ++round) {
    const size_t tenants = 1 + rng() % 9;
    const uint64_t limit = 1 + rng() % 400;
    const uint64_t node = 50 + rng() % 2000;
    NodeBudget b(MapsSpec(node, rng() % 50, limit, tenants, 0.1 + 0.9 * static_cast<double>(rng() % 10) / 9));
    const NodeBudgetFigures f = b.figures();
    std::vector<uint64_t> used(tenants, 0);
    for (int step = 0; step < 2000; ++step) {
      const uint32_t t = static_cast<uint32_t>(rng() % tenants);
      if (rng() % 3 == 0 && used[t] > 0) {
        const uint64_t n = 1 + rng() % used[t];
        b.Give(t, n);
        used[t] -= n;
      } else {
        // The per-tenant limit is the caller's to check.
        const uint64_t n = 1 + rng() % std::max<uint64_t>(1, limit / 4);
        if (used[t] + n > limit) continue;
        const Status st = b.Take(t, "t", n);
        if (used[t] + n <= f.share) {
          ASSERT_TRUE(st.ok()) << "round " << round << " step " << step << ": " << st.message();
        }
        if (st.ok()) used[t] += n;
      }
      uint64_t total = 0;
      for (size_t i = 0; i < tenants; ++i) {
        ASSERT_EQ(b.used(static_cast<uint32_t>(i)), used[i]);
        total += used[i];
      }
      ASSERT_LE(total, f.capacity);
      ASSERT_EQ(b.figures().used, total);
    }
  }
}

TEST(NodeBudgetTest, RefusalsAreLoggedAtMostOnceAMinute) {
  NodeBudget b(MapsSpec(10, 0, 10, 1));
  ASSERT_TRUE(b.Take(0, "a", 10).ok());
  const auto t0 = std::chrono::steady_clock::time_point{} + std::chrono::hours(1);
  for (int i = 0; i < 5; ++i) {
    EXPECT_FALSE(b.Take(0, "a", 1, t0 + std::chrono::seconds(i * 10)).ok());
  }
  EXPECT_EQ(b.figures().refusals, 5u);
  EXPECT_EQ(b.figures().warnings, 1u);
  EXPECT_FALSE(b.Take(0, "a", 1, t0 + NodeBudget::kWarningInterval).ok());
  EXPECT_EQ(b.figures().warnings, 2u);
  EXPECT_FALSE(b.Take(0, "a", 1, t0 + NodeBudget::kWarningInterval + std::chrono::seconds(59)).ok());
  EXPECT_EQ(b.figures().warnings, 2u);
}

TEST(NodeLimitsTest, TheNodesLimitsAreReadAndSettingsOnlyLowerThem) {
  Config::Limits limits;
  Result<NodeLimits> node = ReadNodeLimits(limits);
  ASSERT_TRUE(node.has_value()) << node.error().message();
  EXPECT_GT(node->max_map_count, 0u);
  EXPECT_GT(node->open_files, 0u);
  EXPECT_GT(node->memory_bytes, 0u);
  EXPECT_FALSE(node->memory_source.empty());

  limits.node_max_map_count = 1000;
  limits.node_open_files = 500;
  limits.node_memory_bytes = 1ull << 30;
  Result<NodeLimits> lower = ReadNodeLimits(limits);
  ASSERT_TRUE(lower.has_value()) << lower.error().message();
  EXPECT_EQ(lower->max_map_count, 1000u);
  EXPECT_EQ(lower->open_files, 500u);
  EXPECT_EQ(lower->memory_bytes, 1ull << 30);
  EXPECT_EQ(lower->memory_source, "limits.node_memory_bytes");

  limits.node_max_map_count = node->max_map_count + 1;
  Result<NodeLimits> higher = ReadNodeLimits(limits);
  ASSERT_FALSE(higher.has_value());
  EXPECT_EQ(higher.error().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(higher.error().message(), HasSubstr("limits.node_max_map_count"));
  EXPECT_THAT(higher.error().message(), HasSubstr("it can only set it lower"));

  EXPECT_GT(MapsInUse(), 10u);
  EXPECT_GT(FdsInUse(), 2u);
}

}  // namespace
}  // namespace kvtier
