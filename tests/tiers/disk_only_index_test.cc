#include "tiers/disk_only_index.h"

#include <random>
#include <unordered_map>

#include <gtest/gtest.h>

namespace kvtier {
namespace {

StoredKey RandomKey(std::mt19937_64& rng) {
  StoredKey k;
  for (auto& b : k.bytes) b = static_cast<uint8_t>(rng());
  return k;
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
      b.offset_pages = static_cast<uint32_t>(rng());
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

TEST(DiskOnlyIndexTest, CostsAtMostSixtyFourBytesPerBlock) {
  std::mt19937_64 rng(2);
  DiskOnlyIndex index;
  for (size_t n = 1; n <= 300000; ++n) {
    DiskOnlyBlock b;
    b.key = RandomKey(rng);
    index.Insert(b);
    if (n >= 1000 && n % 997 == 0) {
      const double per_block = static_cast<double>(index.capacity() * sizeof(DiskOnlyBlock)) / index.size();
      ASSERT_LE(per_block, 64.0) << "at " << n << " blocks";
    }
  }
}

}  // namespace
}  // namespace kvtier
