// The host tier holding coded blocks (issue 18): a block whose store asked
// for lossless or fp8 is encoded on the codec pool after its store and moved
// into a host slot of its coded size; a load decodes it on its way into the
// engine's pages. Real host backend and codec pool; no disk tier (the host
// tier is full and evicts, its steady state), and one with an hbm tier.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "kernels/codec.h"
#include "kernels/fp8_e4m3.h"
#include "tests/tiers/disk/cache_loop.h"
#include "tests/tiers/coded_blocks.h"
#include "tests/tiers/tiers_test_util.h"
#include "tiers/block_cache.h"
#include "tiers/codec_pool.h"
#include "devices/host_backend.h"

namespace kvtier {
namespace {

using namespace std::chrono_literals;
using tiers_test::EngineMemory;
using tiers_test::HoldingBackend;

constexpr TenantId kTenant = 0;
constexpr uint32_t kLoadBlock = 60;

// bf16 K and V of 12 layers, 16 tokens, 2 heads of 64: 96 KiB blocks (so
// that slots' 4 KiB granularity costs little, as with real models' blocks).
LayoutSpec Spec() { return tiers_test::Bf16KvSpec("test/coded-host", 12); }

CodecParams Codec(CodecKind kind) { return tiers_test::Bf16Codec(kind); }

struct Config {
  uint64_t host_slots = 32;  // of raw blocks
  uint64_t hbm_slots = 0;
  CodecPool::Options pool = {.threads = 2, .max_queued = 64};
  bool hold_loads = false;  // a HoldingBackend in between
  bool encodes_on_store = false;  // one that codes fp8 stores on their way, as the cuda backend does
};

class CodedHostTest : public ::testing::Test {
 protected:
  void Open(const Config& config) {
    backend_ = HostBackend::Create({.copy_threads = 2}).value();
    holding_ = std::make_unique<HoldingBackend>(
        backend_.get(), HoldingBackend::Options{.encodes_on_store = config.encodes_on_store});
    engine_ = EngineMemory::Create(*backend_, Spec(), 64).value();
    pool_ = CodecPool::Create(config.pool).value();
    const uint64_t stride = SlotPool::StrideFor(engine_->block_bytes());
    BlockCache::Options o;
    const bool wrapped = config.hold_loads || config.encodes_on_store;
    o.backend = wrapped ? static_cast<DeviceBackend*>(holding_.get()) : backend_.get();
    o.post = loop_.post();
    o.host_bytes = config.host_slots * stride;
    o.hbm_bytes = config.hbm_slots * stride;
    o.codecs = pool_.get();
    cache_ = BlockCache::Create(std::move(o)).value();
    cache_->SetTenantName(kTenant, "t0");
  }
  void TearDown() override {
    holding_->HoldLoads(false);
    holding_->ReleaseAll();
    if (cache_) {
      EXPECT_TRUE(Drain([&] { return cache_->inflight_copies() == 0; }));
    }
    cache_.reset();
    pool_.reset();
  }
  bool Drain(const std::function<bool()>& until) { return loop_.Drain(until, 30s); }

  EngineTarget Target(CodecKind codec) { return {engine_->layout(), engine_->mapping(), -1, Codec(codec)}; }

  // Values as K and V look.
  void FillKv(uint32_t block, const StoredKey& key) {
    std::span<uint8_t> bytes = engine_->block(block);
    tiers_test::FillKvLike(rng_, bytes);
    stored_[key].assign(bytes.begin(), bytes.end());
  }
  StoredKey NewKey() { return tiers_test::RandomKey(rng_); }

  // Stores a new block under `codec` and waits until its compaction is over.
  StoredKey Store(CodecKind codec) {
    const StoredKey key = NewKey();
    const uint32_t block = next_block_++ % 32;
    FillKv(block, key);
    bool done = false;
    OpOutcome out;
    cache_->Store(kTenant, std::span(&key, 1), std::span(&block, 1), std::nullopt, Target(codec), owner_,
                  [&](OpOutcome o) {
                    out = o;
                    done = true;
                  });
    EXPECT_TRUE(Drain([&] { return done && cache_->inflight_copies() == 0; }));
    EXPECT_TRUE(out.status.ok()) << out.status;
    return key;
  }
  // Starts a load of `key` into engine block kLoadBlock (zeroed first).
  void StartLoad(const StoredKey& key, CodecKind codec, bool* done, OpOutcome* out) {
    std::memset(engine_->block(kLoadBlock).data(), 0, engine_->block_bytes());
    const uint32_t block = kLoadBlock;
    cache_->Load(kTenant, std::span(&key, 1), std::span(&block, 1), Target(codec), owner_, [=](OpOutcome o) {
      *out = o;
      *done = true;
    });
  }
  bool Load(const StoredKey& key, CodecKind codec) {
    bool done = false;
    OpOutcome out;
    StartLoad(key, codec, &done, &out);
    EXPECT_TRUE(Drain([&] { return done; }));
    return out.status.ok() && out.blocks == 1;
  }
  std::vector<uint8_t> Loaded() {
    const std::span<uint8_t> b = engine_->block(kLoadBlock);
    return {b.begin(), b.end()};
  }
  // What a load of `key` must give under `codec`: its bytes, or within fp8's bound.
  ::testing::AssertionResult LoadedRight(const StoredKey& key, CodecKind codec) {
    const std::vector<uint8_t>& want = stored_.at(key);
    if (codec == CodecKind::kFp8 ? WithinFp8Bound(Codec(codec), want, Loaded()) : Loaded() == want) {
      return ::testing::AssertionSuccess();
    }
    return ::testing::AssertionFailure() << "the block loaded is not what was stored (" << CodecName(codec) << ")";
  }
  Tier TierOf(const StoredKey& key) {
    const CacheLookup r = cache_->Lookup(kTenant, std::span(&key, 1));
    EXPECT_EQ(r.hits, 1u);
    return r.hits == 1 ? r.tiers[0] : Tier::kDisk;
  }

  tiers_test::CacheLoop loop_;
  std::mt19937_64 rng_{1818};
  std::unique_ptr<HostBackend> backend_;
  std::unique_ptr<HoldingBackend> holding_;
  std::unique_ptr<EngineMemory> engine_;
  std::unique_ptr<CodecPool> pool_;
  std::unique_ptr<BlockCache> cache_;
  std::shared_ptr<void> owner_ = std::make_shared<int>(0);
  std::map<StoredKey, std::vector<uint8_t>> stored_;
  uint32_t next_block_ = 0;
};

// The point of it: a full host tier, wrapping many times, holds more blocks
// coded than raw at equal bytes, and what it holds loads right.
TEST_F(CodedHostTest, AFullHostTierHoldsMoreCodedBlocksAndLoadsThemRight) {
  uint64_t held[3] = {};
  const CodecKind codecs[3] = {CodecKind::kNone, CodecKind::kLossless, CodecKind::kFp8};
  for (int run = 0; run < 3; ++run) {
    const CodecKind codec = codecs[run];
    Open({});
    std::vector<StoredKey> keys;
    for (int i = 0; i < 200; ++i) keys.push_back(Store(codec));
    held[run] = cache_->Usage(Tier::kHost).blocks;
    const CacheCounters c = cache_->counters();
    if (codec != CodecKind::kNone) {
      EXPECT_GT(c.codec_host_coded, 190u) << CodecName(codec);
      EXPECT_EQ(c.codec_pool_busy, 0u);
      EXPECT_LT(cache_->Usage(Tier::kHost).used_bytes, held[run] * engine_->block_bytes());
    }
    // The newest are in host; each loads right, decoded into the engine's pages.
    for (auto it = keys.end() - 10; it != keys.end(); ++it) {
      ASSERT_TRUE(Load(*it, codec)) << CodecName(codec);
      EXPECT_TRUE(LoadedRight(*it, codec));
    }
    if (codec == CodecKind::kFp8) {
      EXPECT_NE(Loaded(), stored_.at(keys.back())) << "fp8 is lossy";
    }
    EXPECT_EQ(cache_->counters().codec_decoded, 0u) << "host blocks are decoded by the loads' copies";
    TearDown();
  }
  EXPECT_EQ(held[0], 32u);
  EXPECT_GT(held[1] * 100, held[0] * 120) << "raw " << held[0] << ", lossless " << held[1];
  EXPECT_GT(held[2] * 100, held[0] * 170) << "raw " << held[0] << ", fp8 " << held[2];
  std::printf("a host tier of 32 raw blocks holds %llu lossless ones, %llu fp8 ones\n",
              static_cast<unsigned long long>(held[1]), static_cast<unsigned long long>(held[2]));
}

// A load that leased the block while it was raw reads the raw slot; the
// compaction that ends meanwhile keeps that slot until the load lets go.
TEST_F(CodedHostTest, ALoadOfTheRawSlotKeepsItUntilDoneWhileTheBlockBecomesCoded) {
  Open({.pool = {.threads = 1, .max_queued = 8}, .hold_loads = true});
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  ASSERT_TRUE(pool_->TryRun([gate](BlockCodec&) { gate.wait(); }));
  const StoredKey key = NewKey();
  const uint32_t block = 0;
  FillKv(block, key);
  bool stored = false;
  cache_->Store(kTenant, std::span(&key, 1), std::span(&block, 1), std::nullopt, Target(CodecKind::kLossless),
                owner_, [&](OpOutcome o) {
                  EXPECT_TRUE(o.status.ok()) << o.status;
                  stored = true;
                });
  ASSERT_TRUE(Drain([&] { return stored; }));  // its encode waits behind the gate
  holding_->HoldLoads(true);
  bool loaded = false;
  OpOutcome out;
  StartLoad(key, CodecKind::kLossless, &loaded, &out);
  ASSERT_TRUE(holding_->WaitHeld(1));  // copied from the raw slot; the lease is held
  release.set_value();
  ASSERT_TRUE(Drain([&] { return cache_->counters().codec_host_coded == 1; }));
  EXPECT_EQ(cache_->Usage(Tier::kHost).blocks, 1u);
  EXPECT_LT(cache_->Usage(Tier::kHost).used_bytes, engine_->block_bytes());
  holding_->HoldLoads(false);
  holding_->ReleaseAll();
  ASSERT_TRUE(Drain([&] { return loaded && cache_->inflight_copies() == 0; }));
  ASSERT_TRUE(out.status.ok()) << out.status;
  EXPECT_TRUE(LoadedRight(key, CodecKind::kLossless));
  // Now from the coded slot.
  ASSERT_TRUE(Load(key, CodecKind::kLossless));
  EXPECT_TRUE(LoadedRight(key, CodecKind::kLossless));
  bool evicted = false;
  cache_->Evict(EvictFilter{}, [&](uint64_t n) {
    EXPECT_EQ(n, 1u);
    evicted = true;
  });
  ASSERT_TRUE(Drain([&] { return evicted; }));
  EXPECT_EQ(cache_->Usage(Tier::kHost).used_bytes, 0u);
}

TEST_F(CodedHostTest, ABusyPoolKeepsBlocksRawAndCountsItAStoreNeverWaits) {
  Open({.pool = {.threads = 1, .max_queued = 1}});
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  ASSERT_TRUE(pool_->TryRun([gate](BlockCodec&) { gate.wait(); }));
  while (pool_->counters().queued != 0) std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(pool_->TryRun([](BlockCodec&) {}));  // the queue of one is taken
  std::vector<StoredKey> keys;
  for (int i = 0; i < 6; ++i) keys.push_back(Store(CodecKind::kLossless));
  const CacheCounters c = cache_->counters();
  EXPECT_EQ(c.codec_pool_busy, 6u);
  EXPECT_EQ(c.codec_host_coded, 0u);
  EXPECT_EQ(cache_->Usage(Tier::kHost).used_bytes, 6 * engine_->block_bytes());
  for (const StoredKey& k : keys) {
    ASSERT_TRUE(Load(k, CodecKind::kLossless));
    EXPECT_TRUE(LoadedRight(k, CodecKind::kLossless));
  }
  release.set_value();
}

TEST_F(CodedHostTest, AnFp8BlockWithANaNStaysRawAndExact) {
  Open({});
  const StoredKey key = NewKey();
  const uint32_t block = 0;
  FillKv(block, key);
  const uint16_t nan = 0x7fc0;
  std::memcpy(engine_->block(block).data() + 1000, &nan, 2);
  std::memcpy(stored_[key].data() + 1000, &nan, 2);
  bool done = false;
  cache_->Store(kTenant, std::span(&key, 1), std::span(&block, 1), std::nullopt, Target(CodecKind::kFp8), owner_,
                [&](OpOutcome) { done = true; });
  ASSERT_TRUE(Drain([&] { return done && cache_->inflight_copies() == 0; }));
  EXPECT_EQ(cache_->counters().codec_not_worth_it, 1u);
  EXPECT_EQ(cache_->counters().codec_host_coded, 0u);
  ASSERT_TRUE(Load(key, CodecKind::kFp8));
  EXPECT_EQ(Loaded(), stored_.at(key));
}

// hbm holds blocks as they are: blocks demoted from hbm are coded in host,
// and a coded host block is loaded from there, never promoted back.
TEST_F(CodedHostTest, BlocksDemotedFromHbmAreCodedAndStayInHost) {
  Open({.host_slots = 16, .hbm_slots = 10});
  std::vector<StoredKey> keys;
  for (int i = 0; i < 10; ++i) keys.push_back(Store(CodecKind::kFp8));
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0; }));
  // Past hbm's high watermark (0.9): its coldest went down to 0.8.
  EXPECT_EQ(cache_->Usage(Tier::kHbm).blocks, 8u);
  EXPECT_EQ(cache_->counters().codec_host_coded, 2u);
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(TierOf(keys[i]), Tier::kHost);
    ASSERT_TRUE(Load(keys[i], CodecKind::kFp8));
    EXPECT_TRUE(LoadedRight(keys[i], CodecKind::kFp8));
    ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0; }));
    EXPECT_EQ(TierOf(keys[i]), Tier::kHost) << "a coded block is not promoted to hbm";
  }
  EXPECT_EQ(cache_->counters().promotions, 0u);
  for (int i = 2; i < 10; ++i) {
    ASSERT_EQ(TierOf(keys[i]), Tier::kHbm);
    ASSERT_TRUE(Load(keys[i], CodecKind::kFp8));
    EXPECT_EQ(Loaded(), stored_.at(keys[i])) << "hbm holds the block itself";
  }
}

// Stores of 16 blocks into a full host tier of 32 raw slots: blocks being
// coded cannot be evicted, so at most 1/8 of the tier is coded at once (the
// rest wait their turn), and every store finds room.
TEST_F(CodedHostTest, BatchedStoresIntoASmallFullHostTierAllSucceed) {
  Open({.host_slots = 32});
  std::vector<StoredKey> keys;
  for (int round = 0; round < 10; ++round) {
    keys.clear();
    std::vector<uint32_t> blocks;
    for (uint32_t i = 0; i < 16; ++i) {
      keys.push_back(NewKey());
      blocks.push_back(i);
      FillKv(i, keys.back());
    }
    bool done = false;
    OpOutcome out;
    cache_->Store(kTenant, keys, blocks, std::nullopt, Target(CodecKind::kFp8), owner_, [&](OpOutcome o) {
      out = o;
      done = true;
    });
    ASSERT_TRUE(Drain([&] { return done; }));
    ASSERT_TRUE(out.status.ok()) << "round " << round << ": " << out.status;
    ASSERT_EQ(out.blocks, 16u);
  }
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0; }));
  EXPECT_GT(cache_->counters().codec_host_coded, 16u);
  for (const StoredKey& k : keys) {
    ASSERT_TRUE(Load(k, CodecKind::kFp8));
    EXPECT_TRUE(LoadedRight(k, CodecKind::kFp8));
  }
}

// A backend that codes fp8 stores on their way (the cuda backend's kernels;
// here the fake at the seam): blocks go straight into slots of their coded
// size, with no raw copy in host and no work for the codec pool, and load
// as the codec decodes them.
TEST_F(CodedHostTest, StoresCodedOnTheirWayGoStraightIntoCodedSlots) {
  Open({.encodes_on_store = true});
  std::vector<StoredKey> keys;
  for (int i = 0; i < 100; ++i) keys.push_back(Store(CodecKind::kFp8));
  const CacheCounters c = cache_->counters();
  EXPECT_EQ(c.codec_host_coded, 100u);
  EXPECT_EQ(c.codec_encoded, 100u);
  EXPECT_EQ(holding_->coded_stores(), 100u);
  EXPECT_EQ(pool_->counters().jobs, 0u) << "the pool encoded what the copy had coded";
  EXPECT_GT(cache_->Usage(Tier::kHost).blocks, 55u) << "of 32 raw slots";
  std::unique_ptr<BlockCodec> coder = BlockCodec::Create().value();
  const CodecParams fp8 = Codec(CodecKind::kFp8);
  std::vector<uint8_t> coded(BlockCodec::MaxEncodedBytes(fp8, engine_->block_bytes()));
  std::vector<uint8_t> want(engine_->block_bytes());
  for (auto it = keys.end() - 10; it != keys.end(); ++it) {
    ASSERT_TRUE(Load(*it, CodecKind::kFp8));
    const std::optional<size_t> n = coder->Encode(fp8, stored_.at(*it), coded);
    ASSERT_TRUE(n.has_value());
    ASSERT_TRUE(coder->Decode(fp8, std::span(coded.data(), *n), want).ok());
    EXPECT_EQ(Loaded(), want);
  }
}

// A block the copy does not code (a NaN) is gathered again as it is before
// the store is answered, into a raw slot; the others of its store stay coded.
TEST_F(CodedHostTest, ABlockTheCopyDoesNotCodeIsGatheredAgainAsItIs) {
  Open({.encodes_on_store = true});
  std::vector<StoredKey> keys;
  std::vector<uint32_t> blocks;
  for (uint32_t i = 0; i < 4; ++i) {
    keys.push_back(NewKey());
    blocks.push_back(i);
    FillKv(i, keys.back());
  }
  const uint16_t nan = 0x7fc0;
  std::memcpy(engine_->block(2).data() + 4000, &nan, 2);
  std::memcpy(stored_[keys[2]].data() + 4000, &nan, 2);
  bool done = false;
  OpOutcome out;
  cache_->Store(kTenant, keys, blocks, std::nullopt, Target(CodecKind::kFp8), owner_, [&](OpOutcome o) {
    out = o;
    done = true;
  });
  ASSERT_TRUE(Drain([&] { return done && cache_->inflight_copies() == 0; }));
  ASSERT_TRUE(out.status.ok()) << out.status;
  EXPECT_EQ(out.blocks, 4u);
  const CacheCounters c = cache_->counters();
  EXPECT_EQ(c.codec_host_coded, 3u);
  EXPECT_EQ(c.codec_not_worth_it, 1u);
  EXPECT_EQ(c.stores, 4u);
  EXPECT_EQ(pool_->counters().jobs, 0u) << "a block with a NaN is not tried again";
  EXPECT_EQ(cache_->Usage(Tier::kHost).used_bytes,
            3 * BlockCodec::MaxEncodedBytes(Codec(CodecKind::kFp8), engine_->block_bytes()) +
                engine_->block_bytes());
  for (uint32_t i = 0; i < 4; ++i) {
    ASSERT_TRUE(Load(keys[i], CodecKind::kFp8)) << i;
    if (i == 2) {
      EXPECT_EQ(Loaded(), stored_.at(keys[i])) << "the block itself";
    } else {
      EXPECT_TRUE(LoadedRight(keys[i], CodecKind::kFp8)) << i;
    }
  }
}

}  // namespace
}  // namespace kvtier
