// DiskTier when its index volume fills up and then has room again, against
// the tier alone (with an owner of the test's own), on a tmpfs the test
// mounts: what a reclaim whose index deletes failed may delete once it is
// retried. The cache's side of an outage is in disk_tier_test.cc.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/tiers/disk/cache_loop.h"
#include "tests/tiers/disk/memory_device.h"
#include "tests/tiers/disk/small_volume.h"
#include "tiers/disk/disk_tier.h"
#include "tiers/disk/record.h"

namespace kvtier {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kRegionBytes = 64 * 1024;
constexpr uint64_t kPayloadBytes = 8 * 1024;

class IndexOutageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kvtier-outage-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    std::string why;
    volume_ = tiers_test::SmallVolume::Mount(dir_ + "/index-fs", "32m", &why);
    if (!volume_) GTEST_SKIP() << why;
    device_ = std::make_unique<MemoryDevice>(16 * kRegionBytes);
    payload_ = static_cast<uint8_t*>(std::aligned_alloc(kRecordAlignBytes, kPayloadBytes));
    std::memset(payload_, 0x5a, kPayloadBytes);
  }
  void TearDown() override {
    Close();
    volume_.reset();
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
    std::free(payload_);
  }

  void Open() {
    Result<std::unique_ptr<DiskTier>> disk = DiskTier::Open(
        {.devices = {device_.get()},
         .index_path = volume_->path() + "/index",
         .region_bytes = kRegionBytes,
         .post = loop_.post(),
         .reclaim = [this](const StoredKey& key, const DiskLocation& where,
                           bool) -> ReclaimAnswer {
           auto it = where_.find(key);
           if (it == where_.end() || it->second.offset != where.offset) return {};
           where_.erase(it);
           dropped_.push_back(key);
           return {ReclaimAction::kDropped};
         },
         .relocated = [](const StoredKey&, Result<DiskLocation>) { ADD_FAILURE() << "nothing is carried"; },
         // Reclaims run ahead, while appends still find free regions.
         .high_watermark = 0.5,
         .low_watermark = 0.25,
         .clock = [this] { return now_; }});
    ASSERT_TRUE(disk.has_value()) << disk.error();
    disk_ = std::move(*disk);
  }
  void Close() {
    if (disk_) {
      EXPECT_TRUE(loop_.Drain([&] { return disk_->inflight() == 0; }, 30s));
    }
    disk_.reset();
  }

  // Appends a packed record under `key`; where it is once durable.
  Result<DiskLocation> Append(const StoredKey& key) {
    RecordHeader h;
    h.key = key;
    h.ns.bytes[0] = 7;
    h.payload_bytes = kPayloadBytes;
    h.payload_checksum = PayloadChecksum(std::span<const uint8_t>(payload_, kPayloadBytes));
    h.owner = "tenant-a";
    h.codec = CodecKind::kLossless;
    h.dtype = DType::kBf16;
    h.raw_bytes = kPayloadBytes * 2;
    std::optional<Result<DiskLocation>> out;
    disk_->Append(h, payload_, [&](Result<DiskLocation> where) {
      if (where) where_[key] = *where;
      out = std::move(where);
    });
    EXPECT_TRUE(loop_.Drain([&] { return out.has_value() && disk_->inflight() == 0; }, 30s));
    return out.value_or(Err(Status(StatusCode::kInternal, "no answer")));
  }
  StoredKey NewKey() {
    StoredKey key;
    for (auto& b : key.bytes) b = static_cast<uint8_t>(rng_());
    return key;
  }

  tiers_test::CacheLoop loop_;
  std::string dir_;
  std::unique_ptr<tiers_test::SmallVolume> volume_;
  std::unique_ptr<MemoryDevice> device_;
  uint8_t* payload_ = nullptr;
  std::unique_ptr<DiskTier> disk_;
  std::mt19937_64 rng_{31};
  std::map<StoredKey, DiskLocation> where_;  // the owner's records
  std::vector<StoredKey> dropped_;           // by reclaims, in order
  std::chrono::steady_clock::time_point now_{};
};

// A reclaim whose index deletes failed (the index volume full) retries them
// once its pause is over. Meanwhile the index had room again, and a block of
// that region was appended again elsewhere, durably: the retry must not
// delete its new entry. Before, the retry resubmitted the old deletes word
// for word, and the block was gone after a restart.
TEST_F(IndexOutageTest, ARetriedReclaimNeverDeletesTheEntryOfABlockAppendedAgainSince) {
  volume_->Fill(128 << 10);  // before the index opens: its log gets no room preallocated
  Open();
  // Appends until the index refuses writes and a reclaim's deletes failed.
  size_t dropped_before = 0;
  for (int i = 0; i < 20000 && disk_->counters().reclaim_failures == 0; ++i) {
    now_ += 10s;
    dropped_before = dropped_.size();
    (void)Append(NewKey());
  }
  ASSERT_GT(disk_->counters().reclaim_failures, 0u) << "no reclaim failed";
  ASSERT_TRUE(disk_->index_stopped());
  // The blocks that failing reclaim dropped: their owner writes them again.
  const std::vector<StoredKey> again(dropped_.begin() + static_cast<std::ptrdiff_t>(dropped_before), dropped_.end());
  ASSERT_FALSE(again.empty());

  // Room again: RocksDB recovers by itself (it polls every 5 s). The clock
  // stands still, so the failed reclaim waits for its retry.
  volume_->Free();
  std::this_thread::sleep_for(6s);
  for (const StoredKey& k : again) {
    Result<DiskLocation> now = Append(k);
    ASSERT_TRUE(now.has_value()) << now.error();
  }
  ASSERT_FALSE(disk_->index_stopped());
  // The retry, once its pause is over (an append schedules it): it succeeds.
  const uint64_t failures = disk_->counters().reclaim_failures;
  const uint64_t reclaimed = disk_->counters().regions_reclaimed;
  now_ += 20s;
  ASSERT_TRUE(Append(NewKey()).has_value());
  ASSERT_TRUE(loop_.Drain([&] { return disk_->counters().regions_reclaimed > reclaimed; }, 30s));
  EXPECT_EQ(disk_->counters().reclaim_failures, failures);

  Close();
  Open();
  std::map<StoredKey, DiskLocation> recovered;
  for (const DiskRecord& r : disk_->TakeRecovered()) recovered[r.header.key] = r.location;
  size_t checked = 0;
  for (const StoredKey& k : again) {
    auto owned = where_.find(k);
    if (owned == where_.end()) continue;  // its new region was reclaimed since, as it may be
    auto it = recovered.find(k);
    ASSERT_NE(it, recovered.end()) << "appended again, durably, and lost to a retried reclaim";
    EXPECT_EQ(it->second.offset, owned->second.offset);
    ++checked;
  }
  EXPECT_GT(checked, 0u);
  // And the index holds exactly the owner's records: every reclaim's deletes
  // landed, the retried one's too.
  EXPECT_EQ(recovered.size(), where_.size());
  for (const auto& [key, where] : where_) {
    auto it = recovered.find(key);
    ASSERT_NE(it, recovered.end());
    EXPECT_EQ(it->second.offset, where.offset);
  }
}

}  // namespace
}  // namespace kvtier
