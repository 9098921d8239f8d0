// The eviction orders (tiers/eviction_order.h) over the Mooncake trace,
// through kvtier's own BlockIndex (tools/policy_sim.h): the sweep
// docs/policy.md quotes, tuned on nothing (the first third of the trace
// warms the cache; hits are counted on the rest), and the bounds every
// policy keeps: no more hits than Belady's any-position optimum, the reuse
// ceiling once the tier holds every block.
#include "tools/policy_sim.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <string>

namespace kvtier::trace {
namespace {

std::string MooncakeTrace() {
  return std::string(KVTIER_SOURCE_DIR) + "/../shared/traces/mooncake_synthetic_trace.jsonl";
}

TEST(PolicySimTest, SweepOfTheMooncakeTrace) {
  if (!std::filesystem::exists(MooncakeTrace())) GTEST_SKIP() << "no " << MooncakeTrace();
  auto t = LoadTrace(MooncakeTrace());
  ASSERT_TRUE(t.has_value()) << t.error();
  DropPartialTails(&*t);  // as vLLM and SGLang store them
  const uint64_t from = TuningSplit(*t);
  ASSERT_GT(from, 0u);
  ASSERT_LT(from, t->size());
  const PolicyKind kinds[] = {PolicyKind::kLru, PolicyKind::kS3Fifo, PolicyKind::kClasses};
  std::printf("hit rate of requests %llu to %zu (of the first: none counted)\n", static_cast<unsigned long long>(from),
              t->size());
  std::printf("%8s %8s %8s %8s %8s   gap closed: s3fifo, classes; ns per access\n", "blocks", "lru", "s3fifo",
              "classes", "belady");
  for (uint64_t capacity : {1000u, 2000u, 5000u, 10000u, 20000u, 50000u}) {
    PolicySimResult r[3];
    for (int i = 0; i < 3; ++i) {
      r[i] = SimulatePolicy(*t, {.capacity_blocks = capacity, .policy = kinds[i], .count_from_request = from});
    }
    const SimResult opt = SimulateBelady(*t, capacity, from);
    auto gap = [&](const PolicySimResult& p) {
      return 100 * (p.sim.hit_rate() - r[0].sim.hit_rate()) / (opt.hit_rate() - r[0].sim.hit_rate());
    };
    std::printf("%8llu %7.2f%% %7.2f%% %7.2f%% %7.2f%%   %+6.1f%% %+6.1f%%   %.0f %.0f %.0f\n",
                static_cast<unsigned long long>(capacity), 100 * r[0].sim.hit_rate(), 100 * r[1].sim.hit_rate(),
                100 * r[2].sim.hit_rate(), 100 * opt.hit_rate(), gap(r[1]), gap(r[2]), r[0].ns_per_access,
                r[1].ns_per_access, r[2].ns_per_access);
    for (const PolicySimResult& p : r) {
      EXPECT_EQ(p.sim.accesses, opt.accesses);
      EXPECT_LE(p.sim.hits, opt.any_hits) << PolicyName(kinds[&p - r]) << " at " << capacity;
    }
    if (capacity >= CountUniqueBlocks(*t)) {
      for (const PolicySimResult& p : r) EXPECT_EQ(p.sim.hits, r[0].sim.hits) << "no evictions: the ceiling";
      EXPECT_EQ(r[0].sim.evictions, 0u);
    }
  }
}

}  // namespace
}  // namespace kvtier::trace
