// BlockCache's quotas and extent reclaim with a disk tier below: a tenant at
// its host quota demotes its blocks to disk instead of dropping them; a
// tenant at its disk quota forgets its own oldest disk blocks to make room
// for new ones; a second block size empties extents of the first by writing
// their dirty blocks back, with bounded work per try. The disk tier is real
// (RocksDB index in a temporary directory) over the memory and
// fault-injecting devices (the block-device seam). Also DiskWriteLog, the
// per-tenant record log the disk quota evicts from.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <deque>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "tests/tiers/disk/cache_loop.h"
#include "tests/tiers/disk/faulty_device.h"
#include "tests/tiers/disk/memory_device.h"
#include "tests/tiers/tiers_test_util.h"
#include "tiers/block_cache.h"
#include "tiers/disk/disk_tier.h"
#include "tiers/disk_write_log.h"
#include "devices/host_backend.h"

namespace kvtier {
namespace {

using namespace std::chrono_literals;
using tiers_test::EngineMemory;
using tiers_test::SmallSpec;

constexpr uint64_t kRegionBytes = 64 << 10;
constexpr TenantId kTenant = 3;
constexpr size_t kHost = static_cast<size_t>(Tier::kHost);
constexpr size_t kDisk = static_cast<size_t>(Tier::kDisk);

struct QuotaConfig {
  uint64_t hbm_slots = 0;  // of 8 KiB (SmallSpec()'s stride)
  uint64_t host_slots = 64;
  uint64_t disk_regions = 64;
  TierWatermarks host_marks = {.high = 1.0, .low = 1.0};  // no write-back unless a test asks
  uint32_t max_writes_in_flight = 1024;
  bool disk = true;  // false: no disk tier
};

// The cache runs on the test thread: `post` queues closures that Drain runs
// here.
class QuotaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kvtier-quota-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    backend_ = HostBackend::Create({.copy_threads = 2}).value();
    engine_ = EngineMemory::Create(*backend_, SmallSpec(), 64).value();
    ASSERT_EQ(engine_->block_bytes(), 6144u);
  }
  void TearDown() override {
    if (faulty_) faulty_->ReleaseWrites();
    if (cache_ && !Drain([&] { return cache_->inflight_copies() == 0 && DiskInflight() == 0; })) {
      (void)cache_.release();  // copies in flight: the test failed; do not crash the others
    }
    cache_.reset();
    disk_.reset();
    std::filesystem::remove_all(dir_);
  }

  uint64_t DiskInflight() const { return disk_ ? disk_->inflight() : 0; }

  void Open(const QuotaConfig& c) {
    const BlockCache::Post post = loop_.post();
    if (c.disk) OpenDisk(c, post);
    const uint64_t stride = SlotPool::StrideFor(engine_->block_bytes());
    BlockCache::Options o{.backend = backend_.get(),
                          .post = post,
                          .hbm_bytes = c.hbm_slots * stride,
                          .host_bytes = c.host_slots * stride,
                          .hbm_watermarks = {},
                          .host_watermarks = c.host_marks,
                          .prefix_aware = true,
                          .eviction_scan_limit = 1024,
                          .disk = disk_.get(),
                          .disk_min_hits = 0,
                          .disk_promotion_min_hits = 0,
                          .disk_write_budget_bytes_per_day = 0,
                          .disk_write_through = false,
                          .disk_max_writes_in_flight = c.max_writes_in_flight,
                          .clock = nullptr};
    cache_ = BlockCache::Create(std::move(o)).value();
    cache_->SetTenantName(kTenant, "quota-test");
  }
  void OpenDisk(const QuotaConfig& c, const BlockCache::Post& post) {
    memory_ = std::make_unique<MemoryDevice>(c.disk_regions * kRegionBytes);
    faulty_ = std::make_unique<FaultyDevice>(memory_.get());
    disk_ = tiers_test::OpenDiskUnder(&cache_, {faulty_.get()}, dir_ + "/index", kRegionBytes, post).value();
  }

  bool Drain(const std::function<bool()>& until) { return loop_.Drain(until); }
  // Every copy and disk operation done, and what they posted run.
  bool Settle() {
    return Drain([&] {
      if (cache_->inflight_copies() != 0 || DiskInflight() != 0) return false;
      return loop_.empty();
    });
  }

  std::vector<StoredKey> NewKeys(size_t n) {
    std::vector<StoredKey> keys(n);
    for (auto& k : keys) {
      for (auto& b : k.bytes) b = static_cast<uint8_t>(rng_());
    }
    return keys;
  }

  OpOutcome StoreInto(EngineMemory& engine, const StoredKey& key, uint32_t block) {
    engine.Fill(block, key);
    OpOutcome out;
    bool done = false;
    cache_->Store(kTenant, std::span(&key, 1), std::span(&block, 1), std::nullopt,
                  EngineTarget{engine.layout(), engine.mapping()}, owner_, [&](OpOutcome o) {
                    out = std::move(o);
                    done = true;
                  });
    EXPECT_TRUE(Drain([&] { return done; }));
    return out;
  }
  OpOutcome Store(const StoredKey& key, uint32_t block) { return StoreInto(*engine_, key, block); }
  // Stores each key, letting copies and disk writes settle after each.
  void StoreSettled(const std::vector<StoredKey>& keys) {
    for (size_t i = 0; i < keys.size(); ++i) {
      const OpOutcome o = Store(keys[i], static_cast<uint32_t>(i % 32));
      ASSERT_TRUE(o.status.ok()) << "block " << i << ": " << o.status;
      ASSERT_EQ(o.blocks, 1u);
      ASSERT_TRUE(Settle());
    }
  }
  // Loads `key` into engine block 40 (of `engine`): true when it loaded the
  // key's bytes; other bytes fail the test.
  bool LoadExact(const StoredKey& key, EngineMemory* engine = nullptr) {
    EngineMemory& e = engine != nullptr ? *engine : *engine_;
    const uint32_t block = 40;
    e.Zero(block);
    bool done = false;
    OpOutcome out;
    cache_->Load(kTenant, std::span(&key, 1), std::span(&block, 1),
                 EngineTarget{e.layout(), e.mapping()}, owner_, [&](OpOutcome o) {
                   out = std::move(o);
                   done = true;
                 });
    EXPECT_TRUE(Drain([&] { return done; }));
    if (out.blocks == 0) return false;
    const bool exact = e.Holds(block, key);
    EXPECT_TRUE(exact) << "a load returned bytes that differ from what was stored";
    return exact;
  }
  // The tier of each key, or 255 for a miss.
  std::vector<Tier> TiersOf(const std::vector<StoredKey>& keys) {
    std::vector<Tier> t;
    for (const StoredKey& k : keys) {
      const CacheLookup r = cache_->Lookup(kTenant, std::span(&k, 1));
      t.push_back(r.hits == 1 ? r.tiers[0] : Tier{255});
    }
    return t;
  }
  uint64_t BlockBytes() const { return engine_->block_bytes(); }

  tiers_test::CacheLoop loop_;  // first: the tier and the cache post to it until they are gone
  std::string dir_;
  std::mt19937_64 rng_{7};
  std::shared_ptr<void> owner_ = std::make_shared<int>(0);
  std::unique_ptr<HostBackend> backend_;
  std::unique_ptr<EngineMemory> engine_;
  std::unique_ptr<MemoryDevice> memory_;
  std::unique_ptr<FaultyDevice> faulty_;
  std::unique_ptr<DiskTier> disk_;
  std::unique_ptr<BlockCache> cache_;
};

// A host quota well under the tier: the tenant's coldest blocks go to disk
// (written back, not dropped), and come back from there as disk hits. Before,
// a tenant at its host quota had its coldest block dropped outright, so it
// never used the disk at all.
TEST_F(QuotaTest, HostQuotaSendsTheTenantsColdBlocksToDiskNotAway) {
  Open({.host_slots = 64});
  TenantQuota quota;
  quota.bytes[kHost] = 8 * BlockBytes();
  cache_->SetQuota(kTenant, quota);
  const std::vector<StoredKey> keys = NewKeys(40);
  StoreSettled(keys);
  EXPECT_LE(cache_->TenantUsedBytes(kTenant, Tier::kHost), 8 * BlockBytes());
  EXPECT_EQ(cache_->ShareOf(kTenant).evictions[kHost], 0u) << "nothing was dropped";
  EXPECT_EQ(cache_->counters().disk_demotions, 32u);
  EXPECT_EQ(cache_->TenantUsedBytes(kTenant, Tier::kDisk), 32 * BlockBytes());
  const uint64_t disk_hits_before = cache_->ShareOf(kTenant).hits[kDisk];
  const std::vector<Tier> tiers = TiersOf(keys);
  for (size_t i = 0; i < keys.size(); ++i) {
    EXPECT_EQ(tiers[i], i < 32 ? Tier::kDisk : Tier::kHost) << "block " << i;
  }
  EXPECT_EQ(cache_->ShareOf(kTenant).hits[kDisk] - disk_hits_before, 32u);
  for (size_t i = 0; i < 32; ++i) EXPECT_TRUE(LoadExact(keys[i])) << "block " << i;
  EXPECT_EQ(cache_->counters().disk_promotions, 32u) << "read back from disk";
}

// Loads of the tenant's blocks on disk read them up into host within its
// host quota: each read sends the tenant's colder host blocks back to disk
// (they are clean: their records are there), so it never holds more of host
// than its quota, and no block is lost. Before, a read into host was not
// held to the owner's host quota: after these loads the tenant held 40
// blocks of host, five times its quota, taking room others' blocks were
// evicted for.
TEST_F(QuotaTest, DiskReadsIntoHostStayWithinTheOwnersHostQuota) {
  Open({.host_slots = 64});
  TenantQuota quota;
  quota.bytes[kHost] = 8 * BlockBytes();
  cache_->SetQuota(kTenant, quota);
  const std::vector<StoredKey> keys = NewKeys(40);
  StoreSettled(keys);
  ASSERT_EQ(cache_->counters().disk_demotions, 32u);
  for (size_t i = 0; i < 32; ++i) {
    EXPECT_TRUE(LoadExact(keys[i])) << "block " << i;
    // (A block on its way back to disk counts as leaving, as for a store:
    // once its write is done, it has left.)
    ASSERT_TRUE(Settle());
    EXPECT_LE(cache_->TenantUsedBytes(kTenant, Tier::kHost), 8 * BlockBytes()) << "after the load of block " << i;
  }
  EXPECT_EQ(cache_->counters().disk_promotions, 32u) << "read back from disk";
  EXPECT_EQ(cache_->ShareOf(kTenant).evictions[kHost], 0u) << "nothing was dropped";
  ASSERT_TRUE(Settle());
  for (const Tier t : TiersOf(keys)) EXPECT_NE(t, Tier{255}) << "a block was lost";
  for (size_t i = 32; i < 40; ++i) EXPECT_TRUE(LoadExact(keys[i])) << "block " << i;
  EXPECT_LE(cache_->TenantUsedBytes(kTenant, Tier::kHost), 8 * BlockBytes());
}

// A load of more of the tenant's disk blocks than its host quota holds is
// served whole: the reads past the quota take free host room for the
// load's time and go back to disk when it is over, so the tenant is within
// its quota again once the load is done, and no other tenant's block went
// for them (free room only). Before, reads under way were not counted
// against the quota: one load read all 24 blocks into host with room made
// as for any read, and the tenant held 27 blocks of host after it, almost
// seven times its quota.
TEST_F(QuotaTest, ALoadOfMoreDiskBlocksThanTheHostQuotaIsServedWholeAndNotKept) {
  Open({.host_slots = 64});
  TenantQuota quota;
  quota.bytes[kHost] = 4 * BlockBytes();
  cache_->SetQuota(kTenant, quota);
  const std::vector<StoredKey> keys = NewKeys(32);
  StoreSettled(keys);
  ASSERT_EQ(cache_->counters().disk_demotions, 28u);
  constexpr uint32_t kLoad = 24;  // all on disk
  std::vector<uint32_t> blocks(kLoad);
  for (uint32_t i = 0; i < kLoad; ++i) {
    blocks[i] = 32 + i;
    engine_->Zero(blocks[i]);
  }
  bool done = false;
  OpOutcome out;
  cache_->Load(kTenant, std::span(keys.data(), kLoad), blocks, EngineTarget{engine_->layout(), engine_->mapping()},
               owner_, [&](OpOutcome o) {
                 out = std::move(o);
                 done = true;
               });
  ASSERT_TRUE(Drain([&] { return done; }));
  ASSERT_TRUE(out.status.ok()) << out.status;
  EXPECT_EQ(out.blocks, kLoad) << "the load ended where the host quota was full";
  for (uint32_t i = 0; i < out.blocks; ++i) EXPECT_TRUE(engine_->Holds(blocks[i], keys[i])) << "block " << i;
  ASSERT_TRUE(Settle());
  EXPECT_LE(cache_->TenantUsedBytes(kTenant, Tier::kHost), 4 * BlockBytes()) << "after the load";
  EXPECT_GE(cache_->counters().reads_past_quota, kLoad - 4);
  EXPECT_EQ(cache_->counters().reads_not_kept, cache_->counters().reads_past_quota);
  EXPECT_EQ(cache_->ShareOf(kTenant).evictions[kHost], 0u) << "nothing was dropped";
  for (const Tier t : TiersOf(keys)) EXPECT_NE(t, Tier{255}) << "a block was lost";
  for (uint32_t i = 0; i < kLoad; ++i) EXPECT_TRUE(LoadExact(keys[i])) << "block " << i << ", again";
  ASSERT_TRUE(Settle());
  EXPECT_LE(cache_->TenantUsedBytes(kTenant, Tier::kHost), 4 * BlockBytes());
}

// The store does not wait for the writes of the blocks over quota: a block
// being written counts as leaving, so the tenant holds at most its quota plus
// its writes in flight (here at most two); past that, its coldest is dropped.
TEST_F(QuotaTest, StoresOverTheHostQuotaDoNotWaitForTheWritesAndStayBounded) {
  Open({.host_slots = 64, .max_writes_in_flight = 2});
  TenantQuota quota;
  quota.bytes[kHost] = 4 * BlockBytes();
  cache_->SetQuota(kTenant, quota);
  const std::vector<StoredKey> first = NewKeys(4);
  StoreSettled(first);
  faulty_->HoldWrites();
  const std::vector<StoredKey> more = NewKeys(4);
  for (size_t i = 0; i < more.size(); ++i) {
    const OpOutcome o = Store(more[i], static_cast<uint32_t>(10 + i));
    ASSERT_TRUE(o.status.ok()) << "block " << i << ": " << o.status;
    EXPECT_LE(cache_->TenantUsedBytes(kTenant, Tier::kHost), (4 + 2) * BlockBytes())
        << "block " << i;
  }
  EXPECT_EQ(cache_->pending_disk_writes(), 2u);
  EXPECT_EQ(cache_->ShareOf(kTenant).evictions[kHost], 2u) << "the writes in flight were the limit";
  faulty_->ReleaseWrites();
  ASSERT_TRUE(Settle());
  EXPECT_LE(cache_->TenantUsedBytes(kTenant, Tier::kHost), 4 * BlockBytes());
  EXPECT_EQ(TiersOf({first[0], first[1]}), (std::vector<Tier>{Tier::kDisk, Tier::kDisk}));
  EXPECT_TRUE(LoadExact(first[0]));
  EXPECT_TRUE(LoadExact(first[1]));
  for (const StoredKey& k : more) EXPECT_TRUE(LoadExact(k));
}

// hbm blocks demoted for a tenant with no host quota left: its host coldest
// goes to disk to make room, instead of the hbm block being dropped.
TEST_F(QuotaTest, HbmDemotionPastTheHostQuotaMakesRoomOnDisk) {
  Open({.hbm_slots = 4, .host_slots = 64});
  TenantQuota quota;
  quota.bytes[kHost] = 2 * BlockBytes();
  cache_->SetQuota(kTenant, quota);
  const std::vector<StoredKey> keys = NewKeys(12);
  StoreSettled(keys);
  EXPECT_GT(cache_->counters().demotions, 2u);
  EXPECT_GT(cache_->counters().disk_demotions, 0u);
  EXPECT_LE(cache_->TenantUsedBytes(kTenant, Tier::kHost), 2 * BlockBytes());
  for (const Tier t : TiersOf(keys)) EXPECT_NE(t, Tier{255}) << "a block was dropped";
  for (const StoredKey& k : keys) EXPECT_TRUE(LoadExact(k));
}

// A tenant at its disk quota keeps writing: its own oldest disk blocks are
// forgotten to make room (counted as its disk evictions), its newest stay on
// disk as hits, and its disk usage stays within the quota. Before, every new
// block past the quota was dropped ("not admitted") and its disk contents
// froze with the oldest blocks.
TEST_F(QuotaTest, DiskQuotaEvictsTheTenantsOldestDiskBlocks) {
  Open({.host_slots = 8, .host_marks = {.high = 0.9, .low = 0.5}});
  TenantQuota quota;
  quota.bytes[kDisk] = 10 * BlockBytes();
  cache_->SetQuota(kTenant, quota);
  const std::vector<StoredKey> keys = NewKeys(80);
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(Store(keys[i], static_cast<uint32_t>(i % 32)).status.ok()) << i;
    ASSERT_TRUE(Settle());
    ASSERT_LE(cache_->TenantUsedBytes(kTenant, Tier::kDisk), 10 * BlockBytes())
        << "after block " << i;
  }
  const CacheCounters c = cache_->counters();
  EXPECT_EQ(c.disk_not_admitted, 0u);
  EXPECT_GT(c.disk_demotions, 60u) << "blocks kept being written";
  EXPECT_GT(c.disk_quota_evictions, 50u);
  EXPECT_EQ(cache_->ShareOf(kTenant).evictions[kDisk], c.disk_quota_evictions);
  EXPECT_EQ(cache_->TenantUsedBytes(kTenant, Tier::kDisk), 10 * BlockBytes());
  // What is on disk is the newest blocks written there; the oldest went.
  const std::vector<Tier> tiers = TiersOf(keys);
  std::vector<StoredKey> on_disk;
  size_t newest_disk = 0, last_memory = keys.size();
  for (size_t i = 0; i < keys.size(); ++i) {
    if (tiers[i] == Tier::kDisk) {
      on_disk.push_back(keys[i]);
      newest_disk = i;
    } else if (tiers[i] != Tier{255} && last_memory == keys.size()) {
      last_memory = i;
    }
  }
  ASSERT_EQ(on_disk.size(), 10u);
  EXPECT_EQ(newest_disk + 1, last_memory) << "the blocks on disk are the ones written last";
  for (size_t i = 0; i + 30 < keys.size(); ++i) EXPECT_EQ(tiers[i], Tier{255}) << "old block " << i;
  EXPECT_LE(disk_->live_records(), 10u + cache_->Usage(Tier::kHost).blocks);
  for (const StoredKey& k : on_disk) EXPECT_TRUE(LoadExact(k));
}

// A second block size arrives while the first holds the whole host tier and
// write-back is running (its writes stalled). The second size's stores go
// through (after at most a few refusals while an extent drains), and the
// first size's dirty blocks emptied out of the extents are written to disk
// and load from there, none lost. Before, the extent's dirty blocks were
// dropped.
TEST_F(QuotaTest, ASecondBlockSizeDrainsExtentsToDiskWithoutLosingBlocks) {
  // 2 MiB of host: extents of 32 KiB, four 8 KiB slots of the first size.
  Open({.host_slots = 256, .disk_regions = 128, .max_writes_in_flight = 4});
  const std::vector<StoredKey> a = NewKeys(256);
  StoreSettled(a);
  ASSERT_EQ(cache_->Usage(Tier::kHost).blocks, 256u);
  // Write-back starts on the coldest four, and the disk stalls.
  faulty_->HoldWrites();
  cache_->SetWatermarks({}, {.high = 0.99, .low = 0.98});
  ASSERT_EQ(cache_->pending_disk_writes(), 4u);

  std::unique_ptr<EngineMemory> b_owned = EngineMemory::Create(*backend_, SmallSpec(2), 64).value();
  EngineMemory& b_engine = *b_owned;
  ASSERT_EQ(SlotPool::StrideFor(b_engine.block_bytes()), 4096u);
  const std::vector<StoredKey> b = NewKeys(48);
  uint32_t refusals = 0;
  for (uint32_t i = 0; i < b.size(); ++i) {
    OpOutcome o = StoreInto(b_engine, b[i], i);
    for (int tries = 0; !o.status.ok() && tries < 3; ++tries) {
      ASSERT_EQ(o.status.code(), StatusCode::kResourceExhausted) << o.status;
      EXPECT_NE(o.status.message().find("being emptied"), std::string::npos) << o.status;
      ++refusals;
      faulty_->ReleaseWrites();
      ASSERT_TRUE(Settle());
      o = StoreInto(b_engine, b[i], i);
    }
    ASSERT_TRUE(o.status.ok()) << "block " << i << ": " << o.status;
  }
  faulty_->ReleaseWrites();
  ASSERT_TRUE(Settle());
  EXPECT_GE(cache_->counters().extents_reclaimed, 2u);
  EXPECT_LE(refusals, 48u / 8u + 2u) << "one short wait per extent at most";
  EXPECT_EQ(cache_->ShareOf(kTenant).evictions[kHost], 0u) << "no dirty block was dropped";
  size_t a_on_disk = 0;
  for (const Tier t : TiersOf(a)) {
    EXPECT_NE(t, Tier{255}) << "a block of the first size was lost";
    a_on_disk += t == Tier::kDisk;
  }
  EXPECT_GE(a_on_disk, 24u);
  // Everything gets a disk copy, so that the loads below (which read blocks
  // up from disk into a full host tier) evict clean blocks, never lose one.
  cache_->FlushToDisk();
  ASSERT_TRUE(Settle());
  for (const StoredKey& k : b) EXPECT_TRUE(LoadExact(k, &b_engine));
  for (const StoredKey& k : a) EXPECT_TRUE(LoadExact(k));
}

// Emptying an extent for another size looks at that extent's slots, not at
// the whole tier: a tier of 4096 blocks (extents of 64 slots) costs a few
// extents' worth per reclaim. The old code walked the tier's whole LRU list
// on every call.
TEST_F(QuotaTest, EmptyingAnExtentLooksAtItsSlotsNotTheWholeTier) {
  // 32 MiB: extents of 512 KiB, 64 slots of the first size. No disk tier:
  // the extent's blocks are dropped, and the second size gets room at once.
  Open({.host_slots = 4096, .disk = false});
  const std::vector<StoredKey> a = NewKeys(4096);
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_TRUE(Store(a[i], static_cast<uint32_t>(i % 32)).status.ok()) << i;
  }
  ASSERT_TRUE(Settle());
  ASSERT_EQ(cache_->Usage(Tier::kHost).blocks, 4096u);
  std::unique_ptr<EngineMemory> b_engine =
      EngineMemory::Create(*backend_, SmallSpec(2), 64).value();
  const std::vector<StoredKey> b = NewKeys(64);
  const uint64_t examined_before = cache_->counters().extent_slots_examined;
  for (uint32_t i = 0; i < b.size(); ++i) {
    OpOutcome o = StoreInto(*b_engine, b[i], i);
    for (int tries = 0; !o.status.ok() && tries < 3; ++tries) {
      ASSERT_TRUE(Settle());
      o = StoreInto(*b_engine, b[i], i);
    }
    ASSERT_TRUE(o.status.ok()) << "block " << i << ": " << o.status;
  }
  ASSERT_TRUE(Settle());
  const CacheCounters c = cache_->counters();
  ASSERT_GT(c.extents_reclaimed, 0u);
  const uint64_t examined = c.extent_slots_examined - examined_before;
  EXPECT_GT(examined, 0u);
  // Each try looks at a few candidate extents of 64 slots, at most.
  EXPECT_LE(examined, c.extents_reclaimed * 2 * 4 * 64)
      << "the old code walked 4096 blocks per try";
  EXPECT_LT(examined, 4096u);
}

TEST(DiskWriteLogTest, KeepsTheLiveRecordsInWriteOrderAndStaysBounded) {
  DiskWriteLog log;
  std::set<uint64_t> live;  // by `where`, which is the record's number here
  std::mt19937_64 rng(1);
  auto is_live = [&](const DiskWriteLog::Record& r) { return live.count(r.where) > 0; };
  uint64_t next = 0;
  uint64_t oldest_seen = 0;
  size_t most_held = 0;
  for (int round = 0; round < 200000; ++round) {
    DiskWriteLog::Record r;
    r.where = next++;
    log.Push(r);
    live.insert(r.where);
    // Most records go away by other means, at random: the log is not told.
    while (live.size() > 100)
      live.erase(std::next(live.begin(), static_cast<long>(rng() % live.size())));
    log.Compact(is_live, live.size(), 4);
    // Now and then the owner takes the oldest, skipping stale ones: they
    // come out in write order.
    if (round % 7 == 0) {
      while (const DiskWriteLog::Record* o = log.Oldest()) {
        ASSERT_GE(o->where, oldest_seen) << "out of write order";
        oldest_seen = o->where;
        const bool was_live = is_live(*o);
        log.PopOldest();
        if (was_live) {
          live.erase(oldest_seen);
          break;
        }
      }
    }
    most_held = std::max(most_held, log.held());
  }
  EXPECT_LE(most_held, 2 * 100 + DiskWriteLog::kSlack + 2 * 100 + 64)
      << "the log kept its stale entries";
  // Every live record is still in the log, in order.
  std::vector<uint64_t> rest;
  while (const DiskWriteLog::Record* o = log.Oldest()) {
    if (is_live(*o)) rest.push_back(o->where);
    log.PopOldest();
  }
  EXPECT_EQ(rest, std::vector<uint64_t>(live.begin(), live.end()));
}

}  // namespace
}  // namespace kvtier
