// FencePage and OpFence (common/op_fence.h): the daemon's copies enter the
// word only while it holds their op's generation, uncancelled; a cancel that
// reports quiet is final, even against copiers racing it on other threads;
// a slot reopened for another op keeps stale copies out and their leaving
// off its count.
#include "common/op_fence.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

namespace kvtier {
namespace {

std::shared_ptr<FencePage> NewPage() {
  return std::make_shared<FencePage>(MemoryMapping::Anonymous(FencePage::kBytes).value());
}

TEST(OpFenceTest, CopiesEnterOnlyAnOpenFenceOfTheirGeneration) {
  auto page = NewPage();
  page->Open(7, 100);
  EXPECT_FALSE(page->Enter(7, 99)) << "another op's generation";
  ASSERT_TRUE(page->Enter(7, 100));
  EXPECT_FALSE(page->Quiet(7, 100));
  EXPECT_FALSE(page->Cancel(7, 100)) << "a copy is in progress";
  EXPECT_FALSE(page->Enter(7, 100)) << "cancelled: no copy starts";
  page->Leave(7, 100);
  EXPECT_TRUE(page->Quiet(7, 100));
  EXPECT_TRUE(page->Cancel(7, 100)) << "cancelling twice is fine";

  // Reopened for another op while a stale copy is in progress: the stale
  // copy's leaving does not count against the new op.
  page->Open(8, 5);
  ASSERT_TRUE(page->Enter(8, 5));
  page->Open(8, 6);
  ASSERT_TRUE(page->Enter(8, 6));
  page->Leave(8, 5);
  EXPECT_FALSE(page->Quiet(8, 6));
  page->Leave(8, 6);
  EXPECT_TRUE(page->Quiet(8, 6));
  page->Leave(8, 6);  // one too many: the count stays at zero
  EXPECT_TRUE(page->Enter(8, 6));
  EXPECT_FALSE(page->Quiet(8, 6));
}

TEST(OpFenceTest, AnEmptyFenceAlwaysLetsCopiesRunAndAnEntryLeavesOnce) {
  OpFence none;
  OpFence::Entry entry;
  EXPECT_TRUE(none.Enter(entry));

  auto page = NewPage();
  page->Open(1, 3);
  const OpFence fence(page, 1, 3);
  {
    OpFence::Entry held;
    ASSERT_TRUE(fence.Enter(held));
    OpFence::Entry moved = std::move(held);
    EXPECT_FALSE(page->Quiet(1, 3));
  }
  EXPECT_TRUE(page->Quiet(1, 3)) << "the moved entry left once, the moved-from none";
}

TEST(OpFenceTest, NoCopyTouchesTheMemoryOnceACancelReportsQuiet) {
  auto page = NewPage();
  constexpr int kRounds = 200;
  for (int round = 0; round < kRounds; ++round) {
    const uint64_t generation = static_cast<uint64_t>(round) + 1;
    page->Open(0, generation);
    std::atomic<uint64_t> writes{0};
    std::atomic<bool> stop{false};
    std::vector<std::thread> copiers;
    for (int t = 0; t < 3; ++t) {
      copiers.emplace_back([&] {
        const OpFence fence(page, 0, generation);
        while (!stop.load(std::memory_order_relaxed)) {
          OpFence::Entry entry;
          if (!fence.Enter(entry)) continue;
          for (int i = 0; i < 10; ++i) writes.fetch_add(1, std::memory_order_relaxed);
        }
      });
    }
    while (writes.load(std::memory_order_relaxed) == 0) std::this_thread::yield();
    while (!page->Cancel(0, generation)) std::this_thread::yield();
    const uint64_t seen = writes.load(std::memory_order_relaxed);
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    EXPECT_EQ(writes.load(std::memory_order_relaxed), seen) << "round " << round << ": a copy ran after the cancel";
    stop = true;
    for (std::thread& t : copiers) t.join();
    EXPECT_EQ(writes.load(), seen) << "round " << round;
  }
}

}  // namespace
}  // namespace kvtier
