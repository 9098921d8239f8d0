// The disk tier on a path larger than 16 TiB (32-bit page offsets end
// there): blocks whose records lie past 16 TiB are written back from host,
// kept disk-only, loaded back byte-exact, and found again after a restart.
// The device is a sparse fake of 20 TiB (the block-device seam); the block
// cache, the disk tier and its RocksDB index are real.
//
// The tier fills the lowest free region first, so writing past 16 TiB by
// appends alone would write 16 TiB. Instead the index starts out as a disk
// whose first 16 TiB hold records: one real record, copied into an entry at
// the start of every 1 GiB region below 16 TiB. Recovery seals those
// regions, and the next appends go to the first region at 16 TiB.
#include <gtest/gtest.h>
#include <rocksdb/db.h>

#include <cstring>
#include <deque>
#include <filesystem>
#include <random>

#include "common/disk_limits.h"
#include "common/mutex.h"
#include "tests/tiers/disk/cache_loop.h"
#include "tests/tiers/disk/sparse_device.h"
#include "tests/tiers/tiers_test_util.h"
#include "tiers/block_cache.h"
#include "tiers/disk/disk_tier.h"
#include "devices/host_backend.h"

namespace kvtier {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kRegionBytes = 1ull << 30;
constexpr uint64_t kDeviceBytes = 20ull << 40;
constexpr uint64_t k16TiB = 1ull << 44;
constexpr uint64_t kSeededRegions = k16TiB / kRegionBytes;  // 16384
constexpr TenantId kTenant = 0;

class BigDiskTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kvtier-bigdisk-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    backend_ = HostBackend::Create({.copy_threads = 2}).value();
    Result<std::unique_ptr<tiers_test::EngineMemory>> engine =
        tiers_test::EngineMemory::Create(*backend_, tiers_test::SmallSpec(), 64);
    ASSERT_TRUE(engine.has_value()) << engine.error();
    engine_ = std::move(*engine);
    device_ = std::make_unique<SparseDevice>(kDeviceBytes);
  }
  void TearDown() override {
    Close();
    std::filesystem::remove_all(dir_);
  }

  // Opens the tier on the sparse device and a cache over it (8 host slots,
  // write-back above 90%), adopting what the index holds.
  void Open() {
    const BlockCache::Post post = loop_.post();
    Result<std::unique_ptr<DiskTier>> disk =
        tiers_test::OpenDiskUnder(&cache_, {device_.get()}, dir_ + "/index", kRegionBytes, post);
    ASSERT_TRUE(disk.has_value()) << disk.error();
    disk_ = std::move(*disk);
    const uint64_t stride = SlotPool::StrideFor(engine_->block_bytes());
    BlockCache::Options o{.backend = backend_.get(),
                          .post = post,
                          .hbm_bytes = 0,
                          .host_bytes = 8 * stride,
                          .hbm_watermarks = {},
                          .host_watermarks = {.high = 0.9, .low = 0.5},
                          .disk = disk_.get(),
                          .disk_min_hits = 0,
                          .disk_promotion_min_hits = 0,
                          .clock = [this] { return now_; }};
    cache_ = BlockCache::Create(std::move(o)).value();
    cache_->SetTenantName(kTenant, "t0");
    adopted_ = cache_->AdoptDiskRecords(disk_->TakeRecovered());
  }
  void Close() {
    if (cache_) {
      EXPECT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
    }
    cache_.reset();
    disk_.reset();
  }

  bool Drain(const std::function<bool()>& until, std::chrono::seconds timeout = 60s) {
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

  // Stores each key from its own engine block, letting write-back settle
  // after each.
  void StoreAll(const std::vector<StoredKey>& keys) {
    for (size_t i = 0; i < keys.size(); ++i) {
      const auto block = static_cast<uint32_t>(i % 32);
      engine_->Fill(block, keys[i]);
      bool done = false;
      Status status;
      cache_->Store(kTenant, std::span(&keys[i], 1), std::span(&block, 1), std::nullopt, Target(),
                    owner_, [&](OpOutcome o) {
                      status = o.status;
                      done = true;
                    });
      ASSERT_TRUE(Drain([&] { return done; }));
      ASSERT_TRUE(status.ok()) << status;
      ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0; }));
    }
  }

  // Loads into engine block 40: true if it loaded and holds the key's bytes.
  bool LoadExact(const StoredKey& key) {
    constexpr uint32_t kBlock = 40;
    engine_->Zero(kBlock);
    bool done = false;
    uint64_t blocks = 0;
    cache_->Load(kTenant, std::span(&key, 1), std::span(&kBlock, 1), Target(), owner_,
                 [&](OpOutcome o) {
                   blocks = o.blocks;
                   done = true;
                 });
    EXPECT_TRUE(Drain([&] { return done; }));
    if (blocks == 0) return false;
    const bool exact = engine_->Holds(kBlock, key);
    EXPECT_TRUE(exact) << "a load returned bytes that differ from what was stored";
    return exact;
  }

  std::vector<StoredKey> OnDisk(const std::vector<StoredKey>& keys) {
    std::vector<StoredKey> out;
    for (const StoredKey& k : keys) {
      const CacheLookup r = cache_->Lookup(kTenant, std::span(&k, 1));
      if (r.hits == 1 && r.tiers[0] == Tier::kDisk) out.push_back(k);
    }
    return out;
  }

  // Writes one real record (it lands at offset 0), then gives each region
  // below 16 TiB an index entry: a copy of that record's, under a new key,
  // at the region's start. Those copies name no record: a read of one fails
  // its checks.
  void SeedFirst16TiB() {
    Open();
    const std::vector<StoredKey> first = NewKeys(1);
    StoreAll(first);
    ASSERT_EQ(cache_->FlushToDisk(), 1u);
    ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
    Close();
    std::vector<rocksdb::ColumnFamilyDescriptor> cfs = {
        {rocksdb::kDefaultColumnFamilyName, {}}, {"blocks", {}}, {"regions", {}}};
    std::vector<rocksdb::ColumnFamilyHandle*> handles;
    rocksdb::DB* raw = nullptr;
    ASSERT_TRUE(rocksdb::DB::Open(rocksdb::Options(), dir_ + "/index", cfs, &handles, &raw).ok());
    std::unique_ptr<rocksdb::DB> db(raw);
    auto slice = [](const StoredKey& k) {
      return rocksdb::Slice(reinterpret_cast<const char*>(k.bytes.data()), k.kSize);
    };
    std::string value;
    ASSERT_TRUE(db->Get({}, handles[1], slice(first[0]), &value).ok());
    // Value: version u8, device u32, region u32 (at 5), offset u64 (at 9),
    // ... (docs/disk-format.md), little-endian.
    uint64_t offset = ~uint64_t{0};
    std::memcpy(&offset, value.data() + 9, 8);
    ASSERT_EQ(offset, 0u) << "the first record of an empty disk";
    rocksdb::WriteBatch batch;
    for (const StoredKey& k : NewKeys(kSeededRegions - 1)) {
      const auto region = static_cast<uint32_t>(batch.Count() + 1);
      const uint64_t at = region * kRegionBytes;
      std::memcpy(value.data() + 5, &region, 4);
      std::memcpy(value.data() + 9, &at, 8);
      ASSERT_TRUE(batch.Put(handles[1], slice(k), value).ok());
    }
    ASSERT_TRUE(db->Write({}, &batch).ok());
    for (rocksdb::ColumnFamilyHandle* h : handles)
      ASSERT_TRUE(db->DestroyColumnFamilyHandle(h).ok());
    ASSERT_TRUE(db->Close().ok());
  }

  tiers_test::CacheLoop loop_;  // first: the tier and the cache post to it until they are gone
  std::string dir_;
  std::mt19937_64 rng_{13};
  std::unique_ptr<HostBackend> backend_;
  std::unique_ptr<tiers_test::EngineMemory> engine_;
  std::unique_ptr<SparseDevice> device_;
  std::unique_ptr<DiskTier> disk_;
  std::unique_ptr<BlockCache> cache_;
  std::shared_ptr<void> owner_ = std::make_shared<int>(0);
  uint64_t adopted_ = 0;
  std::chrono::steady_clock::time_point now_{};  // the manual clock
};

TEST_F(BigDiskTest, BlocksPast16TiBAreWrittenLoadedAndFoundAfterARestart) {
  ASSERT_NO_FATAL_FAILURE(SeedFirst16TiB());
  Open();
  ASSERT_EQ(adopted_, kSeededRegions);
  ASSERT_EQ(disk_->free_regions(), disk_->num_regions(0) - kSeededRegions);

  // Write-back from host: the host tier holds 8 blocks, so most go to disk
  // and leave host (disk-only).
  const std::vector<StoredKey> keys = NewKeys(24);
  ASSERT_NO_FATAL_FAILURE(StoreAll(keys));
  const std::vector<StoredKey> disk = OnDisk(keys);
  ASSERT_GE(disk.size(), 12u);
  const uint64_t written = disk_->counters().writes;
  ASSERT_GE(written, disk.size());
  // Every record of this session lies past 16 TiB: below it, only the seed
  // record's header and payload pages were ever written.
  const uint64_t record_pages = RecordBytes(engine_->block_bytes()) / SparseDevice::kPageBytes;
  uint64_t below = 0, past = 0;
  for (uint64_t at : device_->WrittenPageOffsets()) ++(at < k16TiB ? below : past);
  EXPECT_EQ(below, record_pages);
  EXPECT_EQ(past, written * record_pages);

  for (const StoredKey& k : disk) EXPECT_TRUE(LoadExact(k)) << "a block written past 16 TiB";

  // Restart: the index names the records past 16 TiB, and the cache finds
  // them there (disk-only again), byte-exact.
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
  const uint64_t live = disk_->live_records();  // the loads' promotions wrote back more
  EXPECT_EQ(live, kSeededRegions + disk_->counters().writes);
  Close();
  Open();
  EXPECT_EQ(adopted_, live);
  EXPECT_EQ(OnDisk(disk).size(), disk.size());
  for (const StoredKey& k : disk)
    EXPECT_TRUE(LoadExact(k)) << "written past 16 TiB, before the restart";

  // A verification reads every record back where the cache says it is:
  // only the seeded copies (no record behind them) fail.
  std::shared_ptr<const VerifyProgress> p = cache_->VerifyDisk(8);
  ASSERT_TRUE(Drain([&] { return p->done && cache_->inflight_copies() == 0; }, 300s));
  EXPECT_EQ(p->skipped, 0u);
  EXPECT_EQ(p->checked, p->total);
  EXPECT_EQ(p->bad, kSeededRegions - 1);
  for (const StoredKey& k : disk) EXPECT_TRUE(LoadExact(k)) << "after the verification";
}

// A path past what the tier addresses is refused when the tier opens, as
// is one split into more regions than 32-bit region numbers count; a path of
// exactly the limit opens.
TEST_F(BigDiskTest, DevicesPastTheAddressableSizeAreRefusedAtOpen) {
  auto open = [&](BlockDevice* device, uint64_t region_bytes) {
    return DiskTier::Open(
        {.devices = {device},
         .index_path = dir_ + "/refused-index",
         .region_bytes = region_bytes,
         .post = [](std::function<void()>) {},
         .reclaim = [](const StoredKey&, const DiskLocation&, bool) { return ReclaimAnswer{}; },
         .relocated = [](const StoredKey&, Result<DiskLocation>) {}});
  };
  SparseDevice too_large(kMaxDiskPathBytes + kRegionBytes, "too-large");
  Result<std::unique_ptr<DiskTier>> refused = open(&too_large, 1ull << 40);
  ASSERT_FALSE(refused.has_value());
  EXPECT_EQ(refused.error().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.error().message().find("too-large"), std::string::npos) << refused.error();
  EXPECT_NE(refused.error().message().find("(2 PiB)"), std::string::npos) << refused.error();

  SparseDevice largest(kMaxDiskPathBytes, "largest");
  Result<std::unique_ptr<DiskTier>> many_regions = open(&largest, 4096);
  ASSERT_FALSE(many_regions.has_value());
  EXPECT_NE(many_regions.error().message().find("regions; at most 4294967295"), std::string::npos)
      << many_regions.error();
  Result<std::unique_ptr<DiskTier>> opened = open(&largest, 1ull << 40);
  ASSERT_TRUE(opened.has_value()) << opened.error();
  EXPECT_EQ((*opened)->capacity_bytes(), kMaxDiskPathBytes);
}

}  // namespace
}  // namespace kvtier
