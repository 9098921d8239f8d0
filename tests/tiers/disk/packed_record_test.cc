// DiskTier with packed records (a codec's output, record.h): their size on
// disk, reads, damage, restarts and carries, against the tier alone (the
// cache's side is tested where it stores compressed blocks).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "tiers/disk/disk_tier.h"
#include "tiers/disk/record.h"
#include "tests/tiers/disk/cache_loop.h"
#include "tests/tiers/disk/memory_device.h"

namespace kvtier {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kRegionBytes = 64 * 1024;

struct FreeBuffer {
  void operator()(uint8_t* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<uint8_t, FreeBuffer>;

Buffer Aligned(uint64_t bytes) {
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(kRecordAlignBytes, AlignUpToPage(std::max<uint64_t>(bytes, 1))));
  return Buffer(p);
}

class PackedRecordTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kvtier-packed-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    device_ = std::make_unique<MemoryDevice>(8 * kRegionBytes);
    Open();
  }
  void TearDown() override {
    Close();
    std::filesystem::remove_all(dir_);
  }
  void Open() {
    Result<std::unique_ptr<DiskTier>> disk = DiskTier::Open(
        {.devices = {device_.get()},
         .index_path = dir_ + "/index",
         .region_bytes = kRegionBytes,
         .post = loop_.post(),
         .reclaim = [this](const StoredKey& key, const DiskLocation& where,
                           bool may_carry) { return Reclaim(key, where, may_carry); },
         .relocated = [this](const StoredKey& key, Result<DiskLocation> now) {
           if (!now) {
             ADD_FAILURE() << "a carry failed: " << now.error();
             return;
           }
           where_[key] = *now;
           ++relocated_;
         }});
    ASSERT_TRUE(disk.has_value()) << disk.error();
    disk_ = std::move(*disk);
  }
  void Close() {
    if (disk_) {
      EXPECT_TRUE(loop_.Drain([&] { return disk_->inflight() == 0; }, 30s));
    }
    disk_.reset();
  }

  // The owner's side of a reclaim: current records are carried when asked
  // to (packed, with their owner and annotation), else dropped.
  ReclaimAnswer Reclaim(const StoredKey& key, const DiskLocation& where, bool may_carry) {
    auto it = where_.find(key);
    if (it == where_.end() || it->second.offset != where.offset) return {};
    const RecordHeader& h = written_.at(key);
    if (carry_ && may_carry) {
      ReclaimAnswer carry(ReclaimAction::kCarry, h.payload_bytes);
      carry.packed = true;
      carry.owner = h.owner;
      carry.annotation = h.annotation;
      return carry;
    }
    where_.erase(it);
    return {ReclaimAction::kDropped};
  }

  RecordHeader Header(const StoredKey& key, uint64_t stored, std::span<const uint8_t> payload) {
    RecordHeader h;
    h.key = key;
    h.ns.bytes[0] = 7;
    h.payload_bytes = stored;
    h.payload_checksum = PayloadChecksum(payload);
    h.owner = "tenant-a";
    h.annotation = "meta " + key.ToHex();
    h.codec = CodecKind::kLossless;
    h.dtype = DType::kBf16;
    h.raw_bytes = stored * 2 + 2;
    return h;
  }

  // Appends a packed record of `stored` random bytes under a new key.
  StoredKey Append(uint64_t stored) {
    StoredKey key;
    for (auto& b : key.bytes) b = static_cast<uint8_t>(rng_());
    std::vector<uint8_t>& bytes = payloads_[key];
    bytes.resize(stored);
    for (auto& b : bytes) b = static_cast<uint8_t>(rng_());
    // The caller's buffer is readable for exactly the payload (rounded to
    // whole pages here only because aligned_alloc wants it).
    Buffer buffer = Aligned(stored);
    std::copy(bytes.begin(), bytes.end(), buffer.get());
    const RecordHeader h = Header(key, stored, bytes);
    written_[key] = h;
    bool done = false;
    disk_->Append(h, buffer.get(), [&](Result<DiskLocation> where) {
      EXPECT_TRUE(where.has_value()) << where.error();
      if (where) where_[key] = *where;
      done = true;
    });
    EXPECT_TRUE(loop_.Drain([&] { return done; }, 30s));
    return key;
  }

  // Reads `key`'s record into a buffer of exactly its payload's pages.
  Status Read(const StoredKey& key, const DiskLocation& where, std::vector<uint8_t>* out = nullptr) {
    const uint64_t stored = written_.at(key).payload_bytes;
    Buffer dst = Aligned(stored);
    Status status = Status::Ok();
    uint64_t checksum = 0;
    bool done = false;
    disk_->Read(key, where, stored, dst.get(), [&](Status st, uint64_t c) {
      status = std::move(st);
      checksum = c;
      done = true;
    });
    EXPECT_TRUE(loop_.Drain([&] { return done; }, 30s));
    if (status.ok()) {
      EXPECT_EQ(checksum, written_.at(key).payload_checksum);
      if (out != nullptr) out->assign(dst.get(), dst.get() + stored);
    }
    return status;
  }

  tiers_test::CacheLoop loop_;
  std::string dir_;
  std::unique_ptr<MemoryDevice> device_;
  std::unique_ptr<DiskTier> disk_;
  std::mt19937_64 rng_{18};
  std::map<StoredKey, std::vector<uint8_t>> payloads_;
  std::map<StoredKey, RecordHeader> written_;
  std::map<StoredKey, DiskLocation> where_;
  bool carry_ = false;
  uint64_t relocated_ = 0;
};

TEST_F(PackedRecordTest, RecordsTakeTheirPayloadAndTrailerRoundedToPagesAndReadBackExactly) {
  uint64_t used = 0;
  for (uint64_t stored : {uint64_t{1}, uint64_t{100}, uint64_t{4000}, uint64_t{4001}, uint64_t{4096},
                          uint64_t{5000}, uint64_t{12288}, uint64_t{40000}}) {
    const StoredKey key = Append(stored);
    const DiskLocation& where = where_.at(key);
    EXPECT_TRUE(where.packed);
    EXPECT_EQ(where.record_bytes, AlignUpToPage(stored + 96)) << stored;
    used += where.record_bytes;
    EXPECT_EQ(disk_->used_bytes(), used);
    std::vector<uint8_t> back;
    ASSERT_TRUE(Read(key, where, &back).ok()) << stored;
    EXPECT_EQ(back, payloads_.at(key)) << stored;
    // The location the owner rebuilds from its compact index reads the same.
    const DiskLocation rebuilt = disk_->LocationOf(where.device, where.offset, stored, /*packed=*/true);
    EXPECT_EQ(rebuilt.record_bytes, where.record_bytes);
    EXPECT_TRUE(Read(key, rebuilt).ok());
  }
  // Packed and raw records side by side in one region: each reads its own.
  EXPECT_EQ(disk_->counters().checksum_failures, 0u);
}

TEST_F(PackedRecordTest, ARestartGivesBackTheCodecOwnerAndAnnotationAndTheRecordsStillRead) {
  const StoredKey small = Append(300);
  const StoredKey large = Append(9000);
  Close();
  Open();
  std::vector<DiskRecord> recovered = disk_->TakeRecovered();
  ASSERT_EQ(recovered.size(), 2u);
  for (const DiskRecord& r : recovered) {
    RecordHeader expected = written_.at(r.header.key);
    expected.sequence = r.header.sequence;
    EXPECT_EQ(r.header, expected);
    EXPECT_TRUE(r.location.packed);
    EXPECT_EQ(r.location.record_bytes, where_.at(r.header.key).record_bytes);
  }
  std::vector<uint8_t> back;
  ASSERT_TRUE(Read(small, where_.at(small), &back).ok());
  EXPECT_EQ(back, payloads_.at(small));
  ASSERT_TRUE(Read(large, where_.at(large), &back).ok());
  EXPECT_EQ(back, payloads_.at(large));
}

TEST_F(PackedRecordTest, DamageAnywhereInAPackedRecordIsCorruptionNeverData) {
  const StoredKey key = Append(9000);  // two whole pages, then tail and trailer
  const DiskLocation where = where_.at(key);
  ASSERT_TRUE(loop_.Drain([&] { return disk_->inflight() == 0; }, 30s));
  // A byte of the whole pages, of the tail's payload, of the trailer's key
  // and of its checksum.
  for (uint64_t at : {uint64_t{10}, uint64_t{8192 + 100}, where.record_bytes - 96 + 20, where.record_bytes - 1}) {
    uint8_t& b = device_->raw()[where.offset + at];
    b ^= 0x40;
    const Status st = Read(key, where);
    EXPECT_EQ(st.code(), StatusCode::kCorruption) << "byte " << at << ": " << st;
    b ^= 0x40;
  }
  EXPECT_TRUE(Read(key, where).ok());
  // Another key's read of this location, or a read for another size.
  StoredKey other = key;
  other.bytes[0] ^= 1;
  written_[other] = written_.at(key);
  EXPECT_EQ(Read(other, where).code(), StatusCode::kCorruption);
  written_[key].payload_bytes = 8999;
  EXPECT_EQ(Read(key, disk_->LocationOf(where.device, where.offset, 8999, true)).code(), StatusCode::kCorruption);
  written_[key].payload_bytes = 9000;
  EXPECT_EQ(disk_->counters().checksum_failures, 6u);
}

TEST_F(PackedRecordTest, AReclaimCarriesPackedRecordsForwardWithTheirOwnerAndAnnotation) {
  carry_ = true;
  // Eight regions of 64 KiB; records of 2 to 4 pages wrap the disk several
  // times, and every reclaim carries what it may.
  std::vector<StoredKey> keys;
  for (int i = 0; i < 120; ++i) keys.push_back(Append(5000 + 37 * static_cast<uint64_t>(i)));
  ASSERT_TRUE(loop_.Drain([&] { return disk_->inflight() == 0; }, 30s));
  EXPECT_GT(disk_->counters().records_carried, 0u);
  EXPECT_GT(relocated_, 0u);
  // Every record the owner still holds reads back exactly, carried or not.
  size_t held = 0;
  for (const auto& [key, where] : where_) {
    std::vector<uint8_t> back;
    ASSERT_TRUE(Read(key, where, &back).ok());
    EXPECT_EQ(back, payloads_.at(key));
    ++held;
  }
  EXPECT_GT(held, 0u);
  // After a restart the carried records keep their owner and annotation.
  Close();
  Open();
  for (const DiskRecord& r : disk_->TakeRecovered()) {
    if (where_.count(r.header.key) == 0) continue;
    EXPECT_EQ(r.header.owner, "tenant-a");
    EXPECT_EQ(r.header.annotation, "meta " + r.header.key.ToHex());
    EXPECT_EQ(r.header.codec, CodecKind::kLossless);
    EXPECT_EQ(r.location.offset, where_.at(r.header.key).offset);
  }
  EXPECT_EQ(disk_->counters().checksum_failures, 0u);
}

}  // namespace
}  // namespace kvtier
