// FencePage and OpFence (common/op_fence.h): the daemon's copies enter the
// word only while it holds their op's generation, uncancelled; a cancel that
// reports quiet is final, even against copiers racing it on other threads;
// a slot reopened for another op keeps stale copies out and their leaving
// off its count.
#include "common/op_fence.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
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

TEST(OpFenceTest, LayerProgressOnlyRisesAndOnlyForItsOwnOp) {
  auto page = NewPage();
  ASSERT_TRUE(page->has_progress());
  page->Open(9, 40);
  EXPECT_EQ(page->ProgressOf(9, 40).value() & FencePage::kLayersMask, 0u) << "Open clears the layers";
  const OpFence fence(page, 9, 40);
  fence.Progress(3, false);
  fence.Progress(2, false);  // a report from another worker, late
  uint64_t v = page->ProgressOf(9, 40).value();
  EXPECT_EQ(v & FencePage::kLayersMask, 3u);
  EXPECT_EQ(v & FencePage::kOver, 0u);
  // Reopened for the next op: the old op's late reports do not speak for it.
  page->Open(9, 41);
  EXPECT_FALSE(page->ProgressOf(9, 40).has_value());
  fence.Progress(32, true);
  v = page->ProgressOf(9, 41).value();
  EXPECT_EQ(v & (FencePage::kLayersMask | FencePage::kOver), 0u);
  // Over without every layer (a failed load), and never un-over.
  const OpFence next(page, 9, 41);
  next.Progress(5, true);
  next.Progress(7, false);
  v = page->ProgressOf(9, 41).value();
  EXPECT_EQ(v & FencePage::kLayersMask, 7u);
  EXPECT_NE(v & FencePage::kOver, 0u);

  // A page of fence words only (a client from before layer progress).
  auto old = std::make_shared<FencePage>(MemoryMapping::Anonymous(FencePage::kFenceBytes).value());
  EXPECT_FALSE(old->has_progress());
  old->Open(1, 1);
  OpFence(old, 1, 1).Progress(4, true);  // nothing to report into: no write past the page
}

TEST(OpFenceTest, AWaiterSleepingOnProgressWakesAtEachLayer) {
  auto page = NewPage();
  page->Open(3, 7);
  const OpFence fence(page, 3, 7);
  constexpr uint32_t kLayers = 40;
  std::vector<uint32_t> seen;
  std::thread waiter([&] {
    uint32_t want = 1;
    while (want <= kLayers) {
      const uint64_t v = page->ProgressOf(3, 7).value();
      if ((v & FencePage::kLayersMask) >= want) {
        seen.push_back(static_cast<uint32_t>(v & FencePage::kLayersMask));
        want = static_cast<uint32_t>(v & FencePage::kLayersMask) + 1;
        continue;
      }
      page->SleepOnProgress(3, v, std::chrono::seconds(10));  // a missed wakeup would hang here
    }
  });
  for (uint32_t l = 1; l <= kLayers; ++l) {
    fence.Progress(l, false);
    if (l % 4 == 0) std::this_thread::sleep_for(std::chrono::microseconds(300));
  }
  waiter.join();
  ASSERT_FALSE(seen.empty());
  EXPECT_EQ(seen.back(), kLayers);
  EXPECT_TRUE(std::is_sorted(seen.begin(), seen.end()));
}

}  // namespace
}  // namespace kvtier
