// SessionOps: only running ops count toward the limit; finished, uncollected
// results are bounded (the first to finish is dropped first), and a lookup
// of a dropped op says so.
#include "daemon/session_ops.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

namespace kvtier {
namespace {

using ::testing::HasSubstr;

OpOutcome Blocks(uint32_t n) {
  OpOutcome o;
  o.blocks = n;
  return o;
}

TEST(SessionOpsTest, OnlyRunningOpsCountTowardTheLimit) {
  SessionOps ops(2, 4);
  const uint64_t a = ops.Start().first;
  const uint64_t b = ops.Start().first;
  EXPECT_EQ(a, 1u);
  EXPECT_EQ(b, 2u);
  EXPECT_TRUE(ops.full());
  ASSERT_NE(ops.Finish(a, Blocks(1)), nullptr);
  EXPECT_FALSE(ops.full()) << "a finished op nobody waited for holds no place";
  EXPECT_EQ(ops.in_flight(), 1u);
  EXPECT_EQ(ops.kept(), 1u);
  // Many more ops than the limit, none collected.
  for (int i = 0; i < 100; ++i) {
    ASSERT_FALSE(ops.full()) << i;
    const uint64_t id = ops.Start().first;
    ASSERT_NE(ops.Finish(id, Blocks(2)), nullptr);
  }
  EXPECT_EQ(ops.in_flight(), 1u);
  EXPECT_EQ(ops.kept(), 4u) << "uncollected results are bounded";
  EXPECT_EQ(ops.dropped(), 97u);
}

TEST(SessionOpsTest, TheFirstToFinishIsDroppedFirstAndALookupSaysSo) {
  SessionOps ops(8, 2);
  const uint64_t a = ops.Start().first;
  const uint64_t b = ops.Start().first;
  const uint64_t c = ops.Start().first;
  // Finished out of start order: b, then c, then a.
  ASSERT_NE(ops.Finish(b, Blocks(2)), nullptr);
  ASSERT_NE(ops.Finish(c, Blocks(3)), nullptr);
  ASSERT_NE(ops.Finish(a, Blocks(1)), nullptr);
  Result<SessionOp*> gone = ops.Find(b);
  ASSERT_FALSE(gone.has_value());
  EXPECT_EQ(gone.error().code(), StatusCode::kNotFound);
  EXPECT_THAT(gone.error().message(), HasSubstr("dropped"));
  ASSERT_TRUE(ops.Find(c).has_value());
  EXPECT_EQ((*ops.Find(c))->outcome.blocks, 3u);
  ASSERT_TRUE(ops.Find(a).has_value());
  EXPECT_TRUE((*ops.Find(a))->done);
  Result<SessionOp*> never = ops.Find(99);
  ASSERT_FALSE(never.has_value());
  EXPECT_EQ(never.error().code(), StatusCode::kNotFound);
  EXPECT_THAT(never.error().message(), HasSubstr("was started"));
}

TEST(SessionOpsTest, ATakenResultLeavesRoomForAnother) {
  SessionOps ops(8, 2);
  const uint64_t a = ops.Start().first;
  const uint64_t b = ops.Start().first;
  ASSERT_NE(ops.Finish(a, Blocks(1)), nullptr);
  ASSERT_NE(ops.Finish(b, Blocks(1)), nullptr);
  ops.Take(a);  // collected by a Wait
  EXPECT_EQ(ops.kept(), 1u);
  const uint64_t c = ops.Start().first;
  ASSERT_NE(ops.Finish(c, Blocks(1)), nullptr);
  EXPECT_TRUE(ops.Find(b).has_value()) << "b was dropped although only b and c were kept";
  EXPECT_TRUE(ops.Find(c).has_value());
  EXPECT_EQ(ops.dropped(), 0u);
}

TEST(SessionOpsTest, AnOpWithWaitersIsNotKeptAndFinishesOnce) {
  SessionOps ops(1, 1);
  auto [id, op] = ops.Start();
  op->waiters.push_back(OpWaiter{.request = 7, .deadline = std::nullopt});
  SessionOp* done = ops.Finish(id, Blocks(4));
  ASSERT_NE(done, nullptr);
  EXPECT_EQ(done->waiters.size(), 1u);
  EXPECT_EQ(ops.kept(), 0u) << "its waiters get the result";
  EXPECT_EQ(ops.Finish(id, Blocks(4)), nullptr) << "finished twice";
  ops.Take(id);
  EXPECT_FALSE(ops.Find(id).has_value());
  EXPECT_EQ(ops.in_flight(), 0u);
  EXPECT_FALSE(ops.full());
}

}  // namespace
}  // namespace kvtier
