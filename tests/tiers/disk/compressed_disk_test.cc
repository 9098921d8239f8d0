// BlockCache with a codec pool over a disk tier (issue 18): blocks whose
// store asked for lossless or fp8 are coded in host, written to disk packed
// and read back into host slots of their coded size; a load gets the block
// exactly (lossless), within fp8's bound (fp8), or misses. Real host backend, disk tier on a memory
// device, real codec pool.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <future>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/fp8_e4m3.h"
#include "tests/tiers/disk/cache_loop.h"
#include "tests/tiers/disk/memory_device.h"
#include "tests/tiers/coded_blocks.h"
#include "tests/tiers/tiers_test_util.h"
#include "tiers/block_cache.h"
#include "tiers/codec_pool.h"
#include "tiers/disk/disk_tier.h"
#include "devices/host_backend.h"

namespace kvtier {
namespace {

using namespace std::chrono_literals;
using tiers_test::EngineMemory;

constexpr uint64_t kRegionBytes = 256 * 1024;
constexpr TenantId kTenant = 0;
constexpr uint32_t kLoadBlock = 60;

// bf16 K and V of 3 layers, 16 tokens, 2 heads of 64: 24 KiB blocks.
LayoutSpec Spec() { return tiers_test::Bf16KvSpec("test/compressed", 3); }

CodecParams Codec(CodecKind kind) { return tiers_test::Bf16Codec(kind); }

class CompressedDiskTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kvtier-compressed-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    backend_ = HostBackend::Create({.copy_threads = 2}).value();
    engine_ = EngineMemory::Create(*backend_, Spec(), 64).value();
    device_ = std::make_unique<MemoryDevice>(regions_ * kRegionBytes);
  }
  void TearDown() override {
    Close();
    std::filesystem::remove_all(dir_);
  }

  void Open(bool with_pool = true, CodecPool::Options pool = {.threads = 2, .max_queued = 64}) {
    if (with_pool) pool_ = CodecPool::Create(pool).value();
    disk_ = tiers_test::OpenDiskUnder(&cache_, {device_.get()}, dir_ + "/index", kRegionBytes, loop_.post()).value();
    const uint64_t stride = SlotPool::StrideFor(engine_->block_bytes());
    BlockCache::Options o;
    // A backend that decodes no codec on load (as one without a kernel for
    // it): blocks stay raw in host, and packed records are decoded on the pool.
    no_decode_ = std::make_unique<tiers_test::HoldingBackend>(
        backend_.get(), tiers_test::HoldingBackend::Options{.decodes_on_load = false});
    o.backend = decodes_on_load_ ? static_cast<DeviceBackend*>(backend_.get()) : no_decode_.get();
    o.post = loop_.post();
    o.host_bytes = 16 * stride;
    o.host_watermarks = {.high = 0.9, .low = 0.5};
    o.disk = disk_.get();
    o.codecs = pool_.get();
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
    pool_.reset();
  }
  bool Drain(const std::function<bool()>& until) { return loop_.Drain(until, 30s); }

  EngineTarget Target(CodecKind codec) {
    return {engine_->layout(), engine_->mapping(), -1, Codec(codec)};
  }

  // Values as K and V look.
  void FillKv(uint32_t block, std::vector<uint8_t>* saved) {
    std::span<uint8_t> bytes = engine_->block(block);
    tiers_test::FillKvLike(rng_, bytes);
    saved->assign(bytes.begin(), bytes.end());
  }

  StoredKey NewKey() { return tiers_test::RandomKey(rng_); }

  // Stores a new block under `codec`; returns its key. Demotions settle after.
  StoredKey Store(CodecKind codec) {
    const StoredKey key = NewKey();
    const uint32_t block = next_block_++ % 32;
    FillKv(block, &stored_[key]);
    bool done = false;
    OpOutcome out;
    cache_->Store(kTenant, std::span(&key, 1), std::span(&block, 1), std::nullopt, Target(codec), owner_,
                  [&](OpOutcome o) {
                    out = o;
                    done = true;
                  });
    EXPECT_TRUE(Drain([&] { return done; }));
    EXPECT_TRUE(out.status.ok()) << out.status;
    EXPECT_TRUE(Drain([&] { return cache_->inflight_copies() == 0; }));
    return key;
  }

  // Loads `key` into engine block kLoadBlock; whether it loaded.
  bool Load(const StoredKey& key, CodecKind codec) {
    std::memset(engine_->block(kLoadBlock).data(), 0, engine_->block_bytes());
    bool done = false;
    OpOutcome out;
    const uint32_t block = kLoadBlock;
    cache_->Load(kTenant, std::span(&key, 1), std::span(&block, 1), Target(codec), owner_, [&](OpOutcome o) {
      out = o;
      done = true;
    });
    EXPECT_TRUE(Drain([&] { return done; }));
    return out.status.ok() && out.blocks == 1;
  }
  std::vector<uint8_t> Loaded() {
    const std::span<uint8_t> b = engine_->block(kLoadBlock);
    return {b.begin(), b.end()};
  }

  // Every element of `got` within fp8's bound of `want` (groups of 64).
  static bool WithinFp8Bound(const std::vector<uint8_t>& want, const std::vector<uint8_t>& got) {
    return kvtier::WithinFp8Bound(Codec(CodecKind::kFp8), want, got);
  }

  std::vector<StoredKey> OnDisk(const std::vector<StoredKey>& keys) {
    std::vector<StoredKey> out;
    for (const StoredKey& k : keys) {
      const CacheLookup r = cache_->Lookup(kTenant, std::span(&k, 1));
      if (r.hits == 1 && r.tiers[0] == Tier::kDisk) out.push_back(k);
    }
    return out;
  }

  tiers_test::CacheLoop loop_;
  std::string dir_;
  uint64_t regions_ = 16;
  std::mt19937_64 rng_{1818};
  std::unique_ptr<HostBackend> backend_;
  std::unique_ptr<tiers_test::HoldingBackend> no_decode_;
  bool decodes_on_load_ = true;
  std::unique_ptr<EngineMemory> engine_;
  std::unique_ptr<MemoryDevice> device_;
  std::unique_ptr<CodecPool> pool_;
  std::unique_ptr<DiskTier> disk_;
  std::unique_ptr<BlockCache> cache_;
  std::shared_ptr<void> owner_ = std::make_shared<int>(0);
  std::map<StoredKey, std::vector<uint8_t>> stored_;
  uint32_t next_block_ = 0;
  uint64_t adopted_ = 0;
};

TEST_F(CompressedDiskTest, LosslessBlocksGoToDiskPackedAndComeBackBitExactAlsoAfterARestart) {
  Open();
  std::vector<StoredKey> keys;
  for (int i = 0; i < 12; ++i) keys.push_back(Store(CodecKind::kLossless));
  cache_->FlushToDisk();
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0; }));
  const CacheCounters c = cache_->counters();
  EXPECT_EQ(c.codec_encoded, 12u);
  EXPECT_EQ(c.codec_pool_busy, 0u);
  // N(0,1) bf16 with outliers compresses about 1.3x; the disk tier is charged what it holds.
  EXPECT_LT(c.codec_stored_bytes * 12, c.codec_raw_bytes * 10) << c.codec_stored_bytes << " of " << c.codec_raw_bytes;
  const std::vector<StoredKey> on_disk = OnDisk(keys);
  ASSERT_GE(on_disk.size(), 8u);
  EXPECT_LT(cache_->Usage(Tier::kDisk).used_bytes, on_disk.size() * engine_->block_bytes());
  for (const StoredKey& k : on_disk) {
    ASSERT_TRUE(Load(k, CodecKind::kLossless));
    EXPECT_EQ(Loaded(), stored_.at(k));
  }
  // Read up into host slots of their coded size, as they are: decoded by
  // the loads' copies, never on the pool.
  EXPECT_EQ(cache_->counters().codec_decoded, 0u);
  EXPECT_GE(cache_->counters().disk_promotions, on_disk.size());
  // A restart is warm: the packed records are adopted and decode exactly, for
  // a cache registered without a codec too (the same namespace, bit-exact).
  Close();
  Open();
  EXPECT_EQ(adopted_, keys.size());
  for (const StoredKey& k : keys) {
    ASSERT_TRUE(Load(k, CodecKind::kNone));
    EXPECT_EQ(Loaded(), stored_.at(k));
  }
  EXPECT_EQ(cache_->counters().codec_decode_failures, 0u);
  EXPECT_EQ(cache_->counters().disk_read_failures, 0u);
}

TEST_F(CompressedDiskTest, WithABackendThatCannotDecodeOnLoadPackedRecordsAreDecodedOnThePool) {
  decodes_on_load_ = false;
  Open();
  std::vector<StoredKey> keys;
  for (int i = 0; i < 8; ++i) keys.push_back(Store(i % 2 == 0 ? CodecKind::kLossless : CodecKind::kFp8));
  EXPECT_EQ(cache_->counters().codec_host_coded, 0u) << "host holds what its loads can copy";
  EXPECT_EQ(cache_->counters().codec_encoded, 0u);
  cache_->FlushToDisk();
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0; }));
  EXPECT_EQ(cache_->counters().codec_encoded, 8u) << "written packed";
  const std::vector<StoredKey> on_disk = OnDisk(keys);
  ASSERT_EQ(on_disk.size(), keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    const CodecKind codec = i % 2 == 0 ? CodecKind::kLossless : CodecKind::kFp8;
    ASSERT_TRUE(Load(keys[i], codec));
    if (codec == CodecKind::kLossless) {
      EXPECT_EQ(Loaded(), stored_.at(keys[i]));
    } else {
      EXPECT_TRUE(WithinFp8Bound(stored_.at(keys[i]), Loaded()));
    }
  }
  EXPECT_EQ(cache_->counters().codec_decoded, keys.size());
  EXPECT_EQ(cache_->counters().codec_decode_failures, 0u);
}

TEST_F(CompressedDiskTest, Fp8BlocksComeBackWithinTheBoundInANamespaceOfTheirOwn) {
  Open();
  std::vector<StoredKey> keys;
  for (int i = 0; i < 10; ++i) keys.push_back(Store(CodecKind::kFp8));
  cache_->FlushToDisk();
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0; }));
  const CacheCounters c = cache_->counters();
  EXPECT_EQ(c.codec_encoded, 10u);
  // One byte per element and a 4-byte scale per 64: 1.88x.
  EXPECT_EQ(c.codec_stored_bytes * 64 * 2, c.codec_raw_bytes * (64 + 4));
  const std::vector<NamespaceUsage> spaces = cache_->UsageByNamespace(std::nullopt);
  ASSERT_EQ(spaces.size(), 1u);
  EXPECT_NE(spaces[0].fingerprint, engine_->layout()->layout().fingerprint()) << "fp8 blocks must not share the raw namespace";
  EXPECT_EQ(spaces[0].fingerprint, CodedFingerprint(engine_->layout()->layout().fingerprint(), Codec(CodecKind::kFp8)));
  for (const StoredKey& k : OnDisk(keys)) {
    ASSERT_TRUE(Load(k, CodecKind::kFp8));
    EXPECT_TRUE(WithinFp8Bound(stored_.at(k), Loaded()));
    EXPECT_NE(Loaded(), stored_.at(k)) << "fp8 is lossy: some element must have changed";
  }
  // After a restart, and carried through a promotion and demotion again
  // (no second rounding: a decoded block re-encodes to the same codes).
  Close();
  Open();
  EXPECT_EQ(adopted_, keys.size());
  for (const StoredKey& k : keys) {
    ASSERT_TRUE(Load(k, CodecKind::kFp8));
    EXPECT_TRUE(WithinFp8Bound(stored_.at(k), Loaded()));
  }
}

TEST_F(CompressedDiskTest, ANaNBlockIsStoredRawAndExact) {
  Open();
  const StoredKey key = NewKey();
  const uint32_t block = 0;
  FillKv(block, &stored_[key]);
  const uint16_t nan = 0x7fc0;
  std::memcpy(engine_->block(block).data() + 1000, &nan, 2);
  stored_[key][1000] = 0xc0;
  stored_[key][1001] = 0x7f;
  bool done = false;
  cache_->Store(kTenant, std::span(&key, 1), std::span(&block, 1), std::nullopt, Target(CodecKind::kFp8), owner_,
                [&](OpOutcome) { done = true; });
  ASSERT_TRUE(Drain([&] { return done && cache_->inflight_copies() == 0; }));
  cache_->FlushToDisk();
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0; }));
  EXPECT_EQ(cache_->counters().codec_not_worth_it, 1u);
  EXPECT_EQ(cache_->counters().codec_encoded, 0u);
  for (int i = 0; i < 6; ++i) Store(CodecKind::kFp8);  // pushes it out of host
  cache_->FlushToDisk();
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0; }));
  ASSERT_EQ(OnDisk({key}).size(), 1u);
  ASSERT_TRUE(Load(key, CodecKind::kFp8));
  EXPECT_EQ(Loaded(), stored_.at(key));
}

TEST_F(CompressedDiskTest, ABusyPoolWritesBlocksRawAndCountsItAStoreNeverWaits) {
  Open(true, {.threads = 1, .max_queued = 1});
  // The pool's one thread is held, and its queue of one is taken.
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  ASSERT_TRUE(pool_->TryRun([gate](BlockCodec&) { gate.wait(); }));
  while (pool_->counters().queued != 0) std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(pool_->TryRun([](BlockCodec&) {}));
  std::vector<StoredKey> keys;
  for (int i = 0; i < 8; ++i) keys.push_back(Store(CodecKind::kLossless));
  cache_->FlushToDisk();
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0; }));
  const CacheCounters c = cache_->counters();
  EXPECT_EQ(c.codec_encoded, 0u);
  EXPECT_GE(c.codec_pool_busy, 8u);
  release.set_value();
  for (const StoredKey& k : OnDisk(keys)) {
    ASSERT_TRUE(Load(k, CodecKind::kLossless));
    EXPECT_EQ(Loaded(), stored_.at(k));
  }
}

// With a disk tier, the encodes of its writes come first: a host block's
// compaction takes only the first half of the pool's queue, so a pool that
// falls behind keeps the rest for write-back.
TEST_F(CompressedDiskTest, CompactionsLeaveTheSecondHalfOfThePoolsQueueToDiskWrites) {
  Open(true, {.threads = 1, .max_queued = 4});
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  ASSERT_TRUE(pool_->TryRun([gate](BlockCodec&) { gate.wait(); }));
  while (pool_->counters().queued != 0) std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(pool_->TryRun([](BlockCodec&) {}));
  // Stored, not waiting for the compaction that waits for the pool.
  auto store = [&]() {
    const StoredKey key = NewKey();
    const uint32_t block = next_block_++;
    FillKv(block, &stored_[key]);
    bool done = false;
    cache_->Store(kTenant, std::span(&key, 1), std::span(&block, 1), std::nullopt, Target(CodecKind::kLossless),
                  owner_, [&](OpOutcome o) {
                    EXPECT_TRUE(o.status.ok()) << o.status;
                    done = true;
                  });
    EXPECT_TRUE(Drain([&] { return done; }));
    return key;
  };
  const StoredKey first = store();  // queued: 1 of 4 before it
  EXPECT_EQ(pool_->counters().queued, 2u);
  EXPECT_EQ(cache_->counters().codec_pool_busy, 0u);
  const StoredKey second = store();  // half the queue is taken
  EXPECT_EQ(pool_->counters().queued, 2u);
  EXPECT_EQ(cache_->counters().codec_pool_busy, 1u);
  // The disk write of the block kept raw still gets a place to be encoded.
  cache_->FlushToDisk();
  EXPECT_EQ(pool_->counters().queued, 3u);
  release.set_value();
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
  const CacheCounters c = cache_->counters();
  EXPECT_EQ(c.codec_host_coded, 1u);
  EXPECT_EQ(c.codec_encoded, 2u) << "one compaction, one disk write";
  for (const StoredKey& k : {first, second}) {
    ASSERT_TRUE(Load(k, CodecKind::kLossless));
    EXPECT_EQ(Loaded(), stored_.at(k));
  }
}

TEST_F(CompressedDiskTest, ADamagedPackedRecordIsAMissNeverData) {
  Open();
  std::vector<StoredKey> keys;
  for (int i = 0; i < 8; ++i) keys.push_back(Store(CodecKind::kLossless));
  cache_->FlushToDisk();
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
  const std::vector<StoredKey> on_disk = OnDisk(keys);
  ASSERT_FALSE(on_disk.empty());
  // Flip a byte in the middle of every record on the device.
  device_->WaitIdle();
  for (uint64_t at = 5000; at < device_->size_bytes(); at += kRegionBytes / 16) device_->raw()[at] ^= 0x10;
  uint64_t served = 0;
  for (const StoredKey& k : on_disk) {
    if (!Load(k, CodecKind::kLossless)) continue;
    EXPECT_EQ(Loaded(), stored_.at(k)) << "a damaged record was served";
    ++served;
  }
  EXPECT_LT(served, on_disk.size());
  EXPECT_GT(cache_->counters().disk_read_failures, 0u);
}

TEST_F(CompressedDiskTest, VerifyChecksPackedRecordsAndDropsADamagedOne) {
  Open();
  std::vector<StoredKey> keys;
  for (int i = 0; i < 10; ++i) keys.push_back(Store(i % 2 == 0 ? CodecKind::kLossless : CodecKind::kFp8));
  cache_->FlushToDisk();
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
  std::shared_ptr<const VerifyProgress> p = cache_->VerifyDisk(4);
  ASSERT_TRUE(Drain([&] { return p->done; }));
  EXPECT_EQ(p->total, keys.size());
  EXPECT_EQ(p->checked, keys.size());
  EXPECT_EQ(p->bad, 0u);
  // One byte of the first record (a packed lossless one) flipped.
  device_->WaitIdle();
  device_->raw()[100] ^= 0x01;
  std::shared_ptr<const VerifyProgress> again = cache_->VerifyDisk(4);
  ASSERT_TRUE(Drain([&] { return again->done; }));
  EXPECT_EQ(again->bad, 1u);
  EXPECT_EQ(cache_->present_blocks(Presence::kDisk), keys.size() - 1);
}

TEST_F(CompressedDiskTest, WithoutACodecPoolAtRestartPackedRecordsAreForgottenNotServed) {
  Open();
  std::vector<StoredKey> keys;
  for (int i = 0; i < 6; ++i) keys.push_back(Store(CodecKind::kLossless));
  cache_->FlushToDisk();
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0; }));
  Close();
  Open(/*with_pool=*/false);
  EXPECT_EQ(adopted_, 0u);
  for (const StoredKey& k : keys) EXPECT_FALSE(Load(k, CodecKind::kLossless));
}

// The point of it: at equal disk bytes, wrapping many times, the disk holds
// more lossless blocks than raw ones. N(0,1) bf16 codes about 1.4x, but
// records are whole pages: a 24 KiB block takes 6 pages raw and 5 coded,
// 1.2x. Each store's copies end before the next store: with the codec pool
// busy, a block is written raw by design, and how often that happens depends
// on how fast the machine is, not on what this test is about.
TEST_F(CompressedDiskTest, AFullDiskHoldsMoreLosslessBlocksThanRawOnes) {
  uint64_t held[2] = {};
  for (int run = 0; run < 2; ++run) {
    const CodecKind codec = run == 0 ? CodecKind::kNone : CodecKind::kLossless;
    device_ = std::make_unique<MemoryDevice>(regions_ * kRegionBytes);
    std::filesystem::remove_all(dir_ + "/index");
    Open();
    std::vector<StoredKey> keys;
    for (int i = 0; i < 600; ++i) {
      keys.push_back(Store(codec));
      ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
    }
    EXPECT_EQ(cache_->counters().codec_pool_busy, 0u);
    held[run] = cache_->present_blocks(Presence::kDisk);
    EXPECT_GT(disk_->counters().regions_reclaimed, regions_ * 2) << "the disk must wrap several times";
    // What it holds loads exactly.
    for (const StoredKey& k : OnDisk({keys.end() - 20, keys.end()})) {
      ASSERT_TRUE(Load(k, codec));
      EXPECT_EQ(Loaded(), stored_.at(k));
    }
    Close();
  }
  EXPECT_GT(held[1] * 100, held[0] * 115) << "raw " << held[0] << " blocks, lossless " << held[1];
  std::printf("disk of %llu bytes holds %llu raw blocks, %llu lossless ones\n",
              static_cast<unsigned long long>(regions_ * kRegionBytes), static_cast<unsigned long long>(held[0]),
              static_cast<unsigned long long>(held[1]));
}

}  // namespace
}  // namespace kvtier
