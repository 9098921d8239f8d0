#include "tiers/disk_only_index.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/layout.h"
#include "tests/tiers/open_table_test_util.h"

namespace kvtier {
namespace {

StoredKey RandomKey(std::mt19937_64& rng) {
  StoredKey k;
  for (auto& b : k.bytes) b = static_cast<uint8_t>(rng());
  return k;
}

// A key whose low 64 bits (its hash in DiskOnlyIndex) are `low`.
StoredKey KeyWithLow64(std::mt19937_64& rng, uint64_t low) {
  StoredKey k = RandomKey(rng);
  for (size_t i = 0; i < 8; ++i) k.bytes[15 - i] = static_cast<uint8_t>(low >> (8 * i));
  return k;
}

// Random inserts and erases against a model, through many growths: after
// every batch (every few calls while a growth migrates), each live key is
// found with its value, recently erased and never-inserted keys are not, and
// during a migration ForEach visits exactly the live set once. `key_of`
// makes the keys; a skewed one piles them into long probe runs that wrap
// around the end of the table.
template <typename KeyOf>
void RunModel(uint64_t seed, int steps, KeyOf&& key_of) {
  std::mt19937_64 rng(seed);
  DiskOnlyIndex index;
  std::unordered_map<StoredKey, uint32_t, Key128Hash> model;
  std::vector<StoredKey> keys, erased;
  int migrations = 0, checked_during_migration = 0;
  bool was_migrating = false;
  auto check = [&](int step) {
    ASSERT_EQ(index.size(), model.size()) << "step " << step;
    for (const auto& [key, bytes] : model) {
      const DiskOnlyBlock* b = index.Find(key);
      ASSERT_NE(b, nullptr) << "live key lost at step " << step;
      ASSERT_EQ(b->key, key);
      ASSERT_EQ(b->block_bytes, bytes);
    }
    for (size_t i = erased.size() > 16 ? erased.size() - 16 : 0; i < erased.size(); ++i) {
      ASSERT_EQ(index.Find(erased[i]), nullptr) << "erased key found at step " << step;
    }
    for (int i = 0; i < 4; ++i) ASSERT_EQ(index.Find(key_of(rng)), nullptr);
    if (index.table_stats().migrating) {
      ++checked_during_migration;
      std::unordered_set<StoredKey, Key128Hash> seen;
      index.ForEach([&](const DiskOnlyBlock& b) {
        EXPECT_TRUE(seen.insert(b.key).second) << "visited twice at step " << step;
        EXPECT_EQ(model.count(b.key), 1u) << "visited a dead key at step " << step;
      });
      ASSERT_EQ(seen.size(), model.size()) << "step " << step;
    }
  };
  for (int step = 0; step < steps; ++step) {
    if (rng() % 3 != 0 || keys.empty()) {
      DiskOnlyBlock b;
      b.key = key_of(rng);
      if (model.count(b.key) != 0) continue;
      b.block_bytes = static_cast<uint32_t>(step);
      index.Insert(b);
      model[b.key] = b.block_bytes;
      keys.push_back(b.key);
    } else {
      const size_t i = rng() % keys.size();
      DiskOnlyBlock* b = index.Find(keys[i]);
      ASSERT_NE(b, nullptr);
      index.Erase(b);
      model.erase(keys[i]);
      erased.push_back(keys[i]);
      keys[i] = keys.back();
      keys.pop_back();
    }
    const bool migrating = index.table_stats().migrating;
    if (migrating && !was_migrating) ++migrations;
    was_migrating = migrating;
    if (step % (migrating ? 61 : 997) == 0) {
      check(step);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
  check(steps);
  EXPECT_GE(migrations, 8) << "the test should cross several growths";
  EXPECT_GE(checked_during_migration, 20);
}

TEST(DiskOnlyIndexTest, InsertFindEraseAgainstAModel) {
  std::mt19937_64 rng(1);
  DiskOnlyIndex index;
  std::unordered_map<StoredKey, uint32_t, Key128Hash> model;
  std::vector<StoredKey> keys;
  for (int step = 0; step < 200000; ++step) {
    const int op = static_cast<int>(rng() % 3);
    if (op < 2 || keys.empty()) {
      DiskOnlyBlock b;
      b.key = RandomKey(rng);
      b.set_offset_bytes((rng() % (DiskOnlyBlock::kOffsetLimitBytes / 4096)) * 4096);
      b.block_bytes = static_cast<uint32_t>(step);
      index.Insert(b);
      model[b.key] = b.block_bytes;
      keys.push_back(b.key);
    } else {
      const size_t i = rng() % keys.size();
      DiskOnlyBlock* b = index.Find(keys[i]);
      ASSERT_NE(b, nullptr);
      EXPECT_EQ(b->block_bytes, model[keys[i]]);
      index.Erase(b);
      model.erase(keys[i]);
      keys[i] = keys.back();
      keys.pop_back();
    }
  }
  EXPECT_EQ(index.size(), model.size());
  for (const auto& [key, bytes] : model) {
    const DiskOnlyBlock* b = index.Find(key);
    ASSERT_NE(b, nullptr);
    EXPECT_EQ(b->block_bytes, bytes);
  }
  size_t seen = 0;
  index.ForEach([&](const DiskOnlyBlock&) { ++seen; });
  EXPECT_EQ(seen, model.size());
  EXPECT_EQ(index.Find(RandomKey(rng)), nullptr);
}

TEST(DiskOnlyIndexTest, ModelHoldsAcrossGrowthMigrations) {
  RunModel(3, 60000, [](std::mt19937_64& rng) { return RandomKey(rng); });
}

// One key in eight hashed into the last 1/64 of the table makes a long probe
// run that wraps around its end, through every growth: the migration starts
// with the first slots, which hold the tail of that run.
TEST(DiskOnlyIndexTest, ModelHoldsWithRunsThatWrapAroundTheEnd) {
  RunModel(4, 40000, [](std::mt19937_64& rng) {
    return rng() % 8 == 0 ? KeyWithLow64(rng, ~uint64_t{0} - (rng() >> 6)) : RandomKey(rng);
  });
}

// All keys homed at the very last slot: one run, wrapping, through a growth.
TEST(DiskOnlyIndexTest, OneRunWrappingAroundTheEndSurvivesGrowth) {
  std::mt19937_64 rng(5);
  DiskOnlyIndex index;
  std::vector<StoredKey> keys;
  for (uint32_t n = 0; n < 200; ++n) {
    DiskOnlyBlock b;
    b.key = KeyWithLow64(rng, ~uint64_t{0} - n);
    b.block_bytes = n;
    index.Insert(b);
    keys.push_back(b.key);
    if (n % 3 == 2) {  // erase one from the middle of the run
      const size_t i = rng() % keys.size();
      index.Erase(index.Find(keys[i]));
      keys.erase(keys.begin() + static_cast<std::ptrdiff_t>(i));
    }
    for (const StoredKey& k : keys) ASSERT_NE(index.Find(k), nullptr) << "after " << n;
  }
}

// Erase leaves no tombstone behind: churn at a constant size never starts a
// growth (a tombstone table must rebuild every so often) and never touches
// the capacity.
TEST(DiskOnlyIndexTest, ChurnAtConstantSizeNeverRebuilds) {
  std::mt19937_64 rng(6);
  DiskOnlyIndex index;
  std::vector<StoredKey> keys;
  for (int i = 0; i < 3000; ++i) {
    DiskOnlyBlock b;
    b.key = RandomKey(rng);
    index.Insert(b);
    keys.push_back(b.key);
  }
  auto churn = [&] {
    const size_t i = rng() % keys.size();
    index.Erase(index.Find(keys[i]));
    DiskOnlyBlock b;
    b.key = keys[i] = RandomKey(rng);
    index.Insert(b);
  };
  while (index.table_stats().migrating) churn();
  const size_t capacity = index.capacity();
  for (int step = 0; step < 200000; ++step) {
    churn();
    ASSERT_FALSE(index.table_stats().migrating) << "step " << step;
  }
  EXPECT_EQ(index.capacity(), capacity);
  EXPECT_EQ(index.size(), keys.size());
  for (const StoredKey& k : keys) ASSERT_NE(index.Find(k), nullptr);
}

// While a growth migrates, each Insert or Erase moves at most
// kMigrateSlotsPerCall slots of the old table, and the migration ends within
// old capacity / kMigrateSlotsPerCall calls.
TEST(DiskOnlyIndexTest, EachCallMigratesABoundedNumberOfSlots) {
  std::mt19937_64 rng(7);
  DiskOnlyIndex index;
  std::vector<StoredKey> keys;
  int migrations = 0;
  for (int step = 0; step < 100000; ++step) {
    const OpenTableStats before = index.table_stats();
    if (rng() % 4 != 0 || keys.empty()) {
      DiskOnlyBlock b;
      b.key = RandomKey(rng);
      index.Insert(b);
      keys.push_back(b.key);
    } else {
      const size_t i = rng() % keys.size();
      index.Erase(index.Find(keys[i]));
      keys[i] = keys.back();
      keys.pop_back();
    }
    const OpenTableStats after = index.table_stats();
    if (tiers_test::ExpectBoundedMigrationStep(before, after)) {
      ++migrations;
      EXPECT_GE(after.capacity * 10, before.capacity * 14) << "grows by about half";
      EXPECT_LE(after.capacity * 10, before.capacity * 16) << "grows by about half";
    }
    if (HasFailure()) {
      ADD_FAILURE() << "at step " << step;
      return;
    }
  }
  EXPECT_GE(migrations, 8);
}

// Record offsets past 16 TiB (where 32-bit page numbers end) up to the 2 PiB
// limit come back exactly, next to every other field at its maximum; an
// offset whose low 32 bits of pages are zero is still a block, not an empty
// slot.
TEST(DiskOnlyIndexTest, OffsetsPast16TiBRoundTrip) {
  constexpr uint64_t k16TiB = uint64_t{1} << 44;
  const std::vector<uint64_t> offsets = {0,
                                         4096,
                                         k16TiB - 4096,
                                         k16TiB,
                                         k16TiB + 4096,
                                         3 * k16TiB,
                                         30720ull * 1000 * 1000 * 1000 / 4096 * 4096,
                                         kMaxDiskPathBytes - 8192,
                                         DiskOnlyBlock::kOffsetLimitBytes - 4096};
  std::mt19937_64 rng(8);
  DiskOnlyIndex index;
  std::vector<StoredKey> keys;
  for (uint64_t offset : offsets) {
    DiskOnlyBlock b;
    b.key = RandomKey(rng);
    b.set_offset_bytes(offset);
    b.block_bytes = Layout::kMaxBlockBytes;
    b.checksum = UINT64_MAX - offset;
    b.bare = 0;
    b.owner = b.ns = UINT16_MAX;
    b.hits = DiskOnlyBlock::kMaxHits;
    b.packed = 1;
    b.device = UINT8_MAX;
    ASSERT_EQ(b.offset_bytes(), offset);
    index.Insert(b);
    keys.push_back(b.key);
  }
  ASSERT_EQ(index.size(), offsets.size());
  for (size_t i = 0; i < offsets.size(); ++i) {
    const DiskOnlyBlock* b = index.Find(keys[i]);
    ASSERT_NE(b, nullptr) << "offset " << offsets[i];
    EXPECT_EQ(b->offset_bytes(), offsets[i]);
    EXPECT_EQ(b->block_bytes, Layout::kMaxBlockBytes);
    EXPECT_EQ(b->checksum, UINT64_MAX - offsets[i]);
    EXPECT_EQ(b->bare, 0u);
    EXPECT_EQ(b->hits, DiskOnlyBlock::kMaxHits);
    EXPECT_EQ(b->packed, 1u);
    EXPECT_EQ(b->device, UINT8_MAX);
  }
  size_t seen = 0;
  index.ForEach([&](const DiskOnlyBlock&) { ++seen; });
  EXPECT_EQ(seen, offsets.size());
}

TEST(DiskOnlyIndexDeathTest, AnOffsetPastTheLimitIsABrokenInvariant) {
  DiskOnlyBlock b;
  EXPECT_DEATH(b.set_offset_bytes(DiskOnlyBlock::kOffsetLimitBytes),
               "must be 4 KiB aligned and below 2 PiB");
  EXPECT_DEATH(b.set_offset_bytes((uint64_t{1} << 44) + 1),
               "must be 4 KiB aligned and below 2 PiB");
}

TEST(DiskOnlyIndexTest, CostsAtMostEightyBytesPerBlock) {
  std::mt19937_64 rng(2);
  DiskOnlyIndex index;
  for (size_t n = 1; n <= 300000; ++n) {
    DiskOnlyBlock b;
    b.key = RandomKey(rng);
    index.Insert(b);
    if (n >= 1000 && n % 997 == 0) {
      const double per_block = static_cast<double>(index.capacity() * sizeof(DiskOnlyBlock)) / index.size();
      ASSERT_LE(per_block, 80.0) << "at " << n << " blocks";
      // While a growth migrates, both tables are mapped, the old one given
      // back as it empties: about 125 bytes per block at the start.
      const double mapped = static_cast<double>(index.table_stats().bytes) / index.size();
      ASSERT_LE(mapped, 130.0) << "at " << n << " blocks";
    }
  }
}

}  // namespace
}  // namespace kvtier
