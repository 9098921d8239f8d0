// The disk tier under the block cache: round trips through all three tiers,
// shared reads, corruption and injected faults (never served), region
// reclaim, and warm restarts from the RocksDB index. Devices are the memory
// and fault-injecting fakes (the block-device seam); everything else is real.
#include "tiers/disk/disk_tier.h"

#include <gtest/gtest.h>
#include <rocksdb/db.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <numeric>
#include <mutex>
#include <random>
#include <set>

#include "common/block_pattern.h"
#include "common/mutex.h"
#include "tests/tiers/disk/cache_loop.h"
#include "tests/tiers/disk/small_volume.h"
#include "tests/tiers/disk/faulty_device.h"
#include "tests/tiers/disk/memory_device.h"
#include "tests/tiers/tiers_test_util.h"
#include "tiers/block_cache.h"
#include "devices/host_backend.h"

namespace kvtier {
namespace {

using namespace std::chrono_literals;

// Five records of SmallSpec's 6 KiB blocks (bare records of two pages) a
// region: the tests below count on it.
constexpr uint64_t kRegionBytes = 5 * 8192;
constexpr TenantId kTenant = 0;

// What a KV-event consumer learns: every test of this file runs with it, so
// each one's reclaims, faults, moves and restarts check that a block is
// announced present in a tier once, gone only once present, and that at the
// end the announcements add up to what the cache holds (ForEachPresent).
class PresenceTracker final : public TierListener {
 public:
  using Held = std::set<std::pair<std::string, Presence>>;
  void OnBlockPresent(const StoredKey& key, TenantId, uint32_t, Presence tier) override {
    std::lock_guard lock(mu_);
    EXPECT_TRUE(held_.emplace(key.ToHex(), tier).second) << key.ToHex() << " announced twice in tier " << int(tier);
  }
  void OnBlockGone(const StoredKey& key, TenantId, uint32_t, Presence tier) override {
    std::lock_guard lock(mu_);
    EXPECT_EQ(held_.erase({key.ToHex(), tier}), 1u) << key.ToHex() << " gone from tier " << int(tier)
                                                    << " where it was not";
    ++gone_;
  }
  // Each block's disk record carries its key (checked after restarts).
  std::string DiskAnnotation(const StoredKey& key, TenantId) override { return "key " + key.ToHex(); }
  Held held() const {
    std::lock_guard lock(mu_);
    return held_;
  }
  void Reset(Held held) {
    std::lock_guard lock(mu_);
    held_ = std::move(held);
  }
  uint64_t gone() const {
    std::lock_guard lock(mu_);
    return gone_;
  }
  static Held Of(BlockCache& cache) {
    Held now;
    cache.ForEachPresent([&](const StoredKey& key, TenantId, uint32_t, Presence tier) {
      EXPECT_TRUE(now.emplace(key.ToHex(), tier).second);
    });
    return now;
  }

 private:
  mutable std::mutex mu_;
  Held held_;
  uint64_t gone_ = 0;
};
using tiers_test::EngineMemory;
using tiers_test::SmallSpec;

class DiskTierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kvtier-disk-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    index_path_ = dir_ + "/index";
    backend_ = HostBackend::Create({.copy_threads = 2}).value();
    Result<std::unique_ptr<EngineMemory>> engine = EngineMemory::Create(*backend_, SmallSpec(), 64);
    ASSERT_TRUE(engine.has_value()) << engine.error();
    engine_ = std::move(*engine);
    ASSERT_EQ(kRegionBytes, 5 * RecordBytes(engine_->block_bytes()));
    memory_ = std::make_unique<MemoryDevice>(16 * kRegionBytes);
    faulty_ = std::make_unique<FaultyDevice>(memory_.get());
  }
  void TearDown() override {
    Close();
    std::filesystem::remove_all(dir_);
  }

  // Opens the disk tier (on the faulty wrapper of the memory device) and a
  // cache over it, adopting what the index holds.
  void Open(uint64_t hbm_slots = 0, uint64_t host_slots = 8, TierWatermarks host_marks = {.high = 0.9, .low = 0.5},
            uint64_t budget_per_day = 0, bool write_through = false) {
    const BlockCache::Post post = loop_.post();
    Result<std::unique_ptr<DiskTier>> disk =
        tiers_test::OpenDiskUnder(&cache_, {faulty_.get()}, index_path_, kRegionBytes, post);
    ASSERT_TRUE(disk.has_value()) << disk.error();
    disk_ = std::move(*disk);
    const uint64_t stride = SlotPool::StrideFor(engine_->block_bytes());
    // Loads' completions held back when the test asks (holding_).
    if (hold_loads_ && !holding_) holding_ = std::make_unique<tiers_test::HoldingBackend>(backend_.get());
    BlockCache::Options o{.backend = holding_ ? static_cast<DeviceBackend*>(holding_.get()) : backend_.get(),
                          .post = post,
                          .hbm_bytes = hbm_slots * stride,
                          .host_bytes = host_slots * stride,
                          .hbm_watermarks = {},
                          .host_watermarks = host_marks,
                          .prefix_aware = true,
                          .eviction_scan_limit = 1024,
                          .disk = disk_.get(),
                          .disk_min_hits = 0,
                          .disk_admit_on_reuse = admit_on_reuse_,
                          .disk_admit_learned = admit_learned_,
                          .disk_gate_sample_every = gate_sample_every_,
                          .disk_promotion_min_hits = promotion_min_hits_,
                          .disk_write_budget_bytes_per_day = budget_per_day,
                          .disk_write_through = write_through,
                          .disk_max_writes_in_flight = max_writes_in_flight_,
                          .listener = &presence_,
                          .clock = [this] { return now_; }};
    cache_ = BlockCache::Create(std::move(o)).value();
    cache_->SetTenantName(kTenant, "t0");
    std::vector<DiskRecord> records = disk_->TakeRecovered();
    for (const DiskRecord& r : records) {
      EXPECT_EQ(r.header.annotation, "key " + r.header.key.ToHex()) << "the annotation came back from the index";
    }
    recovered_ += records.size();
    adopted_ = cache_->AdoptDiskRecords(std::move(records));
    presence_.Reset(PresenceTracker::Of(*cache_));  // a restart's snapshot
  }
  void Close() {
    if (cache_) {
      EXPECT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
      const PresenceTracker::Held now = PresenceTracker::Of(*cache_);
      EXPECT_EQ(presence_.held(), now) << "the announcements do not add up";
      for (Presence p : {Presence::kHbm, Presence::kHost, Presence::kDisk, Presence::kRemote}) {
        const auto n = std::count_if(now.begin(), now.end(), [&](const auto& held) { return held.second == p; });
        EXPECT_EQ(cache_->present_blocks(p), static_cast<uint64_t>(n)) << PresenceName(p);
      }
    }
    cache_.reset();
    disk_.reset();
  }

  bool Drain(const std::function<bool()>& until, std::chrono::seconds timeout = 30s) {
    return loop_.Drain(until, timeout);
  }

  EngineTarget Target() { return {engine_->layout(), engine_->mapping()}; }

  std::vector<StoredKey> NewKeys(size_t n) {
    std::vector<StoredKey> keys(n);
    for (auto& k : keys) {
      for (auto& b : k.bytes) b = static_cast<uint8_t>(rng_());
    }
    return keys;
  }

  OpOutcome Store(const StoredKey& key, uint32_t block) {
    engine_->Fill(block, key);
    OpOutcome out;
    bool done = false;
    cache_->Store(kTenant, std::span(&key, 1), std::span(&block, 1), std::nullopt, Target(), owner_,
                  [&](OpOutcome o) {
                    out = std::move(o);
                    done = true;
                  });
    EXPECT_TRUE(Drain([&] { return done; }));
    return out;
  }
  // Stores `keys` as one request (a chain, each from engine block i),
  // letting demotions settle after it.
  void StoreRequest(const std::vector<StoredKey>& keys) {
    std::vector<uint32_t> blocks(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      blocks[i] = static_cast<uint32_t>(i);
      engine_->Fill(blocks[i], keys[i]);
    }
    bool done = false;
    cache_->Store(kTenant, keys, blocks, std::nullopt, Target(), owner_, [&](OpOutcome o) {
      EXPECT_TRUE(o.status.ok()) << o.status;
      done = true;
    });
    ASSERT_TRUE(Drain([&] { return done && cache_->inflight_copies() == 0; }));
  }
  // Stores each key from its own engine block, letting demotions settle
  // after each (at the pace of a disk that keeps up).
  void StoreAll(const std::vector<StoredKey>& keys) {
    for (size_t i = 0; i < keys.size(); ++i) {
      ASSERT_TRUE(Store(keys[i], static_cast<uint32_t>(i % 32)).status.ok());
      ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0; }));
    }
  }

  std::shared_ptr<std::pair<bool, OpOutcome>> LoadAsync(const StoredKey& key, uint32_t block) {
    engine_->Zero(block);
    auto r = std::make_shared<std::pair<bool, OpOutcome>>();
    cache_->Load(kTenant, std::span(&key, 1), std::span(&block, 1), Target(), owner_, [r](OpOutcome o) {
      r->second = std::move(o);
      r->first = true;
    });
    return r;
  }
  // Loads into engine block 40: true if it loaded and holds the key's bytes.
  // A load that returns other bytes fails the test outright.
  bool LoadExact(const StoredKey& key) {
    auto r = LoadAsync(key, 40);
    EXPECT_TRUE(Drain([&] { return r->first; }));
    if (r->second.blocks == 0) return false;
    const bool exact = engine_->Holds(40, key);
    EXPECT_TRUE(exact) << "a load returned bytes that differ from what was stored";
    return exact;
  }
  std::vector<Tier> TiersOf(const std::vector<StoredKey>& keys) {
    std::vector<Tier> t;
    for (const StoredKey& k : keys) {
      const CacheLookup r = cache_->Lookup(kTenant, std::span(&k, 1));
      t.push_back(r.hits == 1 ? r.tiers[0] : Tier{255});
    }
    return t;
  }
  // Stores `n` new blocks and flushes them; returns those now on disk.
  std::vector<StoredKey> StoreFlushed(size_t n) {
    const std::vector<StoredKey> keys = NewKeys(n);
    StoreAll(keys);
    EXPECT_GT(cache_->FlushToDisk(), 0u);
    EXPECT_TRUE(Drain([&] { return cache_->inflight_copies() == 0; }));
    return OnDisk(keys);
  }
  // Opens, stores 20 new blocks and closes; returns those on disk.
  std::vector<StoredKey> FillDiskAndClose() {
    Open();
    const std::vector<StoredKey> keys = NewKeys(20);
    StoreAll(keys);
    std::vector<StoredKey> disk = OnDisk(keys);
    Close();
    return disk;
  }
  std::vector<StoredKey> OnDisk(const std::vector<StoredKey>& keys) {
    std::vector<StoredKey> out;
    const std::vector<Tier> t = TiersOf(keys);
    for (size_t i = 0; i < keys.size(); ++i) {
      if (t[i] == Tier::kDisk) out.push_back(keys[i]);
    }
    return out;
  }

  // The tier's RocksDB index opened directly (the tier closed), to inspect
  // or damage it; closed when this goes.
  struct RawIndex {
    explicit RawIndex(const std::string& path) {
      const std::vector<rocksdb::ColumnFamilyDescriptor> cfs = {
          {rocksdb::kDefaultColumnFamilyName, {}}, {"blocks", {}}, {"regions", {}}};
      rocksdb::DB* raw = nullptr;
      EXPECT_TRUE(rocksdb::DB::Open(rocksdb::Options(), path, cfs, &handles, &raw).ok());
      db.reset(raw);
    }
    ~RawIndex() {
      if (!db) return;
      for (rocksdb::ColumnFamilyHandle* h : handles) EXPECT_TRUE(db->DestroyColumnFamilyHandle(h).ok());
      EXPECT_TRUE(db->Close().ok());
    }
    std::unique_ptr<rocksdb::DB> db;
    std::vector<rocksdb::ColumnFamilyHandle*> handles;  // default (the format marker), blocks, regions
  };

  PresenceTracker presence_;    // outlives the cache
  tiers_test::CacheLoop loop_;  // first: the tier and the cache post to it until they are gone
  std::string dir_;
  std::string index_path_;
  uint32_t promotion_min_hits_ = 0;
  bool admit_on_reuse_ = false;
  uint32_t max_writes_in_flight_ = 1024;
  bool hold_loads_ = false;  // set before Open: the cache copies through holding_
  bool admit_learned_ = false;
  uint32_t gate_sample_every_ = 32;
  std::mt19937_64 rng_{42};
  std::unique_ptr<HostBackend> backend_;
  std::unique_ptr<tiers_test::HoldingBackend> holding_;
  std::unique_ptr<EngineMemory> engine_;
  std::unique_ptr<MemoryDevice> memory_;
  std::unique_ptr<FaultyDevice> faulty_;
  std::unique_ptr<DiskTier> disk_;
  std::unique_ptr<BlockCache> cache_;
  std::shared_ptr<void> owner_ = std::make_shared<int>(0);
  uint64_t adopted_ = 0;
  uint64_t recovered_ = 0;  // records the restarts gave back, annotations checked
  std::chrono::steady_clock::time_point now_{};  // the manual clock
};

TEST_F(DiskTierTest, RoundTripThroughAllThreeTiersIsByteExact) {
  Open(/*hbm_slots=*/4, /*host_slots=*/8);
  const std::vector<StoredKey> keys = NewKeys(30);
  StoreAll(keys);
  const CacheCounters c = cache_->counters();  // a snapshot, read again below
  EXPECT_EQ(c.evictions[static_cast<size_t>(Tier::kHost)], 0u) << "host blocks go to disk, not away";
  EXPECT_GT(c.demotions, 0u);
  EXPECT_GT(c.disk_demotions, 0u);
  EXPECT_GT(cache_->Usage(Tier::kDisk).blocks, 0u);
  EXPECT_EQ(disk_->counters().writes, c.disk_demotions);
  // Announced as they moved: hbm to host to disk, each a gone and a present.
  std::set<Presence> tiers;
  for (const auto& [key, tier] : presence_.held()) tiers.insert(tier);
  EXPECT_EQ(tiers, (std::set<Presence>{Presence::kHbm, Presence::kHost, Presence::kDisk}));
  EXPECT_GE(presence_.gone(), c.demotions + c.disk_demotions);
  for (const StoredKey& k : keys) EXPECT_TRUE(LoadExact(k));
  EXPECT_GT(cache_->counters().disk_promotions, 0u);
  EXPECT_EQ(cache_->counters().disk_read_failures, 0u);
  EXPECT_TRUE(Drain([&] { return cache_->inflight_copies() == 0; }));
  EXPECT_EQ(cache_->leases(), 0u);
}

TEST_F(DiskTierTest, FlushWritesEveryHostBlockInGroupCommits) {
  Open(/*hbm_slots=*/0, /*host_slots=*/16, TierWatermarks{.high = 1.0, .low = 1.0});
  const std::vector<StoredKey> keys = NewKeys(12);
  StoreAll(keys);
  EXPECT_EQ(cache_->Usage(Tier::kDisk).blocks, 0u);
  EXPECT_EQ(cache_->FlushToDisk(), 12u);
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
  EXPECT_EQ(disk_->counters().writes, 12u);
  EXPECT_LT(disk_->counters().group_commits, 12u) << "records written together share a sync";
  EXPECT_EQ(cache_->Usage(Tier::kDisk).blocks, 12u);
  EXPECT_EQ(cache_->FlushToDisk(), 0u) << "nothing left to write";
  Close();
  Open();
  EXPECT_EQ(adopted_, 12u);
  for (const StoredKey& k : keys) EXPECT_TRUE(LoadExact(k));
}

// A key that is only on disk is present: storing it again is "already
// stored", never a second copy (which, once demoted, met its first one in the
// disk-only table and aborted the daemon; found replaying the Mooncake trace).
TEST_F(DiskTierTest, StoringAKeyThatIsOnlyOnDiskIsAlreadyStored) {
  Open(/*hbm_slots=*/0, /*host_slots=*/16, TierWatermarks{.high = 1.0, .low = 1.0});
  const std::vector<StoredKey> keys = NewKeys(2);
  StoreAll(keys);
  EXPECT_EQ(cache_->FlushToDisk(), 2u);
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
  ASSERT_EQ(cache_->Usage(Tier::kDisk).blocks, 2u);
  const OpOutcome again = Store(keys[1], 5);
  ASSERT_TRUE(again.status.ok()) << again.status;
  EXPECT_EQ(again.blocks, 0u);
  EXPECT_EQ(again.already, 1u);
  EXPECT_EQ(cache_->FlushToDisk(), 0u);
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
  EXPECT_EQ(cache_->Usage(Tier::kDisk).blocks, 2u);
  for (const StoredKey& k : keys) EXPECT_TRUE(LoadExact(k));
}

TEST_F(DiskTierTest, WriteBudgetLimitsDemotionsPerDay) {
  // A budget of three records a day.
  Open(0, 8, {.high = 0.9, .low = 0.5}, 3 * RecordBytes(engine_->block_bytes()));
  std::vector<StoredKey> keys = NewKeys(20);
  StoreAll(keys);
  EXPECT_EQ(cache_->counters().disk_demotions, 3u);
  EXPECT_GT(cache_->counters().disk_over_budget, 0u);
  EXPECT_EQ(disk_->counters().writes, 3u);
  // Twelve hours later half a day's budget is back.
  now_ += std::chrono::hours(12);
  const std::vector<StoredKey> more = NewKeys(10);
  StoreAll(more);
  EXPECT_EQ(cache_->counters().disk_demotions, 4u);  // 1.5 records' worth: one more
  now_ += std::chrono::hours(48);                    // the bucket holds one day at most
  StoreAll(NewKeys(20));
  EXPECT_EQ(cache_->counters().disk_demotions, 4u + 3u);
}

// The NVMe gate: a block leaving host is written only once it has shown
// reuse. One-offs are dropped; a block hit in host, or stored again after
// host let it go unwritten, is written.
TEST_F(DiskTierTest, TheReuseGateWritesOnlyBlocksThatShowedReuse) {
  admit_on_reuse_ = true;
  Open();
  const std::vector<StoredKey> once = NewKeys(12);
  StoreAll(once);
  EXPECT_EQ(cache_->counters().disk_demotions, 0u);
  EXPECT_GT(cache_->counters().disk_not_admitted, 0u);
  const uint64_t dropped = cache_->counters().disk_not_admitted;
  // A block hit while in host is written when it leaves.
  const std::vector<StoredKey> hot = NewKeys(1);
  StoreAll(hot);
  ASSERT_TRUE(LoadExact(hot[0]));
  StoreAll(NewKeys(12));
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
  EXPECT_EQ(cache_->counters().disk_demotions, 1u);
  EXPECT_TRUE(LoadExact(hot[0])) << "from disk";
  // The first blocks, stored again after they were dropped, are written
  // when they leave this time.
  StoreAll({once.begin(), once.begin() + 4});
  StoreAll(NewKeys(12));
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
  EXPECT_EQ(cache_->counters().disk_admitted_on_return, 4u);
  EXPECT_EQ(cache_->counters().disk_demotions, 5u);
  EXPECT_GE(cache_->counters().disk_not_admitted, dropped + 12u);
  for (size_t i = 0; i < 4; ++i) EXPECT_TRUE(LoadExact(once[i])) << i;
}

// The learned NVMe gate: a class of request whose blocks are never hit on
// disk stops being written (but for its samples), while blocks of a class
// that is hit keep being written before they showed any reuse themselves.
TEST_F(DiskTierTest, TheLearnedGateStopsWritingAClassThatIsNeverHit) {
  admit_learned_ = true;
  gate_sample_every_ = 2;
  Open();
  // Rounds of one request of 4 blocks (class 3), read back two rounds
  // later, and four of 1 block (class 1) that nobody reads: 320 blocks
  // through a disk of 80 records, reclaimed region by region.
  std::vector<std::vector<StoredKey>> longs;
  for (int round = 0; round < 40; ++round) {
    longs.push_back(NewKeys(4));
    StoreRequest(longs.back());
    for (int i = 0; i < 4; ++i) StoreRequest(NewKeys(1));
    if (round >= 2) {
      for (const StoredKey& k : longs[static_cast<size_t>(round) - 2]) EXPECT_TRUE(LoadExact(k)) << round;
      // The write-back the reads started ends before the next store, which
      // would otherwise drop an unwritten block to make room.
      ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0; }));
    }
    if (round == 3) {
      EXPECT_EQ(cache_->counters().disk_not_admitted, 0u) << "nothing refused before it learned";
    }
  }
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
  EXPECT_GT(disk_->counters().regions_reclaimed, 16u);
  EXPECT_GT(cache_->counters().disk_not_admitted, 0u);
  // Now: a fresh request of the hit class, then 24 one-block requests.
  const uint64_t refused = cache_->counters().disk_not_admitted;
  const uint64_t written = cache_->counters().disk_demotions;
  const std::vector<StoredKey> fresh = NewKeys(4);
  StoreRequest(fresh);
  for (int i = 0; i < 24; ++i) StoreRequest(NewKeys(1));
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
  for (const StoredKey& k : fresh) EXPECT_TRUE(LoadExact(k)) << "written though never hit: its class is";
  // Of the one-block requests that left host (at least 16), only the
  // samples (every second) were written.
  const uint64_t more_refused = cache_->counters().disk_not_admitted - refused;
  const uint64_t more_written = cache_->counters().disk_demotions - written;
  EXPECT_GE(more_refused, 8u);
  EXPECT_LE(more_written, 4u + 12u + 1u);
}

// A load's reads that find host full of blocks not on disk yet, and none of
// them on its way there (host at or under its watermark, the rest of it the
// load's own reads), write back the coldest of those blocks for room and
// wait for it: a disk hit is not lost to the watermark, and nothing is
// dropped (serve.py's 2k-token probe from disk lost 50 reads this way and
// was computed again).
TEST_F(DiskTierTest, ALoadsReadsWriteBackForRoomWhereNoneIsOnItsWay) {
  Open();  // a host of 8 blocks, written back from above 7.2 down to 4
  const std::vector<StoredKey> old = NewKeys(12);
  StoreAll(old);
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
  const std::vector<StoredKey> on_disk = OnDisk(old);
  ASSERT_GE(on_disk.size(), 6u);
  const uint64_t in_host = cache_->Usage(Tier::kHost).blocks;
  ASSERT_GE(in_host, 3u) << "blocks not on disk yet stay in host under the watermark";
  const uint64_t dropped = cache_->counters().evictions[static_cast<size_t>(Tier::kHost)];
  const uint64_t written = cache_->counters().disk_demotions;
  // One load of more disk blocks than host has free slots.
  const std::vector<StoredKey> keys(on_disk.begin(), on_disk.begin() + 6);
  const std::vector<uint32_t> blocks = {40, 41, 42, 43, 44, 45};
  for (uint32_t b : blocks) engine_->Zero(b);
  OpOutcome out;
  bool done = false;
  cache_->Load(kTenant, keys, blocks, Target(), owner_, [&](OpOutcome o) {
    out = std::move(o);
    done = true;
  });
  ASSERT_TRUE(Drain([&] { return done; }));
  ASSERT_TRUE(out.status.ok()) << out.status;
  EXPECT_EQ(out.blocks, 6u);
  for (size_t i = 0; i < keys.size(); ++i) EXPECT_TRUE(engine_->Holds(blocks[i], keys[i])) << i;
  EXPECT_EQ(cache_->counters().disk_reads_without_room, 0u);
  EXPECT_EQ(cache_->counters().evictions[static_cast<size_t>(Tier::kHost)], dropped) << "nothing dropped for it";
  EXPECT_GT(cache_->counters().disk_demotions, written) << "written back for room";
}

// A read from disk takes free room or a clean block's slot, never the slot
// of a block that is not on disk yet (that block would be lost to save one
// that is safe): with host full of unwritten blocks it waits while host's
// writes are under way, and misses when none is (write-back paused by a
// failing disk). Nothing is dropped either way.
TEST_F(DiskTierTest, AReadFromDiskNeverDropsABlockThatIsNotOnDiskYet) {
  Open();  // a host of 8 blocks, written back from above 7.2 down to 4
  const std::vector<StoredKey> old = NewKeys(12);
  StoreAll(old);
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
  const std::vector<StoredKey> on_disk = OnDisk(old);
  ASSERT_GE(on_disk.size(), 2u);
  // Four more onto a disk that stalls: host is full, its four coldest
  // blocks are being written and the other four are not on disk.
  faulty_->HoldWrites();
  for (const StoredKey& k : NewKeys(4)) ASSERT_TRUE(Store(k, 0).status.ok());
  ASSERT_TRUE(
      Drain([&] { return cache_->pending_disk_writes() == 4 && faulty_->held_writes() > 0; }));
  ASSERT_EQ(cache_->Usage(Tier::kHost).blocks, 8u);
  const uint64_t dropped = cache_->counters().evictions[static_cast<size_t>(Tier::kHost)];
  auto load = LoadAsync(on_disk[0], 40);
  EXPECT_FALSE(Drain([&] { return load->first; }, 1s)) << "the read waits for the writes";
  faulty_->ReleaseWrites();
  ASSERT_TRUE(Drain([&] { return load->first; }));
  EXPECT_EQ(load->second.blocks, 1u);
  EXPECT_TRUE(engine_->Holds(40, on_disk[0]));
  EXPECT_EQ(cache_->counters().evictions[static_cast<size_t>(Tier::kHost)], dropped);
  EXPECT_EQ(cache_->counters().disk_reads_waited_for_room, 1u);
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
  // Now every write fails and write-back pauses (the test's clock stands
  // still): eight stores fill host with unwritten blocks, nothing leaves.
  faulty_->FailAll(FaultOp::kWrite, EIO);
  const std::vector<StoredKey> unwritten = NewKeys(8);
  StoreAll(unwritten);  // each write tried (and failed) before the next store
  ASSERT_EQ(cache_->Usage(Tier::kHost).blocks, 8u);
  ASSERT_GT(cache_->counters().disk_write_failures, 0u);
  const uint64_t before = cache_->counters().evictions[static_cast<size_t>(Tier::kHost)];
  EXPECT_FALSE(LoadExact(on_disk[1])) << "a miss: no room, and none coming";
  EXPECT_EQ(cache_->counters().evictions[static_cast<size_t>(Tier::kHost)], before);
  EXPECT_EQ(cache_->counters().disk_reads_without_room, 1u);
  for (const StoredKey& k : unwritten) EXPECT_TRUE(LoadExact(k));
  // Once the disk works again, the block is read.
  faulty_->ClearFaults();
  now_ += 1s;
  StoreAll(NewKeys(1));
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
  EXPECT_TRUE(LoadExact(on_disk[1]));
}

TEST_F(DiskTierTest, HotBlocksSurviveTheReclaimOfTheirRegion) {
  Open();
  // The first region holds two blocks that are read between reclaims and
  // three that never are.
  const std::vector<StoredKey> first = NewKeys(5);
  const std::vector<StoredKey> hot(first.begin(), first.begin() + 2);
  StoreAll(first);
  ASSERT_GT(cache_->FlushToDisk(), 0u);
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0; }));
  // Five rounds of 40 cold blocks: the disk (16 regions of 5 records) wraps
  // twice over, and the hot blocks are read once per round, as an LRU cache
  // of this size would keep them.
  std::vector<StoredKey> cold;
  for (int round = 0; round < 5; ++round) {
    for (const StoredKey& k : hot) ASSERT_TRUE(LoadExact(k)) << "round " << round;
    const std::vector<StoredKey> more = NewKeys(40);
    StoreAll(more);
    cold.insert(cold.end(), more.begin(), more.end());
  }
  EXPECT_GT(disk_->counters().regions_reclaimed, 16u);
  EXPECT_GT(cache_->counters().disk_reinsertions, 0u);
  for (const StoredKey& k : hot) EXPECT_TRUE(LoadExact(k)) << "a hot block was lost to a reclaim";
  size_t cold_hits = 0;
  for (size_t i = 2; i < 5; ++i) cold_hits += LoadExact(first[i]);
  for (size_t i = 0; i < 20; ++i) cold_hits += LoadExact(cold[i]);
  EXPECT_EQ(cold_hits, 0u) << "the oldest cold blocks went with their regions";
}

TEST_F(DiskTierTest, AReclaimAlwaysFreesItsRegionWhenEveryBlockIsHot) {
  Open();
  // Every block is read after it reached disk, so every region is full of
  // hot blocks, and the disk wraps ten times over. Each reclaim carries
  // forward at most three quarters of its region and drops the rest: regions are
  // reclaimed, no write waits for good, and every load is exact or a miss.
  std::vector<StoredKey> all;
  for (int round = 0; round < 20; ++round) {
    const std::vector<StoredKey> keys = NewKeys(40);
    StoreAll(keys);
    // A hit on each that is still there (carried blocks of earlier rounds
    // take some of the room, as CLOCK keeps what was used); the newest
    // always is.
    for (const StoredKey& k : keys) cache_->Lookup(kTenant, std::span(&k, 1));
    EXPECT_EQ(cache_->Lookup(kTenant, std::span(&keys.back(), 1)).hits, 1u) << "round " << round;
    all.insert(all.end(), keys.begin(), keys.end());
  }
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
  const DiskCounters& d = disk_->counters();
  EXPECT_GE(d.regions_reclaimed, 16u * 10) << "the disk wrapped fewer than ten times";
  EXPECT_GT(d.records_carried, 0u);
  EXPECT_GT(cache_->counters().disk_reinsertions_dropped, 0u);
  EXPECT_EQ(cache_->counters().disk_write_failures, 0u);
  EXPECT_EQ(cache_->counters().store_rejected, 0u);
  EXPECT_EQ(cache_->leases(), 0u);
  // Every record the disk lists is a block's, and the disk is not over-full.
  EXPECT_LE(disk_->used_bytes(), disk_->capacity_bytes());
  size_t loaded = 0;
  for (const StoredKey& k : all) loaded += LoadExact(k);
  EXPECT_GT(loaded, 0u);
  EXPECT_LE(loaded, 80u + 8u);
}

TEST_F(DiskTierTest, WriteThroughKeepsBlocksInMemoryAndMakesRestartsWarm) {
  Open(0, 16, {.high = 1.0, .low = 1.0}, 0, /*write_through=*/true);
  const std::vector<StoredKey> keys = NewKeys(6);
  StoreAll(keys);
  EXPECT_EQ(disk_->counters().writes, 6u);
  EXPECT_EQ(TiersOf(keys), std::vector<Tier>(6, Tier::kHost)) << "still served from memory";
  EXPECT_EQ(cache_->FlushToDisk(), 0u) << "every block is clean";
  Close();
  Open();
  EXPECT_EQ(adopted_, 6u);
  for (const StoredKey& k : keys) EXPECT_TRUE(LoadExact(k));
}

TEST_F(DiskTierTest, WriteThroughStaysWarmWhileTheDiskWraps) {
  // Write-through promises every host block is on disk. When the disk wraps
  // and a reclaim drops the disk copy of a block still in host, that block
  // is written again, so a restart finds whatever host held.
  Open(/*hbm_slots=*/0, /*host_slots=*/8, {.high = 0.9, .low = 0.5}, /*budget_per_day=*/0,
       /*write_through=*/true);
  const std::vector<StoredKey> keys =
      NewKeys(400);  // the disk holds 80: it wraps more than three times
  StoreAll(keys);
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
  ASSERT_GT(disk_->counters().regions_reclaimed, 3u * 16);
  std::vector<StoredKey> in_host;
  const std::vector<Tier> tiers = TiersOf(keys);
  for (size_t i = 0; i < keys.size(); ++i) {
    if (tiers[i] == Tier::kHost) in_host.push_back(keys[i]);
  }
  ASSERT_FALSE(in_host.empty());
  Close();
  Open(0, 8, {.high = 0.9, .low = 0.5}, 0, true);
  for (const StoredKey& k : in_host)
    EXPECT_TRUE(LoadExact(k)) << "a write-through block in host was not on disk";
}

// The eviction orders' own state stays what it stands for while every tier
// fills and the disk wraps: blocks set aside as held by their children have
// children in their tier, and the blocks marked clean are those the disk
// holds (read up from disk, written through a flush, their records
// reclaimed under them).
TEST_F(DiskTierTest, TheEvictionOrdersStayTrueWhileEveryTierWraps) {
  Open(/*hbm_slots=*/0, /*host_slots=*/8);
  std::mt19937_64 rng(48);
  std::vector<std::vector<StoredKey>> chains;
  uint64_t held = 0, marked = 0;  // the most seen at once
  for (int step = 0; step < 160; ++step) {
    if (chains.empty() || rng() % 3 != 0) {
      chains.push_back(NewKeys(4));
      StoreRequest(chains.back());
    } else {
      const std::vector<StoredKey>& chain = chains[rng() % chains.size()];
      for (const StoredKey& k : chain) {
        if (!LoadExact(k)) break;  // evicted: the prefix ends there
      }
    }
    if (step % 20 == 19) {
      cache_->FlushToDisk();
      ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
    }
    const Result<BlockCache::OrderCounts> orders = cache_->CheckOrders();
    ASSERT_TRUE(orders.has_value()) << "step " << step << ": " << orders.error();
    held = std::max(held, orders->held);
    marked = std::max(marked, orders->marked);
  }
  EXPECT_GT(held, 0u) << "parents were set aside";
  EXPECT_GT(marked, 0u) << "clean blocks were marked";
  EXPECT_GT(disk_->counters().regions_reclaimed, 0u) << "the disk wrapped";
  EXPECT_GT(cache_->counters().disk_promotions, 0u) << "blocks were read up from disk (clean in host)";
  EXPECT_GT(cache_->counters().disk_demotions, 0u) << "blocks were written back";
}

TEST_F(DiskTierTest, ABlockReadFromDiskStaysInHostOnlyOnceItIsHot) {
  promotion_min_hits_ = 4;
  Open();
  const std::vector<StoredKey> on_disk = StoreFlushed(6);  // written: no hits since
  ASSERT_FALSE(on_disk.empty());
  const StoredKey k = on_disk[0];
  // One hit so far (StoreFlushed's lookup). Each load is exact; while the
  // block has had fewer than 4 hits since it was written, it goes back to
  // disk once loaded.
  ASSERT_TRUE(LoadExact(k));                // 2 hits
  EXPECT_EQ(TiersOf({k})[0], Tier::kDisk);  // 3
  EXPECT_EQ(cache_->counters().disk_hits_not_promoted, 1u);
  EXPECT_EQ(cache_->counters().disk_promotions, 1u) << "the load read it from disk";
  // Hot now: the next load leaves it in host.
  ASSERT_TRUE(LoadExact(k));  // 4
  EXPECT_EQ(TiersOf({k})[0], Tier::kHost);
  EXPECT_EQ(cache_->counters().disk_hits_not_promoted, 1u);
  EXPECT_EQ(cache_->counters().disk_promotions, 2u);
  ASSERT_TRUE(LoadExact(k));  // from host: no read
  EXPECT_EQ(cache_->counters().disk_promotions, 2u);
}

TEST_F(DiskTierTest, TwoLoadsOfADiskBlockShareOneRead) {
  Open();
  const std::vector<StoredKey> keys = NewKeys(12);
  StoreAll(keys);
  const std::vector<StoredKey> disk = OnDisk(keys);
  ASSERT_FALSE(disk.empty());
  const uint64_t reads = disk_->counters().reads;
  auto a = LoadAsync(disk[0], 41);
  auto b = LoadAsync(disk[0], 42);
  ASSERT_TRUE(Drain([&] { return a->first && b->first; }));
  EXPECT_EQ(a->second.blocks, 1u);
  EXPECT_EQ(b->second.blocks, 1u);
  EXPECT_TRUE(engine_->Holds(41, disk[0]));
  EXPECT_TRUE(engine_->Holds(42, disk[0]));
  EXPECT_EQ(disk_->counters().reads, reads + 1) << "one read for both loads";
  EXPECT_EQ(cache_->counters().disk_promotions, 1u);
}

TEST_F(DiskTierTest, CorruptRecordIsAMissCountedAndNeverServed) {
  Open();
  const std::vector<StoredKey> keys = NewKeys(12);
  StoreAll(keys);
  const std::vector<StoredKey> disk = OnDisk(keys);
  ASSERT_GE(disk.size(), 2u);
  // Flip one payload bit of the first disk block's record, behind the tier's back.
  auto info = cache_->Lookup(kTenant, std::span(&disk[0], 1));
  ASSERT_EQ(info.hits, 1u);
  faulty_->BitFlipOnRead(100, 3);  // the payload of the first record of region 0
  uint32_t failures_before = static_cast<uint32_t>(cache_->counters().disk_read_failures);
  uint32_t served = 0;
  for (const StoredKey& k : disk) served += LoadExact(k);  // LoadExact fails the test on wrong bytes
  EXPECT_EQ(cache_->counters().disk_read_failures, failures_before + 1u);
  EXPECT_EQ(disk_->counters().checksum_failures, 1u);
  EXPECT_EQ(served, disk.size() - 1);
  // The corrupt block was dropped: it now misses instead of failing again.
  size_t missing = 0;
  for (const StoredKey& k : disk) missing += cache_->Lookup(kTenant, std::span(&k, 1)).hits == 0;
  EXPECT_EQ(missing, 1u);
}

TEST_F(DiskTierTest, ReadErrorIsAMissAndTheOtherTiersKeepServing) {
  Open();
  const std::vector<StoredKey> keys = NewKeys(12);
  StoreAll(keys);
  const std::vector<StoredKey> disk = OnDisk(keys);
  ASSERT_FALSE(disk.empty());
  faulty_->FailNth(FaultOp::kRead, 1, EIO);
  EXPECT_FALSE(LoadExact(disk[0]));
  EXPECT_EQ(disk_->counters().io_errors, 1u);
  EXPECT_EQ(cache_->counters().disk_read_failures, 1u);
  for (const StoredKey& k : keys) {
    if (k != disk[0]) {
      EXPECT_TRUE(LoadExact(k));
    }
  }
}

// A read refused for a moment (EAGAIN after the engine's retries, ENOMEM)
// or cancelled says nothing of the record: the load misses, and the record
// stays on disk, for the next load and across a restart. Before, any failed
// read forgot an intact record.
TEST_F(DiskTierTest, ATransientReadErrorKeepsTheRecord) {
  Open();
  const std::vector<StoredKey> keys = NewKeys(12);
  StoreAll(keys);
  const std::vector<StoredKey> disk = OnDisk(keys);
  ASSERT_GE(disk.size(), 2u);
  faulty_->FailNth(FaultOp::kRead, 1, EAGAIN);
  EXPECT_FALSE(LoadExact(disk[0]));
  faulty_->FailNth(FaultOp::kRead, 1, ENOMEM);
  EXPECT_FALSE(LoadExact(disk[1]));
  EXPECT_EQ(cache_->counters().disk_read_failures, 2u);
  EXPECT_EQ(TiersOf({disk[0], disk[1]}), (std::vector<Tier>{Tier::kDisk, Tier::kDisk}));
  EXPECT_TRUE(LoadExact(disk[0]));
  Close();
  Open();
  EXPECT_TRUE(LoadExact(disk[1])) << "an intact record was forgotten";
}

TEST_F(DiskTierTest, WriteErrorsKeepTheBlockOutOfTheDiskIndex) {
  Open();
  faulty_->FailNth(FaultOp::kWrite, 1, ENOSPC);
  faulty_->FailNth(FaultOp::kSync, 2, EIO);
  const std::vector<StoredKey> keys = NewKeys(12);
  StoreAll(keys);
  EXPECT_GE(cache_->counters().disk_write_failures, 2u);
  EXPECT_GE(disk_->counters().io_errors, 2u);
  // Nothing that failed was indexed: after a restart, every recovered record
  // loads exactly.
  Close();
  Open();
  EXPECT_EQ(adopted_, disk_->counters().recovered_records);
  for (const StoredKey& k : OnDisk(keys)) EXPECT_TRUE(LoadExact(k));
}

TEST_F(DiskTierTest, TornWriteIsCaughtOnRead) {
  Open();
  // The first record is two writes: its first page, then its last 2 KiB in
  // a page of their own. Of the second, nothing lands.
  faulty_->TornWriteNth(2, 0);
  const std::vector<StoredKey> keys = NewKeys(12);
  StoreAll(keys);
  uint32_t served = 0;
  const std::vector<StoredKey> disk = OnDisk(keys);
  for (const StoredKey& k : disk) served += LoadExact(k);
  EXPECT_EQ(served, disk.size() - 1);
  EXPECT_EQ(disk_->counters().checksum_failures, 1u);
}

TEST_F(DiskTierTest, RestartIsWarm) {
  const std::vector<StoredKey> disk = FillDiskAndClose();
  ASSERT_GT(disk.size(), 5u);
  Open();
  EXPECT_EQ(adopted_, disk.size());
  EXPECT_EQ(cache_->Usage(Tier::kDisk).blocks, disk.size());
  for (const StoredKey& k : disk) EXPECT_TRUE(LoadExact(k)) << "written before the restart: a hit";
}

// The index's format marker (issue 33): a disk written by a newer release is
// refused with a clear error and left as it was (not read as damaged and
// dropped); one without a marker (an older release's) is read and marked.
TEST_F(DiskTierTest, ADiskOfANewerFormatIsRefusedAndLeftAsItWas) {
  const std::vector<StoredKey> disk = FillDiskAndClose();
  ASSERT_GE(disk.size(), 6u);
  // Reads, rewrites or deletes the marker ("format", u32 little-endian, in
  // the default column family); returns what it held (nullopt: none).
  auto marker = [&](std::optional<uint32_t> write, bool erase = false) {
    RawIndex index(index_path_);
    std::optional<uint32_t> held;
    if (!index.db) return held;
    std::string v;
    if (index.db->Get({}, index.handles[0], "format", &v).ok() && v.size() == 4) {
      uint32_t f = 0;
      std::memcpy(&f, v.data(), 4);
      held = f;
    }
    if (write) {
      EXPECT_TRUE(
          index.db->Put({}, index.handles[0], "format", std::string(reinterpret_cast<const char*>(&*write), 4)).ok());
    }
    if (erase) {
      EXPECT_TRUE(index.db->Delete({}, index.handles[0], "format").ok());
    }
    return held;
  };
  EXPECT_EQ(marker(std::nullopt), DiskTier::kFormatVersion) << "the tier marks its index";
  EXPECT_EQ(marker(DiskTier::kFormatVersion + 1), DiskTier::kFormatVersion);
  Result<std::unique_ptr<DiskTier>> newer =
      tiers_test::OpenDiskUnder(&cache_, {faulty_.get()}, index_path_, kRegionBytes, loop_.post());
  ASSERT_FALSE(newer.has_value());
  EXPECT_EQ(newer.error().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(newer.error().message().find("disk format " + std::to_string(DiskTier::kFormatVersion + 1) +
                                         ", written by a newer kvtier"),
            std::string::npos)
      << newer.error();
  EXPECT_NE(newer.error().message().find("reads disk formats 1 to " + std::to_string(DiskTier::kFormatVersion)),
            std::string::npos)
      << newer.error();
  EXPECT_EQ(marker(std::nullopt), DiskTier::kFormatVersion + 1) << "the refusal changed nothing";
  // An older release's index (no marker) is read whole, and marked.
  marker(std::nullopt, /*erase=*/true);
  Open();
  EXPECT_EQ(adopted_, disk.size());
  EXPECT_EQ(disk_->counters().recovery_dropped, 0u);
  for (const StoredKey& k : disk) EXPECT_TRUE(LoadExact(k));
  Close();
  EXPECT_EQ(marker(std::nullopt), DiskTier::kFormatVersion);
}

// Index entries that cannot name a real record (a damaged or hostile state
// directory) are dropped at recovery, however their fields overflow; the
// others recover and load exactly.
TEST_F(DiskTierTest, ImplausibleIndexEntriesAreDroppedAtRecovery) {
  const std::vector<StoredKey> disk = FillDiskAndClose();
  ASSERT_GE(disk.size(), 6u);
  {
    RawIndex index(index_path_);
    rocksdb::DB* db = index.db.get();
    ASSERT_NE(db, nullptr);
    const std::vector<rocksdb::ColumnFamilyHandle*>& handles = index.handles;
    // Value: version u8, device u32, region u32, offset u64 (at 9),
    // record_bytes u64 (at 17), sequence u64, payload_bytes u64 (at 33), ...
    auto rewrite = [&](const StoredKey& k, std::vector<std::pair<size_t, uint64_t>> fields) {
      const rocksdb::Slice key(reinterpret_cast<const char*>(k.bytes.data()), k.kSize);
      std::string v;
      ASSERT_TRUE(db->Get({}, handles[1], key, &v).ok());
      for (const auto& [at, value] : fields) std::memcpy(v.data() + at, &value, sizeof(value));
      ASSERT_TRUE(db->Put({}, handles[1], key, v).ok());
    };
    uint64_t offset = 0;
    {
      std::string v;
      ASSERT_TRUE(db->Get({}, handles[1],
                          rocksdb::Slice(reinterpret_cast<const char*>(disk[0].bytes.data()), 16),
                          &v)
                      .ok());
      std::memcpy(&offset, v.data() + 9, 8);
    }
    rewrite(disk[0], {{9, offset + 1}});         // unaligned
    rewrite(disk[1], {{9, UINT64_MAX - 4095}});  // offset + record_bytes wraps
    const uint64_t huge = UINT64_MAX - 100;      // RecordBytes(huge) wraps to 0
    rewrite(disk[2], {{33, huge}, {17, RecordBytes(huge)}});
    rewrite(disk[3], {{33, uint64_t{1} << 40},
                      {17, RecordBytes(uint64_t{1} << 40)}});  // larger than any block
  }
  Open();
  EXPECT_EQ(disk_->counters().recovery_dropped, 4u);
  EXPECT_EQ(adopted_, disk.size() - 4);
  for (size_t i = 0; i < disk.size(); ++i) EXPECT_EQ(LoadExact(disk[i]), i >= 4) << "block " << i;
}

TEST_F(DiskTierTest, CrashLosesOnlyWhatWasNotSynced) {
  Open();
  const std::vector<StoredKey> keys = NewKeys(20);
  StoreAll(keys);
  const std::vector<StoredKey> disk = OnDisk(keys);
  Close();
  memory_->DropUnsynced();  // power loss: nothing unsynced survives
  Open();
  EXPECT_EQ(adopted_, disk.size()) << "every indexed record was synced before it was indexed";
  for (const StoredKey& k : disk) EXPECT_TRUE(LoadExact(k));
}

TEST_F(DiskTierTest, FullDiskReclaimsTheOldestRegion) {
  Open();
  // 16 regions of 5 records: 80 fit; store 150 so that reclaims must happen.
  const std::vector<StoredKey> keys = NewKeys(150);
  StoreAll(keys);
  EXPECT_GT(disk_->counters().regions_reclaimed, 0u);
  EXPECT_GT(cache_->counters().evictions[static_cast<size_t>(Tier::kDisk)], 0u);
  EXPECT_LE(disk_->used_bytes(), disk_->capacity_bytes());
  size_t hits = 0;
  for (const StoredKey& k : keys) hits += LoadExact(k);
  EXPECT_GT(hits, 40u);
  // The newest blocks survived; the oldest went.
  EXPECT_TRUE(LoadExact(keys.back()));
  Close();
  Open();
  EXPECT_EQ(adopted_, cache_->Usage(Tier::kDisk).blocks);
}

TEST_F(DiskTierTest, StoresIntoAHostFullOfBlocksBeingWrittenSayWhy) {
  // Write-back of every block (low watermark near 0), onto a disk that
  // stalls: every host block ends up being written, out of the eviction
  // path, and nothing is leased.
  Open(/*hbm_slots=*/0, /*host_slots=*/8, {.high = 0.1, .low = 0.01});
  faulty_->HoldWrites();
  std::vector<StoredKey> keys = NewKeys(8);
  for (uint32_t i = 0; i < keys.size(); ++i) {
    const OpOutcome o = Store(keys[i], i);
    ASSERT_TRUE(o.status.ok()) << o.status;
  }
  ASSERT_TRUE(Drain([&] { return cache_->pending_disk_writes() == keys.size(); }));
  ASSERT_EQ(cache_->leases(), 0u);
  // Refused at once, with the truth: no block is leased; they are being
  // written.
  const StoredKey extra = NewKeys(1)[0];
  const OpOutcome refused = Store(extra, 9);
  EXPECT_EQ(refused.status.code(), StatusCode::kResourceExhausted) << refused.status;
  EXPECT_NE(refused.status.message().find("0 leases held, 8 blocks being written to disk"),
            std::string::npos)
      << refused.status;
  // Once the disk catches up, the same store is taken, and nothing was lost.
  faulty_->ReleaseWrites();
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0; }));
  const OpOutcome again = Store(extra, 9);
  EXPECT_TRUE(again.status.ok()) << again.status;
  for (const StoredKey& k : keys) EXPECT_TRUE(LoadExact(k));
}

// A disk that falls behind (stalled here; slow or contended in life): the
// write-back keeps its writes in flight, stores keep coming, and the room
// they need is made by letting the coldest dirty blocks go unwritten,
// counted as such; nothing being written is lost.
TEST_F(DiskTierTest, ADiskThatFallsBehindLetsTheColdestDirtyBlocksGoAndSaysSo) {
  max_writes_in_flight_ = 2;
  Open(/*hbm_slots=*/0, /*host_slots=*/8, {.high = 0.9, .low = 0.5});
  faulty_->HoldWrites();
  const std::vector<StoredKey> keys = NewKeys(12);
  for (uint32_t i = 0; i < 8; ++i) ASSERT_TRUE(Store(keys[i], i).status.ok());
  ASSERT_TRUE(Drain([&] { return faulty_->held_writes() > 0; }));
  // Host is full: its two coldest blocks are being written, six are dirty.
  ASSERT_EQ(cache_->Usage(Tier::kHost).blocks, 8u);
  EXPECT_EQ(cache_->counters().disk_writes_missed, 0u);
  for (uint32_t i = 8; i < 12; ++i) ASSERT_TRUE(Store(keys[i], i).status.ok());
  EXPECT_EQ(cache_->counters().disk_writes_missed, 4u);
  EXPECT_EQ(cache_->counters().evictions[static_cast<size_t>(Tier::kHost)], 4u);
  faulty_->ReleaseWrites();
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
  // The two being written, and the newest six, are there; the four coldest
  // of the rest are not.
  for (uint32_t i = 0; i < 12; ++i) EXPECT_EQ(LoadExact(keys[i]), i < 2 || i >= 6) << "block " << i;
}

TEST_F(DiskTierTest, ALoadWhoseBlockIsWrittenMeanwhileFinishesCleanly) {
  // A load leases a host block whose disk write is in flight; the write
  // finishes first. The block stays in host, clean, for that load (it used
  // to move to disk with its slot retired, which ended the prefix of a load
  // still reading another block up from disk: the test below).
  Open(/*hbm_slots=*/0, /*host_slots=*/8,
       {.high = 0.1, .low = 0.01});  // every block is written at once
  faulty_->HoldWrites();
  const StoredKey key = NewKeys(1)[0];
  ASSERT_TRUE(Store(key, 0).status.ok());
  ASSERT_TRUE(
      Drain([&] { return cache_->pending_disk_writes() == 1 && faulty_->held_writes() > 0; }));
  std::shared_ptr<std::pair<bool, OpOutcome>> load;
  {
    // Both copy workers busy: the load's copy waits behind them.
    tiers_test::WorkerGate a(*backend_), b(*backend_);
    load = LoadAsync(key, 40);
    faulty_->ReleaseWrites();
    ASSERT_TRUE(Drain([&] { return cache_->pending_disk_writes() == 0; }));
    EXPECT_EQ(TiersOf({key})[0], Tier::kHost) << "the write finished while the load held the block";
  }  // the copy runs now
  ASSERT_TRUE(Drain([&] { return load->first; }));
  ASSERT_EQ(load->second.blocks, 1u);
  EXPECT_TRUE(engine_->Holds(40, key));
  EXPECT_EQ(cache_->leases(), 0u);
  EXPECT_TRUE(LoadExact(key));
  // Clean: it goes back to disk with no second write, and is read from there.
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
  EXPECT_EQ(cache_->counters().disk_demotions, 1u);
  Close();
  Open();
  EXPECT_TRUE(LoadExact(key));
}

// The short loads of issue 32: a load of [A, B], A in host being written,
// B on disk waiting for host room (every host block is being written). The
// writes end; A's while the load holds it. B is read, and the load serves
// both: A stayed in host for it. (Before, A moved to disk with its slot
// retired, and the load ended its prefix at A: no block served.)
TEST_F(DiskTierTest, ALoadServesABlockWrittenWhileItsOtherBlocksWaitedForRoom) {
  Open(/*hbm_slots=*/0, /*host_slots=*/8, {.high = 0.1, .low = 0.01});  // every block is written at once
  const StoredKey b = NewKeys(1)[0];
  ASSERT_TRUE(Store(b, 1).status.ok());
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
  ASSERT_EQ(TiersOf({b})[0], Tier::kDisk);
  faulty_->HoldWrites();
  const std::vector<StoredKey> host = NewKeys(8);
  for (uint32_t i = 0; i < host.size(); ++i) ASSERT_TRUE(Store(host[i], 2 + i).status.ok());
  ASSERT_TRUE(Drain([&] { return cache_->pending_disk_writes() == 8 && faulty_->held_writes() > 0; }));
  const StoredKey& a = host[0];
  const std::array<StoredKey, 2> keys = {a, b};
  const std::array<uint32_t, 2> blocks = {40, 41};
  engine_->Zero(40);
  engine_->Zero(41);
  auto load = std::make_shared<std::pair<bool, OpOutcome>>();
  cache_->Load(kTenant, keys, blocks, Target(), owner_, [load](OpOutcome o) {
    load->second = std::move(o);
    load->first = true;
  });
  EXPECT_FALSE(Drain([&] { return load->first; }, 1s)) << "B's read waits for host room";
  EXPECT_EQ(cache_->counters().disk_reads_waited_for_room, 1u);
  faulty_->ReleaseWrites();
  ASSERT_TRUE(Drain([&] { return load->first; }));
  EXPECT_EQ(load->second.blocks, 2u);
  EXPECT_TRUE(engine_->Holds(40, a));
  EXPECT_TRUE(engine_->Holds(41, b));
  EXPECT_EQ(cache_->counters().loads_short_disk, 0u);
}

// A load leases block X in hbm; X's move to host lands meanwhile, so its hbm
// slot is retired, kept for that load. A flush then writes X: it must not
// move X to disk (an entry keeps one retired slot), so it writes X and keeps
// it in host. Before, the write's end retired X's host slot too and the
// daemon aborted (KVTIER_CHECK in RetireSlot), losing every block in memory.
TEST_F(DiskTierTest, AFlushWritesABlockWhoseOldSlotALoadStillReadsAndKeepsItInHost) {
  hold_loads_ = true;
  Open(/*hbm_slots=*/4, /*host_slots=*/8, {.high = 1.0, .low = 1.0});
  const StoredKey x = NewKeys(1)[0];
  ASSERT_TRUE(Store(x, 0).status.ok());
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0; }));
  ASSERT_EQ(TiersOf({x})[0], Tier::kHbm);
  cache_->SetWatermarks(TierWatermarks{.high = 0, .low = 0}, TierWatermarks{.high = 1.0, .low = 1.0});
  ASSERT_EQ(cache_->inflight_copies(), 1u) << "the move to host";
  holding_->HoldLoads(true);
  std::shared_ptr<std::pair<bool, OpOutcome>> load = LoadAsync(x, 40);  // reads the hbm slot
  ASSERT_TRUE(Drain([&] { return cache_->counters().demotions == 1; }));
  ASSERT_EQ(TiersOf({x})[0], Tier::kHost);
  ASSERT_EQ(cache_->leases(), 1u) << "the load still reads the old hbm slot";

  EXPECT_EQ(cache_->FlushToDisk(), 1u);
  ASSERT_TRUE(Drain([&] { return cache_->pending_disk_writes() == 0 && disk_->inflight() == 0; }));
  EXPECT_EQ(cache_->counters().disk_demotions, 1u);
  EXPECT_EQ(TiersOf({x})[0], Tier::kHost) << "written, and kept in host";
  ASSERT_TRUE(holding_->WaitHeld(1));
  holding_->HoldLoads(false);
  holding_->ReleaseAll();
  ASSERT_TRUE(Drain([&] { return load->first; }));
  EXPECT_EQ(load->second.blocks, 1u);
  EXPECT_TRUE(engine_->Holds(40, x));
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0; }));
  EXPECT_EQ(cache_->leases(), 0u);
  EXPECT_EQ(cache_->FlushToDisk(), 0u) << "clean now";
  // The flush made it durable: a restart finds it on disk.
  Close();
  Open(/*hbm_slots=*/4, /*host_slots=*/8, {.high = 1.0, .low = 1.0});
  EXPECT_EQ(adopted_, 1u);
  EXPECT_TRUE(LoadExact(x));
}

TEST_F(DiskTierTest, ABlockWhoseRecordWasReclaimedWhileALoadHeldItIsServedFromMemoryOnly) {
  // As above, a load holds a block whose write finishes meanwhile: the block
  // stays in host, clean, for that load. Then its region is reclaimed while
  // the load's copy still waits, so the block has no record left: only its
  // disk copy goes. Lookups and other loads are served from host, and none
  // reads its old location: once the region is written again that location
  // holds other blocks' bytes (which the record checks caught under the soak
  // test, as checksum failures, when the block moved to disk for the load).
  Open(/*hbm_slots=*/0, /*host_slots=*/8,
       {.high = 0.1, .low = 0.01});  // every block is written at once
  faulty_->HoldWrites();
  // Six records of 8 KiB: the first five fill region 0, the sixth seals it.
  const std::vector<StoredKey> keys = NewKeys(6);
  for (uint32_t i = 0; i < keys.size(); ++i) ASSERT_TRUE(Store(keys[i], i).status.ok());
  ASSERT_TRUE(Drain([&] { return cache_->pending_disk_writes() == keys.size(); }));
  const StoredKey& key = keys[0];
  const uint64_t reads = disk_->counters().reads + disk_->counters().checksum_failures;
  std::shared_ptr<std::pair<bool, OpOutcome>> load;
  std::shared_ptr<std::pair<bool, OpOutcome>> other;
  {
    tiers_test::WorkerGate a(*backend_), b(*backend_);  // the loads' copies wait
    load = LoadAsync(key, 40);
    faulty_->ReleaseWrites();
    ASSERT_TRUE(Drain([&] { return cache_->pending_disk_writes() == 0; }));
    EXPECT_EQ(TiersOf({key})[0], Tier::kHost) << "kept in host for the load";
    // Every region reclaimed that can be: region 0, with the block's record.
    disk_->SetWatermarks(0.0, 0.0);
    ASSERT_TRUE(Drain([&] { return disk_->counters().regions_reclaimed == 1; }));
    disk_->SetWatermarks(0.98, 0.96);
    EXPECT_EQ(TiersOf({key})[0], Tier::kHost) << "its copy in memory stays";
    other = LoadAsync(key, 41);
    EXPECT_FALSE(load->first);
  }  // the loads' copies run now, from its host slot
  ASSERT_TRUE(Drain([&] { return load->first && other->first && cache_->leases() == 0; }));
  EXPECT_EQ(load->second.blocks, 1u);
  EXPECT_EQ(other->second.blocks, 1u);
  EXPECT_TRUE(engine_->Holds(40, key)) << "the load that held the block got its bytes";
  EXPECT_TRUE(engine_->Holds(41, key));
  EXPECT_EQ(disk_->counters().reads + disk_->counters().checksum_failures, reads)
      << "a load read the reclaimed location";
  EXPECT_EQ(disk_->counters().checksum_failures, 0u);
}

TEST_F(DiskTierTest, VerifyIsCancelledAndStopsReading) {
  Open();
  const std::vector<StoredKey> keys = NewKeys(40);
  StoreAll(keys);
  ASSERT_GT(cache_->FlushToDisk(), 0u);
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0; }));
  std::shared_ptr<const VerifyProgress> p = cache_->VerifyDisk(/*max_inflight=*/1);
  ASSERT_GT(p->total, 10u);
  ASSERT_TRUE(Drain([&] { return p->checked >= 2; }));
  cache_->CancelVerify();
  ASSERT_TRUE(Drain([&] { return p->done && cache_->inflight_copies() == 0; }));
  EXPECT_LT(p->checked, p->total) << "the verification read on after its cancel";
  const uint64_t checked = p->checked;
  ASSERT_TRUE(Drain([&] { return disk_->inflight() == 0; }));
  EXPECT_EQ(p->checked, checked);
  // A new one starts from the beginning and runs to the end.
  std::shared_ptr<const VerifyProgress> again = cache_->VerifyDisk(4);
  ASSERT_TRUE(Drain([&] { return again->done; }));
  EXPECT_EQ(again->checked, again->total);
  EXPECT_EQ(again->bad, 0u);
}

TEST_F(DiskTierTest, AFlushOntoAFullDiskKeepsWhatHostHeld) {
  // A host tier half the size of the disk, both full, then a flush (what a
  // stop does): what host held must all be on disk afterwards. (Appends
  // waiting for a reclaim's index write once started reclaim after
  // reclaim, sweeping the whole disk, the flushed blocks included.)
  for (int round = 0; round < 8; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    Open(/*hbm_slots=*/0, /*host_slots=*/40, {.high = 0.9, .low = 0.8});
    const std::vector<StoredKey> keys = NewKeys(400);
    for (size_t i = 0; i < keys.size(); ++i) {
      auto b = static_cast<uint32_t>(i % 32);
      engine_->Fill(b, keys[i]);
      bool done = false;
      cache_->Store(kTenant, std::span(&keys[i], 1), std::span(&b, 1), std::nullopt, Target(),
                    owner_, [&](OpOutcome) { done = true; });
      ASSERT_TRUE(Drain([&] { return done; }));  // at the pace of the engine, not of the disk
    }
    std::vector<StoredKey> in_host;
    for (size_t i = keys.size() - 60; i < keys.size(); ++i) {
      const CacheLookup r = cache_->Lookup(kTenant, std::span(&keys[i], 1));
      if (r.hits == 1 && r.tiers[0] == Tier::kHost) in_host.push_back(keys[i]);
    }
    ASSERT_GT(in_host.size(), 30u);
    const uint64_t reclaimed = disk_->counters().regions_reclaimed;
    cache_->FlushToDisk();
    ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
    // At most 40 records of 5 per region, and what that sweeps on the way.
    EXPECT_LE(disk_->counters().regions_reclaimed - reclaimed, 12u)
        << "the flush reclaimed far more than it needed";
    Close();
    Open(0, 40, {.high = 0.9, .low = 0.8});
    for (const StoredKey& k : in_host)
      EXPECT_TRUE(LoadExact(k)) << "a block host held was lost to the flush";
    Close();
    memory_ = std::make_unique<MemoryDevice>(16 * kRegionBytes);
    faulty_ = std::make_unique<FaultyDevice>(memory_.get());
    std::filesystem::remove_all(index_path_);
  }
}

TEST_F(DiskTierTest, ADeviceThatFailsEveryWriteCostsNoCpuAndGivesBlocksUp) {
  const TierWatermarks marks{.high = 0.9, .low = 0.5};
  Open(/*hbm_slots=*/0, /*host_slots=*/32, marks);
  const std::vector<StoredKey> on_disk = StoreFlushed(6);
  ASSERT_FALSE(on_disk.empty());
  // The disk dies for writes; host fills past its high watermark.
  faulty_->FailAll(FaultOp::kWrite, EIO);
  const std::vector<StoredKey> later = NewKeys(30);
  StoreAll(later);
  const uint64_t failed = faulty_->counters().failed_ops;
  ASSERT_GT(failed, 0u);
  // While the clock stands still, write-back pauses: more work starts no
  // write at all (no retry loop, no CPU spent on it).
  auto pump = [&] {
    cache_->SetWatermarks({}, marks);  // runs the background work, as any op's completion does
    ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0; }));
  };
  for (int i = 0; i < 50; ++i) pump();
  EXPECT_EQ(faulty_->counters().failed_ops, failed) << "writes were retried without a pause";
  EXPECT_GT(cache_->counters().disk_write_backoffs, 0u);
  // As time passes, one block at a time is tried, each at most three times,
  // then given up (and dropped, not written, when write-back comes to it).
  for (int i = 0; i < 40; ++i) {
    now_ += 10s;
    pump();
  }
  EXPECT_GT(cache_->counters().disk_writes_given_up, 1u);
  EXPECT_LE(cache_->counters().disk_write_failures,
            3 * cache_->counters().disk_writes_given_up + 3);
  // What it holds is still served: the blocks on disk from before, exactly,
  // and the newest blocks from memory.
  for (const StoredKey& k : on_disk) EXPECT_TRUE(LoadExact(k));
  EXPECT_TRUE(LoadExact(later.back()));
  EXPECT_EQ(cache_->leases(), 0u);
  // And it stops: Close drains every copy and I/O.
}

TEST_F(DiskTierTest, ABlockLargerThanARegionIsGivenUpAtOnce) {
  // 40 layers of 2 KiB: 80 KiB blocks, larger than a 40 KiB region.
  Result<std::unique_ptr<EngineMemory>> big = EngineMemory::Create(*backend_, SmallSpec(40), 64);
  ASSERT_TRUE(big.has_value()) << big.error();
  engine_ = std::move(*big);
  Open(/*hbm_slots=*/0, /*host_slots=*/4);
  const std::vector<StoredKey> keys = NewKeys(8);
  StoreAll(keys);
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
  // Each was refused once (kInvalidArgument), never retried, and never
  // written: the host tier keeps what fits and drops the rest.
  EXPECT_GT(cache_->counters().disk_writes_given_up, 0u);
  EXPECT_EQ(cache_->counters().disk_write_failures, cache_->counters().disk_writes_given_up);
  EXPECT_EQ(faulty_->counters().failed_ops, 0u);
  EXPECT_EQ(disk_->counters().writes, 0u);
  EXPECT_TRUE(LoadExact(keys.back()));
}

// The index on a file system of its own that fills up: RocksDB's writes
// fail. The tier must go on serving what it holds, without spinning, and
// stop.
TEST_F(DiskTierTest, AFullIndexVolumeKeepsServingAndStops) {
  std::string why;
  const auto volume = tiers_test::SmallVolume::Mount(dir_ + "/index-fs", "6m", &why);
  if (!volume) GTEST_SKIP() << why;
  index_path_ = volume->path() + "/index";
  Open();
  const std::vector<StoredKey> on_disk = StoreFlushed(10);
  ASSERT_FALSE(on_disk.empty());
  volume->Fill();
  // Enough stores to wrap the disk: appends' index writes fail, and so do
  // reclaims' deletes; both back off.
  for (int i = 0; i < 120; ++i) {
    now_ += 1s;
    const std::vector<StoredKey> k = NewKeys(1);
    StoreAll(k);
  }
  EXPECT_GT(disk_->counters().index_errors, 0u);
  EXPECT_GT(cache_->counters().disk_write_failures, 0u);
  EXPECT_LE(cache_->counters().disk_write_failures, 3u * 120);
  // Reads need no index write: what is on disk still loads, exactly or as a
  // miss (a region whose reclaim started is gone), and memory serves the rest.
  for (const StoredKey& k : on_disk) LoadExact(k);
  EXPECT_EQ(cache_->leases(), 0u);
  Close();  // stops: every copy, I/O and index write drained
}

// As above, and then the volume has room again: the index takes writes
// again (RocksDB recovers by itself once 8 MiB are free), the daemon says
// so, blocks whose writes failed only because the index did are written
// then, not given up, and what is written is durable across a restart.
TEST_F(DiskTierTest, AFullIndexVolumeRecoversOnceItHasRoomAgain) {
  std::string why;
  const auto volume = tiers_test::SmallVolume::Mount(dir_ + "/index-fs", "32m", &why);
  if (!volume) GTEST_SKIP() << why;
  index_path_ = volume->path() + "/index";
  // Full but for 128 KiB when the index opens (so its log has no room
  // preallocated), then filled to the last byte by the index itself.
  volume->Fill(128 << 10);
  Open();
  ASSERT_FALSE(StoreFlushed(10).empty());
  for (int i = 0; i < 2000 && disk_->counters().index_errors == 0; ++i) {
    now_ += 1s;
    StoreAll(NewKeys(1));
  }
  ASSERT_GT(disk_->counters().index_errors, 0u);
  EXPECT_TRUE(disk_->index_stopped()) << "the index refuses writes, and says so";
  // What host holds now, dirty: flushes try every block many times while
  // the index refuses writes. Its failure is not the blocks': none is given
  // up (before, each was after three tries, and never written).
  for (int i = 0; i < 100; ++i) {
    now_ += 10s;
    cache_->FlushToDisk();
    ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
  }
  EXPECT_EQ(cache_->counters().disk_writes_given_up, 0u);
  std::vector<StoredKey> kept;
  for (const auto& [key, presence] : PresenceTracker::Of(*cache_)) {
    if (presence == Presence::kHost) kept.push_back(StoredKey::FromHex(key).value());
  }
  ASSERT_GE(kept.size(), 4u);
  EXPECT_TRUE(OnDisk(kept).empty());

  volume->Free();
  // Flushes go on (their pauses pass): the index takes writes again, and
  // the blocks host kept through the outage are written.
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (disk_->index_stopped() && std::chrono::steady_clock::now() < deadline) {
    now_ += 1s;
    cache_->FlushToDisk();
    ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_FALSE(disk_->index_stopped()) << "the index never took writes again";
  EXPECT_GE(disk_->counters().index_recoveries, 1u);
  now_ += 10s;
  cache_->FlushToDisk();
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
  EXPECT_EQ(OnDisk(kept).size(), kept.size()) << "blocks host kept through the outage were given up";
  // And what is stored from now on is durable.
  std::vector<StoredKey> after = kept;
  for (int i = 0; i < 20; ++i) {
    now_ += 1s;
    const std::vector<StoredKey> k = StoreFlushed(1);
    after.insert(after.end(), k.begin(), k.end());
  }
  ASSERT_GE(after.size(), kept.size() + 10) << "blocks stored after the recovery reach the disk";
  const uint64_t errors = disk_->counters().index_errors;
  Close();
  Open();
  EXPECT_EQ(disk_->counters().index_errors, 0u) << errors;
  for (const StoredKey& k : after) EXPECT_TRUE(LoadExact(k)) << "written since the outage, lost at restart";
}

}  // namespace
}  // namespace kvtier
