// FairShareQueue (common/fair_share_queue.h): flows served by the service
// they have had.
#include "common/fair_share_queue.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <vector>

namespace kvtier {
namespace {

// The event loop's use: cost 1 a request.
TEST(FairShareQueueTest, ATenantsOneSessionWaitsBehindOneRequestOfEachOtherTenant) {
  FairShareQueue<uint64_t> q;
  for (uint64_t s = 1; s <= 64; ++s) q.Push(/*flow=*/1, 1, s);  // tenant 1: 64 sessions
  q.Push(/*flow=*/2, 1, 100);                                   // tenant 2: one
  q.Push(/*flow=*/3, 1, 200);                                   // tenant 3: one
  EXPECT_EQ(q.active_flows(), 3u);
  std::vector<uint64_t> order;
  while (std::optional<uint64_t> s = q.Pop()) {
    order.push_back(*s);
    // A session served is queued again behind its tenant's others, as the
    // loop does while it has requests.
    if (*s <= 2) q.Push(1, 1, *s + 1000);
  }
  ASSERT_EQ(order.size(), 68u);
  EXPECT_EQ(order[0], 1u);
  EXPECT_EQ(order[1], 100u) << "tenant 2 waited behind more than one request of tenant 1";
  EXPECT_EQ(order[2], 200u);
  EXPECT_EQ(order[3], 2u);
  // Tenant 1's sessions in their order, its requeued ones after them.
  EXPECT_EQ(order[4], 3u);
  EXPECT_EQ(order.back(), 1002u);
  EXPECT_TRUE(q.empty());
}

TEST(FairShareQueueTest, AFlowThatWasIdleIsServedNextThenInTurnWithABacklog) {
  // The host backend's use: cost in bytes. Flow 1 keeps a deep backlog of
  // 1 MiB tasks; flow 2 arrives with four after idling.
  constexpr uint64_t kMiB = 1 << 20;
  FairShareQueue<int> q;
  for (int i = 0; i < 100; ++i) q.Push(1, kMiB, i);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(q.Pop(), i);
  for (int i = 0; i < 4; ++i) q.Push(2, kMiB, 1000 + i);
  std::vector<int> next;
  for (int i = 0; i < 10; ++i) next.push_back(*q.Pop());
  EXPECT_EQ(next, (std::vector<int>{1000, 10, 1001, 11, 1002, 12, 1003, 13, 14, 15}));
}

TEST(FairShareQueueTest, IdlingEarnsNoCreditAndAFlowThatHadMoreWaits) {
  constexpr uint64_t kMiB = 1 << 20;
  FairShareQueue<int> q;
  // Flow 2 idles while flow 1 takes 32 MiB: coming back, it does not get
  // those 32 MiB ahead of flow 1, only its turn.
  for (int i = 0; i < 32; ++i) q.Push(1, kMiB, i);
  for (int i = 0; i < 16; ++i) q.Pop();
  for (int i = 0; i < 4; ++i) q.Push(2, kMiB, 100 + i);
  std::vector<int> next;
  for (int i = 0; i < 4; ++i) next.push_back(*q.Pop());
  EXPECT_EQ(next, (std::vector<int>{100, 16, 101, 17}));
  // Flow 3 takes one 8 MiB item, idles and comes back: it had more than its
  // share, so it waits its own virtual time out while the others go on.
  q.Push(3, 8 * kMiB, 300);
  while (q.Pop() != 300) {
  }
  q.Push(3, kMiB, 301);
  next.clear();
  for (int i = 0; i < 6; ++i) next.push_back(*q.Pop());
  EXPECT_EQ(std::count(next.begin(), next.end(), 301), 0) << "flow 3 went again before the others caught up";
}

TEST(FairShareQueueTest, BackloggedFlowsShareByCostWhateverTheirItemSizes) {
  // Flow 1 queues 4 KiB items, flow 2 256 KiB ones; both stay backlogged.
  // Over a long run each is served about the same bytes, and no flow's
  // items leave out of order.
  FairShareQueue<std::pair<uint32_t, uint64_t>> q;
  const std::map<uint32_t, uint64_t> item_bytes = {{1, 4096}, {2, 256 * 1024}, {3, 64 * 1024}};
  std::map<uint32_t, uint64_t> pushed, served_bytes, next_seq;
  for (const auto& [flow, bytes] : item_bytes) {
    for (int i = 0; i < 64; ++i) q.Push(flow, bytes, {flow, pushed[flow]++});
  }
  std::mt19937 rng(46);
  for (int step = 0; step < 200000; ++step) {
    const auto [flow, seq] = *q.Pop();
    ASSERT_EQ(seq, next_seq[flow]++) << "flow " << flow << " out of order";
    served_bytes[flow] += item_bytes.at(flow);
    // Keep every flow backlogged, with a random refill.
    const uint32_t refill = 1 + static_cast<uint32_t>(rng() % 3);
    q.Push(refill, item_bytes.at(refill), {refill, pushed[refill]++});
    if (refill != flow) q.Push(flow, item_bytes.at(flow), {flow, pushed[flow]++});
  }
  const double total = static_cast<double>(served_bytes[1] + served_bytes[2] + served_bytes[3]);
  for (const auto& [flow, bytes] : served_bytes) {
    EXPECT_NEAR(static_cast<double>(bytes) / total, 1.0 / 3, 0.01) << "flow " << flow;
  }
}

}  // namespace
}  // namespace kvtier
