#include "tiers/slot_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "common/memory_mapping.h"

namespace kvtier {
namespace {

constexpr uint64_t kPage = SlotPool::kSlotAlignBytes;

// An arena as the backends hand them out: page-aligned anonymous memory.
MemoryMapping Arena(uint64_t size_bytes) {
  Result<MemoryMapping> m = MemoryMapping::Anonymous(size_bytes);
  EXPECT_TRUE(m.has_value()) << m.error();
  return std::move(*m);
}

// Fills each slot with its own byte and checks none was overwritten by
// another: slots that overlap would clobber each other.
void ExpectDisjoint(const std::vector<std::pair<uint8_t*, uint64_t>>& slots) {
  for (size_t i = 0; i < slots.size(); ++i) {
    std::memset(slots[i].first, static_cast<int>(i % 251 + 1), slots[i].second);
  }
  for (size_t i = 0; i < slots.size(); ++i) {
    const uint8_t want = static_cast<uint8_t>(i % 251 + 1);
    const uint8_t* p = slots[i].first;
    EXPECT_TRUE(std::all_of(p, p + slots[i].second, [&](uint8_t b) { return b == want; }))
        << "slot " << i << " was overwritten";
  }
}

TEST(SlotPoolTest, StrideRoundsUpToTheAlignment) {
  EXPECT_EQ(SlotPool::StrideFor(1), kPage);
  EXPECT_EQ(SlotPool::StrideFor(kPage - 1), kPage);
  EXPECT_EQ(SlotPool::StrideFor(kPage), kPage);
  EXPECT_EQ(SlotPool::StrideFor(kPage + 1), 2 * kPage);
  EXPECT_EQ(SlotPool::StrideFor(6144), 2 * kPage);
  EXPECT_EQ(SlotPool::StrideFor(uint64_t{1} << 30), uint64_t{1} << 30);
}

TEST(SlotPoolTest, SlotsAreAlignedAndInsideTheArena) {
  MemoryMapping arena = Arena(256 * kPage);
  SlotPool pool(arena.data(), arena.size_bytes(), 8 * kPage);
  for (uint64_t bytes : {uint64_t{1}, kPage - 1, kPage, kPage + 1, uint64_t{6144}, 3 * kPage}) {
    uint8_t* slot = pool.Allocate(bytes);
    ASSERT_NE(slot, nullptr) << bytes;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(slot) % kPage, 0u) << bytes;
    EXPECT_GE(slot, arena.data());
    EXPECT_LE(slot + SlotPool::StrideFor(bytes), arena.data() + arena.size_bytes());
  }
}

TEST(SlotPoolTest, SlotsAreDistinctUntilExhausted) {
  constexpr uint64_t kBlock = 6144;  // stride 8192
  MemoryMapping arena = Arena(16 * 2 * kPage);
  SlotPool pool(arena.data(), arena.size_bytes());
  std::vector<std::pair<uint8_t*, uint64_t>> slots;
  std::set<uint8_t*> seen;
  for (int i = 0; i < 16; ++i) {
    ASSERT_TRUE(pool.CanAllocate(kBlock));
    uint8_t* slot = pool.Allocate(kBlock);
    ASSERT_NE(slot, nullptr) << i;
    EXPECT_TRUE(seen.insert(slot).second) << "slot handed out twice";
    slots.emplace_back(slot, SlotPool::StrideFor(kBlock));
  }
  ExpectDisjoint(slots);
  EXPECT_EQ(pool.used_bytes(), pool.capacity_bytes());
  EXPECT_FALSE(pool.CanAllocate(kBlock));
  EXPECT_EQ(pool.Allocate(kBlock), nullptr);
  EXPECT_EQ(pool.Allocate(1), nullptr);
  EXPECT_EQ(pool.used_bytes(), pool.capacity_bytes()) << "a failed Allocate must not count";
}

TEST(SlotPoolTest, FreedSlotIsReused) {
  MemoryMapping arena = Arena(4 * kPage);
  SlotPool pool(arena.data(), arena.size_bytes());
  std::vector<uint8_t*> slots;
  for (int i = 0; i < 4; ++i) slots.push_back(pool.Allocate(kPage));
  ASSERT_EQ(pool.Allocate(kPage), nullptr);
  pool.Free(slots[2], kPage);
  EXPECT_EQ(pool.used_bytes(), 3 * kPage);
  EXPECT_TRUE(pool.CanAllocate(kPage));
  EXPECT_EQ(pool.Allocate(kPage), slots[2]);
  EXPECT_EQ(pool.used_bytes(), 4 * kPage);
  EXPECT_EQ(pool.Allocate(kPage), nullptr);
  // Every slot back: the whole arena is usable again for this size.
  for (uint8_t* s : slots) pool.Free(s, kPage);
  EXPECT_EQ(pool.used_bytes(), 0u);
  std::set<uint8_t*> again;
  for (int i = 0; i < 4; ++i) again.insert(pool.Allocate(kPage));
  EXPECT_EQ(again, std::set<uint8_t*>(slots.begin(), slots.end()));
}

TEST(SlotPoolTest, LowAddressesFirst) {
  MemoryMapping arena = Arena(8 * kPage);
  SlotPool pool(arena.data(), arena.size_bytes());
  for (int i = 0; i < 8; ++i) EXPECT_EQ(pool.Allocate(kPage), arena.data() + i * kPage);
}

TEST(SlotPoolTest, TwoBlockSizesShareOneArena) {
  // Extents of 4 pages: each size takes the arena an extent at a time.
  MemoryMapping arena = Arena(32 * kPage);
  SlotPool pool(arena.data(), arena.size_bytes(), 4 * kPage);
  const uint64_t small = 1000;       // stride 1 page
  const uint64_t large = 2 * kPage;  // stride 2 pages
  std::vector<std::pair<uint8_t*, uint64_t>> slots;
  uint64_t used = 0;
  // Alternate the sizes until the arena is full.
  for (bool progress = true; progress;) {
    progress = false;
    for (uint64_t bytes : {small, large}) {
      if (uint8_t* s = pool.Allocate(bytes); s != nullptr) {
        slots.emplace_back(s, SlotPool::StrideFor(bytes));
        used += SlotPool::StrideFor(bytes);
        progress = true;
      }
    }
  }
  EXPECT_EQ(pool.used_bytes(), used);
  EXPECT_EQ(used, pool.capacity_bytes()) << "extents carved for both sizes fill the arena";
  const auto smalls =
      std::count_if(slots.begin(), slots.end(), [](const auto& s) { return s.second == kPage; });
  EXPECT_GT(smalls, 0);
  EXPECT_GT(static_cast<std::ptrdiff_t>(slots.size()) - smalls, 0);
  ExpectDisjoint(slots);

  // A freed slot serves its own size again.
  pool.Free(slots[0].first, small);
  EXPECT_EQ(pool.Allocate(small), slots[0].first);
}

TEST(SlotPoolTest, EmptyExtentsOfOneSizeServeAnother) {
  MemoryMapping arena = Arena(8 * kPage);
  SlotPool pool(arena.data(), arena.size_bytes(), 4 * kPage);
  std::vector<uint8_t*> small;
  for (int i = 0; i < 8; ++i) small.push_back(pool.Allocate(kPage));
  ASSERT_EQ(pool.used_bytes(), pool.capacity_bytes());
  EXPECT_FALSE(pool.CanAllocate(2 * kPage));
  EXPECT_EQ(pool.Allocate(2 * kPage), nullptr);
  EXPECT_EQ(pool.sizes_in_use(), 1u);
  for (int i = 0; i < 3; ++i) pool.Free(small[i], kPage);
  EXPECT_FALSE(pool.CanAllocate(2 * kPage)) << "the first extent still has a slot in use";
  pool.Free(small[3], kPage);
  // The empty extent stays with its size until another needs the room.
  EXPECT_TRUE(pool.CanAllocate(kPage));
  EXPECT_TRUE(pool.CanAllocate(2 * kPage));
  uint8_t* large = pool.Allocate(2 * kPage);
  EXPECT_EQ(large, arena.data());
  EXPECT_EQ(pool.Allocate(2 * kPage), arena.data() + 2 * kPage);
  EXPECT_EQ(pool.sizes_in_use(), 2u);
  EXPECT_TRUE(pool.holds(2 * kPage));
  EXPECT_FALSE(pool.CanAllocate(kPage));
  EXPECT_EQ(pool.used_bytes(), pool.capacity_bytes());
}

TEST(SlotPoolTest, ExtentToReclaimIsTheLeastUsedExtentOfAnotherSize) {
  MemoryMapping arena = Arena(12 * kPage);
  SlotPool pool(arena.data(), arena.size_bytes(), 4 * kPage);
  std::vector<uint8_t*> small;
  for (int i = 0; i < 12; ++i) small.push_back(pool.Allocate(kPage));  // extents at 0, 4, 8 pages
  EXPECT_EQ(pool.ExtentToReclaim(kPage), std::nullopt) << "no other size to take from";
  pool.Free(small[5], kPage);
  pool.Free(small[6], kPage);
  pool.Free(small[9], kPage);
  const std::optional<std::span<uint8_t>> x = pool.ExtentToReclaim(2 * kPage);
  ASSERT_TRUE(x.has_value());
  EXPECT_EQ(x->data(), arena.data() + 4 * kPage) << "two slots in use, the fewest";
  EXPECT_EQ(x->size(), 4 * kPage);
  EXPECT_EQ(pool.ExtentToReclaim(8 * kPage), std::nullopt)
      << "no extent would make room for 8 pages";
  // The extent holding a preferred slot (the coldest block's) goes first.
  EXPECT_EQ(pool.ExtentToReclaim(2 * kPage, small[10])->data(), arena.data() + 8 * kPage);
  EXPECT_EQ(pool.ExtentToReclaim(2 * kPage, small[0])->data(), arena.data());
  // Freeing what is left there gives the room to the other size.
  pool.Free(small[4], kPage);
  pool.Free(small[7], kPage);
  EXPECT_EQ(pool.Allocate(2 * kPage), arena.data() + 4 * kPage);
}

// The owner finds an extent's blocks through the slots' tags, and a
// draining extent hands out no more slots until it is empty and goes to the
// other size.
TEST(SlotPoolTest, SlotOwnersAndDrainingExtents) {
  MemoryMapping arena = Arena(12 * kPage);
  SlotPool pool(arena.data(), arena.size_bytes(), 4 * kPage);
  std::vector<uint8_t*> small;
  for (int i = 0; i < 12; ++i) small.push_back(pool.Allocate(kPage));  // extents at 0, 4, 8 pages
  int tags[12];
  for (int i = 0; i < 12; ++i) pool.SetOwner(small[i], &tags[i]);
  pool.Free(small[5], kPage);
  std::vector<std::pair<uint8_t*, void*>> seen;
  pool.ForEachSlotInUse(arena.data() + 4 * kPage, [&](uint8_t* slot, void* owner) {
    seen.emplace_back(slot, owner);
    return true;
  });
  EXPECT_EQ(seen, (std::vector<std::pair<uint8_t*, void*>>{
                      {small[4], &tags[4]}, {small[6], &tags[6]}, {small[7], &tags[7]}}));
  // Candidates: the preferred one, then the fewest in use; a draining one first.
  std::vector<std::span<uint8_t>> c = pool.ExtentsToReclaim(2 * kPage, small[9], 3);
  ASSERT_EQ(c.size(), 3u);
  EXPECT_EQ(c[0].data(), arena.data() + 8 * kPage);
  EXPECT_EQ(c[1].data(), arena.data() + 4 * kPage);
  EXPECT_EQ(c[2].data(), arena.data());
  pool.Drain(arena.data() + 4 * kPage);
  EXPECT_TRUE(pool.draining());
  EXPECT_EQ(pool.ExtentsToReclaim(2 * kPage, small[9], 3)[0].data(), arena.data() + 4 * kPage);
  // Its freed slots are not handed out again.
  pool.Free(small[6], kPage);
  EXPECT_EQ(pool.Allocate(kPage), nullptr) << "only the draining extent has free slots";
  // A slot handed out has no owner until one is set.
  pool.Free(small[0], kPage);
  uint8_t* again = pool.Allocate(kPage);
  ASSERT_EQ(again, small[0]);
  pool.ForEachSlotInUse(arena.data(), [&](uint8_t* slot, void* owner) {
    if (slot == again) {
      EXPECT_EQ(owner, nullptr);
    }
    return true;
  });
  // Once empty, it goes to the other size.
  pool.Free(small[4], kPage);
  pool.Free(small[7], kPage);
  EXPECT_EQ(pool.Allocate(2 * kPage), arena.data() + 4 * kPage);
  EXPECT_FALSE(pool.draining());
}

TEST(SlotPoolTest, LastExtentIsShorter) {
  // 5 slots of 2 pages, extents of 4 pages (2 slots): 2 + 2 + 1.
  MemoryMapping arena = Arena(10 * kPage);
  SlotPool pool(arena.data(), arena.size_bytes(), 4 * kPage);
  int n = 0;
  while (pool.Allocate(2 * kPage) != nullptr) ++n;
  EXPECT_EQ(n, 5);
  EXPECT_EQ(pool.used_bytes(), 10 * kPage);
}

TEST(SlotPoolTest, SlotLargerThanTheExtentStillFits) {
  MemoryMapping arena = Arena(8 * kPage);
  SlotPool pool(arena.data(), arena.size_bytes(), kPage);
  EXPECT_NE(pool.Allocate(3 * kPage), nullptr);
  EXPECT_NE(pool.Allocate(3 * kPage), nullptr);
  EXPECT_FALSE(pool.CanAllocate(3 * kPage));
  EXPECT_EQ(pool.Allocate(3 * kPage), nullptr);
  EXPECT_TRUE(pool.CanAllocate(kPage));  // two pages are still uncarved
  EXPECT_NE(pool.Allocate(kPage), nullptr);
}

TEST(SlotPoolTest, CanAllocateAgreesWithAllocate) {
  MemoryMapping arena = Arena(64 * kPage);
  SlotPool pool(arena.data(), arena.size_bytes(), 6 * kPage);
  const uint64_t sizes[] = {100, kPage, 6144, 3 * kPage};
  std::mt19937_64 rng(42);
  std::vector<std::pair<uint8_t*, uint64_t>> held;  // (slot, block bytes)
  uint64_t used = 0;
  for (int step = 0; step < 5000; ++step) {
    if (held.empty() || rng() % 3 != 0) {
      const uint64_t bytes = sizes[rng() % std::size(sizes)];
      const bool can = pool.CanAllocate(bytes);
      uint8_t* s = pool.Allocate(bytes);
      ASSERT_EQ(can, s != nullptr) << "step " << step << " bytes " << bytes;
      if (s != nullptr) {
        held.emplace_back(s, bytes);
        used += SlotPool::StrideFor(bytes);
      }
    } else {
      const size_t i = rng() % held.size();
      pool.Free(held[i].first, held[i].second);
      used -= SlotPool::StrideFor(held[i].second);
      held[i] = held.back();
      held.pop_back();
    }
    ASSERT_EQ(pool.used_bytes(), used) << "step " << step;
    ASSERT_LE(pool.used_bytes(), pool.capacity_bytes());
  }
  std::vector<std::pair<uint8_t*, uint64_t>> strided;
  for (const auto& [s, bytes] : held) strided.emplace_back(s, SlotPool::StrideFor(bytes));
  ExpectDisjoint(strided);
}

TEST(SlotPoolDeathTest, FreeOfAForeignPointerAborts) {
  MemoryMapping arena = Arena(4 * kPage);
  SlotPool pool(arena.data(), arena.size_bytes(), kPage);  // one page carved at a time
  uint8_t* s = pool.Allocate(kPage);
  ASSERT_EQ(s, arena.data());
  EXPECT_DEATH(pool.Free(arena.data() + 3 * kPage, kPage), "CHECK failed");  // never carved
}

TEST(SlotPoolDeathTest, UnalignedArenaAborts) {
  MemoryMapping arena = Arena(4 * kPage);
  EXPECT_DEATH(SlotPool(arena.data() + 8, 2 * kPage), "CHECK failed");
}

}  // namespace
}  // namespace kvtier
