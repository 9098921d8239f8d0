// FairQueue: readable sessions served tenants in turn (daemon/fair_queue.h).
#include "daemon/fair_queue.h"

#include <gtest/gtest.h>

#include <vector>

namespace kvtier {
namespace {

TEST(FairQueueTest, ATenantsOneSessionWaitsBehindOneRequestOfEachOtherTenant) {
  FairQueue q;
  for (uint64_t s = 1; s <= 64; ++s) q.Push(/*flow=*/1, s);  // tenant 1: 64 sessions
  q.Push(/*flow=*/2, 100);                                   // tenant 2: one
  q.Push(/*flow=*/3, 200);                                   // tenant 3: one
  std::vector<uint64_t> order;
  while (std::optional<uint64_t> s = q.Pop()) {
    order.push_back(*s);
    // A session served is queued again behind its tenant's others, as the
    // loop does while it has requests.
    if (*s <= 2) q.Push(1, *s + 1000);
  }
  ASSERT_GE(order.size(), 66u);
  EXPECT_EQ(order[0], 1u);
  EXPECT_EQ(order[1], 100u) << "tenant 2 waited behind more than one request of tenant 1";
  EXPECT_EQ(order[2], 200u);
  EXPECT_EQ(order[3], 2u);
  // Tenant 1's sessions in their order, its requeued ones after them.
  EXPECT_EQ(order[4], 3u);
  EXPECT_EQ(order.back(), 1002u);
  EXPECT_TRUE(q.empty());
}

TEST(FairQueueTest, TurnsGoOnFromTheTenantServedLastAsTenantsComeAndGo) {
  FairQueue q;
  q.Push(5, 50);
  q.Push(9, 90);
  EXPECT_EQ(q.Pop(), 50u);
  q.Push(2, 20);   // a lower tenant arriving waits for 9's turn first
  q.Push(5, 51);
  EXPECT_EQ(q.Pop(), 90u);
  EXPECT_EQ(q.Pop(), 20u);
  EXPECT_EQ(q.Pop(), 51u);
  EXPECT_EQ(q.Pop(), std::nullopt);
}

}  // namespace
}  // namespace kvtier
