// DiskTier's record formats (record.h), against the tier alone (the
// cache's side is tested where it stores compressed blocks): the bare
// records it writes, raw and coded, and the header-page and trailer records
// of older releases (written with Options::legacy_records): their size on
// disk, reads, damage, restarts and carries, and an older disk opened by
// this release.
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

// A tier over a memory device, writing as it does now (bare records) or as
// an older release did (`legacy`: Options::legacy_records).
class RecordTierTest : public ::testing::Test {
 protected:
  explicit RecordTierTest(bool legacy) : legacy_(legacy) {}
  void SetUp() override {
    char tmpl[] = "/tmp/kvtier-records-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    device_ = std::make_unique<MemoryDevice>(8 * kRegionBytes);
    Open();
  }
  void Reopen(bool legacy) {
    Close();
    legacy_ = legacy;
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
         },
         .legacy_records = legacy_});
    ASSERT_TRUE(disk.has_value()) << disk.error();
    disk_ = std::move(*disk);
  }
  void Close() {
    if (disk_) {
      EXPECT_TRUE(loop_.Drain([&] { return disk_->inflight() == 0; }, 30s));
    }
    disk_.reset();
  }
  RecordFormat Format(bool packed) const { return legacy_ ? LegacyFormat(packed) : RecordFormat::kBare; }

  // The owner's side of a reclaim: current records are carried when asked
  // to (with all the owner knows of them: the index's fields), else dropped.
  ReclaimAnswer Reclaim(const StoredKey& key, const DiskLocation& where, bool may_carry) {
    auto it = where_.find(key);
    if (it == where_.end() || it->second.offset != where.offset) return {};
    if (carry_ && may_carry) {
      ReclaimAnswer carry(ReclaimAction::kCarry);
      carry.header = written_.at(key);
      carry.format = it->second.format;
      return carry;
    }
    where_.erase(it);
    return {ReclaimAction::kDropped};
  }

  RecordHeader Header(const StoredKey& key, uint64_t stored, std::span<const uint8_t> payload, bool packed,
                      bool annotated) {
    RecordHeader h;
    h.key = key;
    h.ns.bytes[0] = 7;
    h.payload_bytes = stored;
    h.payload_checksum = PayloadChecksum(payload);
    h.owner = "tenant-a";
    if (annotated) h.annotation = "meta " + key.ToHex();
    if (packed) {
      h.codec = CodecKind::kLossless;
      h.dtype = DType::kBf16;
      h.raw_bytes = stored * 2 + 2;
    }
    return h;
  }

  // Appends a record of `stored` random bytes under a new key: a codec's
  // output (packed), or a raw block; with an annotation or none.
  StoredKey Append(uint64_t stored, bool packed = true, bool annotated = true) {
    StoredKey key;
    for (auto& b : key.bytes) b = static_cast<uint8_t>(rng_());
    std::vector<uint8_t>& bytes = payloads_[key];
    bytes.resize(stored);
    for (auto& b : bytes) b = static_cast<uint8_t>(rng_());
    // The caller's buffer is readable for exactly the payload (rounded to
    // whole pages here only because aligned_alloc wants it; the padding is
    // garbage that must not reach the disk).
    Buffer buffer = Aligned(stored);
    std::fill(buffer.get(), buffer.get() + AlignUpToPage(stored), uint8_t{0xa5});
    std::copy(bytes.begin(), bytes.end(), buffer.get());
    const RecordHeader h = Header(key, stored, bytes, packed, annotated);
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
  bool legacy_ = false;
  std::mt19937_64 rng_{18};
  std::map<StoredKey, std::vector<uint8_t>> payloads_;
  std::map<StoredKey, RecordHeader> written_;
  std::map<StoredKey, DiskLocation> where_;
  bool carry_ = false;
  uint64_t relocated_ = 0;
};

// The tests that run over both (GetParam(): legacy).
class RecordFormatTest : public RecordTierTest, public ::testing::WithParamInterface<bool> {
 protected:
  RecordFormatTest() : RecordTierTest(GetParam()) {}
};

INSTANTIATE_TEST_SUITE_P(Formats, RecordFormatTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& param_info) { return param_info.param ? "Legacy" : "Bare"; });

TEST_P(RecordFormatTest, RecordsTakeWhatTheirFormatSaysAndReadBackExactly) {
  uint64_t used = 0;
  for (bool packed : {true, false}) {
    for (uint64_t stored : {uint64_t{1}, uint64_t{100}, uint64_t{4000}, uint64_t{4001}, uint64_t{4096},
                            uint64_t{5000}, uint64_t{12288}, uint64_t{16384}, uint64_t{40000}}) {
      const StoredKey key = Append(stored, packed);
      const DiskLocation& where = where_.at(key);
      EXPECT_EQ(where.packed, packed);
      EXPECT_EQ(where.format, Format(packed));
      EXPECT_EQ(where.checksum, written_.at(key).payload_checksum);
      // A bare record is its payload in whole pages: nothing else.
      const uint64_t expected = !legacy_ ? AlignUpToPage(stored)
                                : packed ? AlignUpToPage(stored + 96)
                                         : 4096 + AlignUpToPage(stored);
      EXPECT_EQ(where.record_bytes, expected) << stored;
      used += where.record_bytes;
      EXPECT_EQ(disk_->used_bytes(), used);
      std::vector<uint8_t> back;
      ASSERT_TRUE(Read(key, where, &back).ok()) << stored;
      EXPECT_EQ(back, payloads_.at(key)) << stored;
      // The location the owner rebuilds from its compact index reads the same.
      const DiskLocation rebuilt = disk_->LocationOf({.device = where.device,
                                                      .offset = where.offset,
                                                      .payload_bytes = stored,
                                                      .packed = packed,
                                                      .format = where.format,
                                                      .checksum = where.checksum});
      EXPECT_EQ(rebuilt.record_bytes, where.record_bytes);
      EXPECT_TRUE(Read(key, rebuilt).ok());
      if (!legacy_ && stored % 4096 != 0) {
        // The padding on disk is zeros, never what the caller's buffer held.
        for (uint64_t at = stored; at < where.record_bytes; ++at) {
          ASSERT_EQ(device_->raw()[where.offset + at], 0) << stored << " at " << at;
        }
      }
    }
  }
  EXPECT_EQ(disk_->counters().checksum_failures, 0u);
}

TEST_P(RecordFormatTest, ARestartGivesBackTheCodecOwnerAndAnnotationAndTheRecordsStillRead) {
  const StoredKey small = Append(300);
  const StoredKey large = Append(9000);
  const StoredKey raw = Append(8192, /*packed=*/false);
  Close();
  Open();
  std::vector<DiskRecord> recovered = disk_->TakeRecovered();
  ASSERT_EQ(recovered.size(), 3u);
  for (const DiskRecord& r : recovered) {
    RecordHeader expected = written_.at(r.header.key);
    expected.sequence = r.header.sequence;
    EXPECT_EQ(r.header, expected);
    const DiskLocation& before = where_.at(r.header.key);
    EXPECT_EQ(r.location.packed, r.header.key != raw);
    EXPECT_EQ(r.location.format, before.format);
    EXPECT_EQ(r.location.checksum, before.checksum);
    EXPECT_EQ(r.location.record_bytes, before.record_bytes);
  }
  for (const StoredKey& key : {small, large, raw}) {
    std::vector<uint8_t> back;
    ASSERT_TRUE(Read(key, where_.at(key), &back).ok());
    EXPECT_EQ(back, payloads_.at(key));
  }
}

TEST_P(RecordFormatTest, DamageAnywhereInARecordIsCorruptionNeverData) {
  const StoredKey key = Append(9000);  // two whole pages, then the tail
  const DiskLocation where = where_.at(key);
  ASSERT_TRUE(loop_.Drain([&] { return disk_->inflight() == 0; }, 30s));
  // A byte of the whole pages and of the tail's payload; of an older
  // record's trailer, its key and its checksum.
  std::vector<uint64_t> bytes = {10, 8192 + 100, 9000 - 1};
  if (legacy_) bytes.insert(bytes.end(), {where.record_bytes - 96 + 20, where.record_bytes - 1});
  for (uint64_t at : bytes) {
    uint8_t& b = device_->raw()[where.offset + at];
    b ^= 0x40;
    const Status st = Read(key, where);
    EXPECT_EQ(st.code(), StatusCode::kCorruption) << "byte " << at << ": " << st;
    b ^= 0x40;
  }
  EXPECT_TRUE(Read(key, where).ok());
  uint64_t failures = bytes.size();
  // The index naming another block here (a stale entry, a reused region):
  // that block's checksum is not what the bytes have.
  StoredKey other = key;
  other.bytes[0] ^= 1;
  written_[other] = written_.at(key);
  written_[other].payload_checksum ^= 1;
  DiskLocation stale = where;
  stale.checksum = written_[other].payload_checksum;
  EXPECT_EQ(Read(other, stale).code(), StatusCode::kCorruption);
  ++failures;
  if (legacy_) {
    // An older record names its key: another key's read fails even with
    // the right checksum.
    written_[other].payload_checksum = written_.at(key).payload_checksum;
    EXPECT_EQ(Read(other, where).code(), StatusCode::kCorruption);
    ++failures;
  }
  // A read for another size.
  written_[key].payload_bytes = 8999;
  EXPECT_EQ(Read(key, disk_->LocationOf({.device = where.device,
                                         .offset = where.offset,
                                         .payload_bytes = 8999,
                                         .packed = true,
                                         .format = where.format,
                                         .checksum = where.checksum}))
                .code(),
            StatusCode::kCorruption);
  ++failures;
  written_[key].payload_bytes = 9000;
  EXPECT_EQ(disk_->counters().checksum_failures, failures);
}

TEST_P(RecordFormatTest, AReclaimCarriesRecordsForwardAsBareOnesWithTheirOwnerAndAnnotation) {
  carry_ = true;
  // Eight regions of 64 KiB; records of 2 to 4 pages wrap the disk several
  // times, and every reclaim carries what it may.
  std::vector<StoredKey> keys;
  for (int i = 0; i < 120; ++i) keys.push_back(Append(5000 + 37 * static_cast<uint64_t>(i), i % 3 != 0));
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
    EXPECT_EQ(r.header.codec, written_.at(r.header.key).codec);
    EXPECT_EQ(r.location.offset, where_.at(r.header.key).offset);
    EXPECT_EQ(r.location.format, where_.at(r.header.key).format);
  }
  EXPECT_EQ(disk_->counters().checksum_failures, 0u);
}

// A disk written by an older release (header-page and trailer records, with
// and without annotations), opened by this one: every record is recovered
// and read, a reclaim carries them forward as bare records, and a second
// restart finds the mix.
class OlderDiskTest : public RecordTierTest {
 protected:
  OlderDiskTest() : RecordTierTest(/*legacy=*/true) {}
};

TEST_F(OlderDiskTest, ItsRecordsAreReadAndCarriedForwardAsBareOnes) {
  // Written by the older release: raw records with a header page (version 2
  // with an annotation, version 1 without) and coded ones with a trailer.
  std::vector<StoredKey> old_keys;
  for (int i = 0; i < 14; ++i) {
    old_keys.push_back(Append(4096 * (1 + i % 4) + (i % 2 == 0 ? 0 : 700), /*packed=*/i % 3 == 0,
                              /*annotated=*/i % 4 != 1));
  }
  Reopen(/*legacy=*/false);
  std::vector<DiskRecord> recovered = disk_->TakeRecovered();
  ASSERT_EQ(recovered.size(), old_keys.size());
  for (const DiskRecord& r : recovered) {
    EXPECT_EQ(r.location.format, LegacyFormat(r.header.packed()));
    EXPECT_EQ(r.location.checksum, written_.at(r.header.key).payload_checksum);
    RecordHeader expected = written_.at(r.header.key);
    expected.sequence = r.header.sequence;
    EXPECT_EQ(r.header, expected);
    where_[r.header.key] = r.location;
  }
  for (const StoredKey& key : old_keys) {
    std::vector<uint8_t> back;
    ASSERT_TRUE(Read(key, where_.at(key), &back).ok());
    EXPECT_EQ(back, payloads_.at(key));
  }
  // New records beside the old ones, enough to wrap the disk; each reclaim
  // carries what it may.
  carry_ = true;
  for (int i = 0; i < 80; ++i) Append(4096 * (1 + i % 3), /*packed=*/i % 2 == 0);
  ASSERT_TRUE(loop_.Drain([&] { return disk_->inflight() == 0; }, 30s));
  EXPECT_GT(disk_->counters().records_carried, 0u);
  size_t carried_old = 0;
  for (const StoredKey& key : old_keys) {
    auto it = where_.find(key);
    if (it == where_.end()) continue;
    if (it->second.format == RecordFormat::kBare) ++carried_old;
    std::vector<uint8_t> back;
    ASSERT_TRUE(Read(key, it->second, &back).ok());
    EXPECT_EQ(back, payloads_.at(key));
  }
  EXPECT_GT(carried_old, 0u) << "no record of the older release was carried forward";
  Reopen(/*legacy=*/false);
  size_t found = 0;
  for (const DiskRecord& r : disk_->TakeRecovered()) {
    auto it = where_.find(r.header.key);
    if (it == where_.end()) continue;
    ++found;
    EXPECT_EQ(r.location.format, it->second.format);
    EXPECT_EQ(r.header.owner, "tenant-a");
    EXPECT_EQ(r.header.annotation, written_.at(r.header.key).annotation);
    std::vector<uint8_t> back;
    ASSERT_TRUE(Read(r.header.key, r.location, &back).ok());
    EXPECT_EQ(back, payloads_.at(r.header.key));
  }
  EXPECT_EQ(found, where_.size());
  EXPECT_EQ(disk_->counters().checksum_failures, 0u);
}

}  // namespace
}  // namespace kvtier
