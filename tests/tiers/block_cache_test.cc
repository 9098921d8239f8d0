#include "tiers/block_cache.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/mutex.h"
#include "tests/tiers/tiers_test_util.h"
#include "devices/host_backend.h"

namespace kvtier {
namespace {

using namespace std::chrono_literals;
using tiers_test::EngineMemory;
using tiers_test::HoldingBackend;
using tiers_test::SmallSpec;
using tiers_test::WorkerGate;

constexpr uint64_t kStride = 8192;  // slot stride of SmallSpec()'s 6144-byte blocks
constexpr TenantId kTenant = 1;
constexpr size_t kHbm = static_cast<size_t>(Tier::kHbm);
constexpr size_t kHost = static_cast<size_t>(Tier::kHost);

// Every member listed, so that -Wmissing-field-initializers stays quiet.
BlockCache::Options CacheOptions(DeviceBackend* backend, BlockCache::Post post, uint64_t hbm_bytes,
                                 uint64_t host_bytes, bool prefix_aware = true,
                                 TierWatermarks host_watermarks = {}, uint32_t background_scan_budget = 65536) {
  return BlockCache::Options{.backend = backend,
                             .post = std::move(post),
                             .hbm_bytes = hbm_bytes,
                             .host_bytes = host_bytes,
                             .hbm_watermarks = TierWatermarks{},
                             .host_watermarks = host_watermarks,
                             .prefix_aware = prefix_aware,
                             .eviction_scan_limit = 1024,
                             .background_scan_budget = background_scan_budget};
}

struct CacheConfig {
  uint64_t hbm_slots = 0;  // hbm tier size in slots (0: no hbm tier)
  uint64_t host_slots = 16;
  uint32_t copy_threads = 2;
  uint32_t engine_blocks = 64;
  bool prefix_aware = true;
  bool holding_backend = false;  // put a HoldingBackend between cache and host backend
  // By default the host tier fills up and evicts only when a slot is needed;
  // the watermark tests set real ones.
  TierWatermarks host_watermarks = {.high = 1.0, .low = 1.0};
  uint32_t background_scan_budget = 65536;
};

// The cache under test runs on the test thread: `post` queues closures that
// DrainUntil runs here, in the order the backend's workers posted them.
class BlockCacheTest : public ::testing::Test {
 protected:
  struct Op {
    bool done = false;
    OpOutcome outcome;
  };

  void Start(const CacheConfig& config) {
    Result<std::unique_ptr<HostBackend>> backend =
        HostBackend::Create(HostBackend::Options{.copy_threads = config.copy_threads});
    ASSERT_TRUE(backend.has_value()) << backend.error();
    host_backend_ = std::move(*backend);
    backend_ = host_backend_.get();
    if (config.holding_backend) {
      holding_ = std::make_unique<HoldingBackend>(host_backend_.get());
      backend_ = holding_.get();
    }
    Result<std::unique_ptr<EngineMemory>> engine =
        EngineMemory::Create(*backend_, SmallSpec(), config.engine_blocks);
    ASSERT_TRUE(engine.has_value()) << engine.error();
    engine_ = std::move(*engine);
    ASSERT_EQ(engine_->block_bytes(), 6144u);
    BlockCache::Post post = [this](std::function<void()> f) {
      MutexLock lock(&mu_);
      posted_.push_back(std::move(f));
      cv_.SignalAll();
    };
    Result<std::unique_ptr<BlockCache>> cache =
        BlockCache::Create(CacheOptions(backend_, std::move(post), config.hbm_slots * kStride,
                                        config.host_slots * kStride, config.prefix_aware,
                                        config.host_watermarks, config.background_scan_budget));
    ASSERT_TRUE(cache.has_value()) << cache.error();
    cache_ = std::move(*cache);
  }

  void TearDown() override {
    if (holding_) {
      holding_->HoldLoads(false);
      holding_->ReleaseAll();
    }
    if (cache_ && !Settle()) {
      // Destroying the cache with copies in flight would abort; the test has
      // already failed, so leak it rather than crash the other tests.
      (void)cache_.release();
    }
    cache_.reset();
  }

  // Runs posted closures on this thread until `done()` holds. Fails the test
  // (and returns false) when nothing is posted for `timeout`.
  bool DrainUntil(const std::function<bool()>& done, std::chrono::seconds timeout = 30s) {
    while (!done()) {
      std::function<void()> f;
      {
        MutexLock lock(&mu_);
        const auto deadline = std::chrono::steady_clock::now() + timeout;
        while (posted_.empty()) {
          const auto now = std::chrono::steady_clock::now();
          if (now >= deadline) {
            ADD_FAILURE() << "nothing was posted for " << timeout.count() << " s";
            return false;
          }
          (void)cv_.WaitFor(&mu_, deadline - now);
        }
        f = std::move(posted_.front());
        posted_.pop_front();
      }
      f();
    }
    return true;
  }
  // Runs at most `max` closures that are already posted; returns how many ran.
  size_t RunPosted(size_t max) {
    size_t ran = 0;
    for (; ran < max; ++ran) {
      std::function<void()> f;
      {
        MutexLock lock(&mu_);
        if (posted_.empty()) break;
        f = std::move(posted_.front());
        posted_.pop_front();
      }
      f();
    }
    return ran;
  }
  // Waits for every copy and runs every closure.
  bool Settle() {
    while (true) {
      if (!DrainUntil([&] { return cache_->inflight_copies() == 0; })) return false;
      if (RunPosted(SIZE_MAX) == 0 && cache_->inflight_copies() == 0) return true;
    }
  }

  // Runs an Evict to its end (its steps are posted closures); UINT64_MAX
  // if it never ends.
  uint64_t EvictNow(std::optional<std::vector<TenantId>> owners, std::optional<LayoutFingerprint> layout,
                    std::optional<Tier> tier) {
    std::optional<uint64_t> evicted;
    cache_->Evict(EvictFilter{std::move(owners), layout, tier}, [&](uint64_t n) { evicted = n; });
    if (!DrainUntil([&] { return evicted.has_value(); })) return UINT64_MAX;
    return *evicted;
  }

  std::vector<StoredKey> NewKeys(size_t n) {
    std::vector<StoredKey> keys(n);
    for (StoredKey& k : keys) {
      for (uint8_t& b : k.bytes) b = static_cast<uint8_t>(rng_());
    }
    return keys;
  }

  EngineTarget Target() const { return EngineTarget{engine_->layout(), engine_->mapping()}; }

  static OpDone Recorder(const std::shared_ptr<Op>& op) {
    return [op](OpOutcome o) {
      EXPECT_FALSE(op->done) << "done ran twice";
      op->done = true;
      op->outcome = std::move(o);
    };
  }

  // Stores engine blocks `block_ids` under `keys` (the engine blocks are
  // not written here).
  std::shared_ptr<Op> StoreBlocksAsync(TenantId tenant, const std::vector<StoredKey>& keys,
                                       const std::vector<uint32_t>& block_ids,
                                       std::optional<StoredKey> parent, std::weak_ptr<void> owner) {
    auto op = std::make_shared<Op>();
    cache_->Store(tenant, keys, block_ids, parent, Target(), std::move(owner), Recorder(op));
    return op;
  }
  // Writes each key's bytes into engine blocks first_block.. and stores them.
  std::shared_ptr<Op> StoreAsync(const std::vector<StoredKey>& keys, uint32_t first_block,
                                 std::optional<StoredKey> parent = std::nullopt,
                                 TenantId tenant = kTenant) {
    std::vector<uint32_t> ids(keys.size());
    std::iota(ids.begin(), ids.end(), first_block);
    for (size_t i = 0; i < keys.size(); ++i) engine_->Fill(ids[i], keys[i]);
    return StoreBlocksAsync(tenant, keys, ids, parent, owner_);
  }
  OpOutcome Store(const std::vector<StoredKey>& keys, uint32_t first_block,
                  std::optional<StoredKey> parent = std::nullopt, TenantId tenant = kTenant) {
    std::shared_ptr<Op> op = StoreAsync(keys, first_block, parent, tenant);
    EXPECT_TRUE(DrainUntil([&] { return op->done; }));
    return op->outcome;
  }
  // Stores each key alone (no parent), one after the other.
  void StoreEach(const std::vector<StoredKey>& keys, uint32_t first_block,
                 TenantId tenant = kTenant) {
    for (size_t i = 0; i < keys.size(); ++i) {
      const OpOutcome o =
          Store({keys[i]}, first_block + static_cast<uint32_t>(i), std::nullopt, tenant);
      EXPECT_TRUE(o.status.ok()) << o.status;
      EXPECT_EQ(o.blocks, 1u);
    }
  }

  // Zeroes engine blocks first_block.. and loads `keys` into them.
  std::shared_ptr<Op> LoadAsync(const std::vector<StoredKey>& keys, uint32_t first_block) {
    std::vector<uint32_t> ids(keys.size());
    std::iota(ids.begin(), ids.end(), first_block);
    for (uint32_t id : ids) engine_->Zero(id);
    auto op = std::make_shared<Op>();
    cache_->Load(kTenant, keys, ids, Target(), owner_, Recorder(op));
    return op;
  }
  OpOutcome Load(const std::vector<StoredKey>& keys, uint32_t first_block) {
    std::shared_ptr<Op> op = LoadAsync(keys, first_block);
    EXPECT_TRUE(DrainUntil([&] { return op->done; }));
    return op->outcome;
  }
  // The first `n` keys are in engine blocks first_block.., the rest are zero.
  ::testing::AssertionResult Loaded(const std::vector<StoredKey>& keys, uint32_t first_block,
                                    size_t n) {
    for (size_t i = 0; i < keys.size(); ++i) {
      const uint32_t b = first_block + static_cast<uint32_t>(i);
      ::testing::AssertionResult r = i < n ? engine_->Holds(b, keys[i]) : engine_->IsZero(b);
      if (!r) return r << " (key " << i << ")";
    }
    return ::testing::AssertionSuccess();
  }

  uint32_t Hits(const std::vector<StoredKey>& keys) { return cache_->Lookup(kTenant, keys).hits; }
  bool Present(const StoredKey& key) { return Hits({key}) == 1; }
  std::vector<Tier> Tiers(const std::vector<StoredKey>& keys) {
    return cache_->Lookup(kTenant, keys).tiers;
  }
  uint64_t BlockBytes() const { return engine_->block_bytes(); }

  // Declared first: backend workers post here until the backend is gone.
  Mutex mu_;
  CondVar cv_;
  std::deque<std::function<void()>> posted_ KVTIER_GUARDED_BY(mu_);

  std::mt19937_64 rng_{12345};
  std::shared_ptr<int> owner_ = std::make_shared<int>(0);  // the "client" of every op
  // holding_ outlives host_backend_, whose workers call into it until joined.
  std::unique_ptr<HoldingBackend> holding_;
  std::unique_ptr<HostBackend> host_backend_;
  DeviceBackend* backend_ = nullptr;
  std::unique_ptr<EngineMemory> engine_;
  std::unique_ptr<BlockCache> cache_;
};

TEST_F(BlockCacheTest, CreateValidatesOptions) {
  Result<std::unique_ptr<HostBackend>> backend = HostBackend::Create({});
  ASSERT_TRUE(backend.has_value());
  auto post = [](std::function<void()> f) { f(); };
  Result<std::unique_ptr<BlockCache>> c =
      BlockCache::Create(CacheOptions(nullptr, post, 0, kStride));
  ASSERT_FALSE(c.has_value());
  EXPECT_EQ(c.error().code(), StatusCode::kInvalidArgument);
  c = BlockCache::Create(CacheOptions(backend->get(), nullptr, 0, kStride));
  ASSERT_FALSE(c.has_value());
  EXPECT_EQ(c.error().code(), StatusCode::kInvalidArgument);
  c = BlockCache::Create(CacheOptions(backend->get(), post, 0, 0));
  ASSERT_FALSE(c.has_value());
  EXPECT_EQ(c.error().code(), StatusCode::kInvalidArgument);
  c = BlockCache::Create(CacheOptions(backend->get(), post, 4 * kStride, 8 * kStride));
  ASSERT_TRUE(c.has_value()) << c.error();
  EXPECT_EQ((*c)->Usage(Tier::kHbm).capacity_bytes, 4 * kStride);
  EXPECT_EQ((*c)->Usage(Tier::kHost).capacity_bytes, 8 * kStride);
  EXPECT_EQ((*c)->Usage(Tier::kDisk).capacity_bytes, 0u);
}

class BlockCacheRoundTripTest : public BlockCacheTest,
                                public ::testing::WithParamInterface<uint64_t> {};

TEST_P(BlockCacheRoundTripTest, StoreThenLoadIsByteExact) {
  Start({.hbm_slots = GetParam(), .host_slots = 16});
  const std::vector<StoredKey> keys = NewKeys(6);
  const OpOutcome stored = Store(keys, 0);
  ASSERT_TRUE(stored.status.ok()) << stored.status;
  EXPECT_EQ(stored.blocks, 6u);
  EXPECT_EQ(stored.already, 0u);
  ASSERT_TRUE(Settle());

  engine_->ZeroAll();
  const OpOutcome loaded = Load(keys, 20);
  ASSERT_TRUE(loaded.status.ok()) << loaded.status;
  EXPECT_EQ(loaded.blocks, 6u);
  EXPECT_TRUE(Loaded(keys, 20, 6));
  for (uint32_t b = 0; b < 20; ++b)
    EXPECT_TRUE(engine_->IsZero(b)) << "a load wrote outside its blocks";
  for (uint32_t b = 26; b < engine_->num_blocks(); ++b) EXPECT_TRUE(engine_->IsZero(b));

  // A missing key ends the prefix: the blocks after it are not loaded.
  const std::vector<StoredKey> gap = {keys[0], keys[1], NewKeys(1)[0], keys[3]};
  const OpOutcome partial = Load(gap, 40);
  ASSERT_TRUE(partial.status.ok());
  EXPECT_EQ(partial.blocks, 2u);
  EXPECT_TRUE(Loaded(gap, 40, 2));

  const OpOutcome none = Load(NewKeys(2), 50);
  EXPECT_TRUE(none.status.ok());
  EXPECT_EQ(none.blocks, 0u);

  EXPECT_EQ(cache_->counters().stores, 6u);
  EXPECT_EQ(cache_->counters().loads, 8u);
  // Both short loads are counted: a key that is not there (gone, to the
  // cache: it cannot tell a key evicted since the lookup from one never
  // stored).
  EXPECT_EQ(cache_->counters().loads_short_gone, 2u);
  EXPECT_EQ(cache_->counters().loads_short_not_ready, 0u);
  EXPECT_EQ(cache_->counters().loads_short_disk, 0u);
  EXPECT_EQ(cache_->counters().bytes_engine_to_cache, 6 * BlockBytes());
  EXPECT_EQ(cache_->counters().bytes_cache_to_engine, 8 * BlockBytes());
  ASSERT_TRUE(Settle());
  EXPECT_EQ(cache_->leases(), 0u);
}

std::string RoundTripName(const ::testing::TestParamInfo<uint64_t>& param) {
  return param.param == 0 ? "HostOnly" : "WithHbm";
}
INSTANTIATE_TEST_SUITE_P(HostOnlyAndHbm, BlockCacheRoundTripTest, ::testing::Values(0, 8),
                         RoundTripName);

TEST_F(BlockCacheTest, StoredBlockIsInvisibleUntilItsCopyCompleted) {
  Start({});
  const std::vector<StoredKey> keys = NewKeys(2);
  ASSERT_TRUE(Store({keys[0]}, 0).status.ok());
  std::shared_ptr<Op> op = StoreAsync({keys[1]}, 1, keys[0]);
  // The copy may well be done by now, but its completion has not run here.
  EXPECT_EQ(Hits({keys[1]}), 0u);
  EXPECT_EQ(Hits(keys), 1u);
  EXPECT_EQ(cache_->Usage(Tier::kHost).blocks, 2u) << "a filling block holds its slot";
  std::shared_ptr<Op> early = LoadAsync({keys[1]}, 10);
  ASSERT_TRUE(DrainUntil([&] { return early->done; }));
  EXPECT_EQ(early->outcome.blocks, 0u) << "a filling block must not be loaded";
  EXPECT_TRUE(engine_->IsZero(10));

  ASSERT_TRUE(DrainUntil([&] { return op->done; }));
  EXPECT_EQ(op->outcome.blocks, 1u);
  EXPECT_EQ(Hits(keys), 2u);
  EXPECT_EQ(Load({keys[1]}, 11).blocks, 1u);
  EXPECT_TRUE(engine_->Holds(11, keys[1]));
}

TEST_F(BlockCacheTest, PresentOrInFlightKeyIsAlreadyStoredNotCopiedAgain) {
  Start({});
  const std::vector<StoredKey> keys = NewKeys(2);
  std::shared_ptr<Op> first = StoreAsync({keys[0]}, 0);
  ASSERT_EQ(cache_->inflight_copies(), 1u);
  // The same key from different engine bytes, while the first copy is in flight.
  engine_->Fill(1, NewKeys(1)[0]);
  std::shared_ptr<Op> second = StoreBlocksAsync(kTenant, {keys[0]}, {1}, std::nullopt, owner_);
  EXPECT_EQ(cache_->inflight_copies(), 1u) << "no second copy";
  ASSERT_TRUE(DrainUntil([&] { return first->done && second->done; }));
  EXPECT_TRUE(first->outcome.status.ok());
  EXPECT_EQ(first->outcome.blocks, 1u);
  EXPECT_EQ(first->outcome.already, 0u);
  EXPECT_TRUE(second->outcome.status.ok()) << second->outcome.status;
  EXPECT_EQ(second->outcome.blocks, 0u);
  EXPECT_EQ(second->outcome.already, 1u);
  EXPECT_EQ(cache_->counters().stores, 1u);
  EXPECT_EQ(cache_->counters().already_stored, 1u);
  EXPECT_EQ(cache_->counters().bytes_engine_to_cache, BlockBytes());

  // Present now: a store of it and a new key copies only the new one.
  engine_->Fill(2, NewKeys(1)[0]);
  engine_->Fill(3, keys[1]);
  std::shared_ptr<Op> third = StoreBlocksAsync(kTenant, keys, {2, 3}, std::nullopt, owner_);
  ASSERT_TRUE(DrainUntil([&] { return third->done; }));
  EXPECT_EQ(third->outcome.blocks, 1u);
  EXPECT_EQ(third->outcome.already, 1u);
  EXPECT_EQ(cache_->counters().stores, 2u);
  EXPECT_EQ(cache_->counters().already_stored, 2u);
  EXPECT_EQ(cache_->Usage(Tier::kHost).blocks, 2u);

  EXPECT_EQ(Load(keys, 10).blocks, 2u);
  EXPECT_TRUE(Loaded(keys, 10, 2)) << "the first store's bytes, never a later one's";
}

TEST_F(BlockCacheTest, LookupNeverPinsAndLeasesLastOnlyWhileCopiesAreInFlight) {
  Start({.hbm_slots = 4, .host_slots = 16});
  const std::vector<StoredKey> keys = NewKeys(4);
  ASSERT_TRUE(Store(keys, 0).status.ok());
  ASSERT_TRUE(Settle());
  EXPECT_EQ(cache_->leases(), 0u);

  const uint64_t lookups = cache_->counters().lookups;
  std::vector<StoredKey> with_miss = keys;
  with_miss.insert(with_miss.begin() + 2, NewKeys(1)[0]);
  for (int i = 0; i < 100; ++i) {
    const CacheLookup r = cache_->Lookup(kTenant, i % 2 ? keys : with_miss);
    EXPECT_EQ(r.hits, i % 2 ? 4u : 2u);
    EXPECT_EQ(r.tiers.size(), r.hits);
    ASSERT_EQ(cache_->leases(), 0u);
  }
  EXPECT_EQ(cache_->counters().lookups, lookups + 100);
  EXPECT_EQ(cache_->counters().misses, 50u * 3);

  std::shared_ptr<Op> load = LoadAsync(keys, 10);
  EXPECT_EQ(cache_->leases(), 4u);
  std::shared_ptr<Op> store = StoreAsync(NewKeys(2), 20);
  EXPECT_EQ(cache_->leases(), 6u);
  ASSERT_TRUE(DrainUntil([&] { return load->done && store->done; }));
  EXPECT_EQ(cache_->leases(), 0u);
  EXPECT_EQ(load->outcome.blocks, 4u);
  EXPECT_EQ(store->outcome.blocks, 2u);
  EXPECT_TRUE(Loaded(keys, 10, 4));
  ASSERT_TRUE(Settle());
  EXPECT_EQ(cache_->leases(), 0u);
}

TEST_F(BlockCacheTest, StoresLandInHbmFirstAndAreDemotedBetweenWatermarks) {
  Start({.hbm_slots = 10, .host_slots = 40});
  const std::vector<StoredKey> keys = NewKeys(12);
  // Alone, so that plain LRU decides: keys[0] is the coldest.
  for (size_t i = 0; i < 10; ++i) {
    ASSERT_TRUE(Store({keys[i]}, static_cast<uint32_t>(i)).status.ok());
    if (i < 9) {
      EXPECT_EQ(cache_->Usage(Tier::kHbm).blocks, i + 1);
      EXPECT_EQ(cache_->Usage(Tier::kHost).blocks, 0u);
      EXPECT_EQ(cache_->counters().demotions, 0u) << "below the high watermark (90%)";
    }
  }
  // 10 of 10 slots is above 90%: down to 80%, the two coldest go to host.
  ASSERT_TRUE(Settle());
  EXPECT_EQ(cache_->counters().demotions, 2u);
  EXPECT_EQ(cache_->counters().bytes_hbm_to_host, 2 * BlockBytes());
  EXPECT_EQ(cache_->Usage(Tier::kHbm).blocks, 8u);
  EXPECT_EQ(cache_->Usage(Tier::kHbm).used_bytes, 8 * BlockBytes());
  EXPECT_EQ(cache_->Usage(Tier::kHost).blocks, 2u);
  EXPECT_EQ(cache_->Usage(Tier::kHost).used_bytes, 2 * BlockBytes());
  const std::vector<StoredKey> first10(keys.begin(), keys.begin() + 10);
  std::vector<Tier> want(10, Tier::kHbm);
  want[0] = want[1] = Tier::kHost;
  EXPECT_EQ(Tiers(first10), want);

  // One more fits under the high watermark; the next crosses it again.
  ASSERT_TRUE(Store({keys[10]}, 10).status.ok());
  ASSERT_TRUE(Settle());
  EXPECT_EQ(cache_->counters().demotions, 2u);
  EXPECT_EQ(Tiers({keys[10]}), std::vector<Tier>{Tier::kHbm});
  ASSERT_TRUE(Store({keys[11]}, 11).status.ok());
  ASSERT_TRUE(Settle());
  EXPECT_EQ(cache_->counters().demotions, 4u);
  EXPECT_EQ(cache_->Usage(Tier::kHbm).blocks, 8u);
  EXPECT_EQ(cache_->Usage(Tier::kHost).blocks, 4u);
  EXPECT_EQ(cache_->counters().evictions[kHbm] + cache_->counters().evictions[kHost], 0u);

  // Demoted or not, every block is intact.
  engine_->ZeroAll();
  const OpOutcome loaded = Load(keys, 20);
  EXPECT_EQ(loaded.blocks, 12u);
  EXPECT_TRUE(Loaded(keys, 20, 12));
  ASSERT_TRUE(Settle());
}

// A burst of background work (here: a demotion of 5 blocks) looks at no
// more blocks between two pumps than its budget allows, and the rest comes
// at later turns, with the same outcome as without a budget.
TEST_F(BlockCacheTest, DemotionPastItsScanBudgetGoesOnAtLaterTurnsAndEndsTheSame) {
  Start({.hbm_slots = 40, .host_slots = 40, .background_scan_budget = 2});
  const std::vector<StoredKey> keys = NewKeys(40);
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(Store({keys[i]}, static_cast<uint32_t>(i)).status.ok());
    ASSERT_TRUE(Settle());
  }
  // The 37th block took hbm past 90%: down to 80% (32), the 5 coldest to
  // host, 2 looked at a pump.
  EXPECT_EQ(cache_->counters().demotions, 5u);
  EXPECT_GE(cache_->counters().scan_budget_deferrals, 2u);
  EXPECT_EQ(cache_->Usage(Tier::kHbm).blocks, 35u);
  EXPECT_EQ(cache_->Usage(Tier::kHost).blocks, 5u);
  const std::vector<StoredKey> coldest(keys.begin(), keys.begin() + 5);
  EXPECT_EQ(Tiers(coldest), std::vector<Tier>(5, Tier::kHost));
  engine_->ZeroAll();
  EXPECT_EQ(Load(keys, 0).blocks, 40u);
  EXPECT_TRUE(Loaded(keys, 0, 40));
  ASSERT_TRUE(Settle());
}

TEST_F(BlockCacheTest, LoadFromHostPromotesAndConcurrentLoadsShareOnePromotion) {
  Start({.hbm_slots = 10, .host_slots = 40});
  const std::vector<StoredKey> keys = NewKeys(3);
  StoreEach(keys, 0);
  // Everything down to host.
  cache_->SetWatermarks(TierWatermarks{.high = 0, .low = 0}, TierWatermarks{});
  ASSERT_TRUE(Settle());
  EXPECT_EQ(cache_->counters().demotions, 3u);
  EXPECT_EQ(Tiers(keys), std::vector<Tier>(3, Tier::kHost));
  EXPECT_EQ(cache_->Usage(Tier::kHbm).blocks, 0u);
  cache_->SetWatermarks(TierWatermarks{}, TierWatermarks{});
  EXPECT_EQ(cache_->counters().promotions, 0u) << "lookups do not promote";

  EXPECT_EQ(Load({keys[0]}, 10).blocks, 1u);
  EXPECT_TRUE(engine_->Holds(10, keys[0]));
  ASSERT_TRUE(Settle());
  EXPECT_EQ(cache_->counters().promotions, 1u);
  EXPECT_EQ(cache_->counters().bytes_host_to_hbm, BlockBytes());
  EXPECT_EQ(Tiers({keys[0]}), std::vector<Tier>{Tier::kHbm});
  EXPECT_EQ(Load({keys[0]}, 11).blocks, 1u);
  EXPECT_TRUE(engine_->Holds(11, keys[0])) << "promoted bytes are intact";

  // Two loads of one host block, issued back to back: one promotion.
  std::shared_ptr<Op> a = LoadAsync({keys[1]}, 12);
  std::shared_ptr<Op> b = LoadAsync({keys[1]}, 13);
  EXPECT_EQ(cache_->leases(), 2u);
  ASSERT_TRUE(Settle());
  ASSERT_TRUE(a->done && b->done);
  EXPECT_EQ(a->outcome.blocks, 1u);
  EXPECT_EQ(b->outcome.blocks, 1u);
  EXPECT_TRUE(engine_->Holds(12, keys[1]));
  EXPECT_TRUE(engine_->Holds(13, keys[1]));
  EXPECT_EQ(cache_->counters().promotions, 2u);
  EXPECT_EQ(Tiers(keys), (std::vector<Tier>{Tier::kHbm, Tier::kHbm, Tier::kHost}));
  EXPECT_EQ(cache_->Usage(Tier::kHbm).blocks, 2u);
  EXPECT_EQ(cache_->Usage(Tier::kHost).blocks, 1u);
  EXPECT_EQ(cache_->leases(), 0u);

  // Prefetch promotes without loading, and counts as a lookup: engines
  // that only prefetch (vLLM's connector) must show their hits and misses.
  const CacheCounters before = cache_->counters();
  EXPECT_EQ(cache_->Prefetch(kTenant, std::vector<StoredKey>{keys[2], NewKeys(1)[0]}),
            (std::pair<uint32_t, uint32_t>{1, 1}));
  EXPECT_EQ(cache_->Prefetch(kTenant, NewKeys(1)), (std::pair<uint32_t, uint32_t>{0, 0}));
  const CacheCounters after = cache_->counters();
  EXPECT_EQ(after.lookups, before.lookups + 2);
  EXPECT_EQ(after.lookup_keys, before.lookup_keys + 3);
  EXPECT_EQ(after.hits[static_cast<size_t>(Tier::kHost)],
            before.hits[static_cast<size_t>(Tier::kHost)] + 1);
  EXPECT_EQ(after.misses, before.misses + 2);
  ASSERT_TRUE(Settle());
  EXPECT_EQ(cache_->counters().promotions, 3u);
  EXPECT_EQ(Load(keys, 20).blocks, 3u);
  EXPECT_TRUE(Loaded(keys, 20, 3));
}

TEST_F(BlockCacheTest, UnrelatedLoadNeverWaitsOnAnotherRequest) {
  Start({.hbm_slots = 10, .host_slots = 40, .copy_threads = 2});
  const std::vector<StoredKey> keys = NewKeys(2);
  StoreEach(keys, 0);
  cache_->SetWatermarks(TierWatermarks{.high = 0, .low = 0}, TierWatermarks{});
  ASSERT_TRUE(Settle());
  cache_->SetWatermarks(TierWatermarks{}, TierWatermarks{});
  ASSERT_EQ(Tiers(keys), std::vector<Tier>(2, Tier::kHost));
  // One copy worker is stuck inside another request's copy, indefinitely.
  WorkerGate stuck(*backend_);
  // A promotion of keys[0] is queued behind it, and loads of keys[0] (being
  // moved) and of keys[1] (unrelated) are issued: both finish while the
  // stuck request is still stuck, reading from the host slot.
  ASSERT_EQ(cache_->Prefetch(kTenant, std::vector<StoredKey>{keys[0]}), (std::pair<uint32_t, uint32_t>{1, 1}));
  std::shared_ptr<Op> moving = LoadAsync({keys[0]}, 10);
  std::shared_ptr<Op> unrelated = LoadAsync({keys[1]}, 11);
  ASSERT_TRUE(DrainUntil([&] { return moving->done && unrelated->done; }));
  EXPECT_EQ(moving->outcome.blocks, 1u);
  EXPECT_EQ(unrelated->outcome.blocks, 1u);
  EXPECT_TRUE(engine_->Holds(10, keys[0]));
  EXPECT_TRUE(engine_->Holds(11, keys[1]));
  stuck.Release();
  ASSERT_TRUE(Settle());
  EXPECT_EQ(cache_->leases(), 0u);
}

TEST_F(BlockCacheTest, PromotionStopsAtTheHighWatermark) {
  Start({.hbm_slots = 10, .host_slots = 40});
  const std::vector<StoredKey> keys = NewKeys(10);
  StoreEach(keys, 0);
  cache_->SetWatermarks(TierWatermarks{.high = 0, .low = 0}, TierWatermarks{});
  ASSERT_TRUE(Settle());
  ASSERT_EQ(cache_->Usage(Tier::kHost).blocks, 10u);
  cache_->SetWatermarks(TierWatermarks{.high = 0.5, .low = 0.3}, TierWatermarks{});
  EXPECT_EQ(Load(keys, 20).blocks, 10u);
  EXPECT_TRUE(Loaded(keys, 20, 10));
  ASSERT_TRUE(Settle());
  EXPECT_EQ(cache_->counters().promotions, 5u) << "up to 50% of 10 slots";
  EXPECT_EQ(cache_->Usage(Tier::kHbm).blocks, 5u);
  EXPECT_EQ(cache_->counters().demotions, 10u) << "promotion alone never crosses the high mark";
}

TEST_F(BlockCacheTest, FullHostTierEvictsTheColdestBlock) {
  Start({.host_slots = 4});
  const std::vector<StoredKey> keys = NewKeys(5);
  StoreEach({keys.begin(), keys.begin() + 4}, 0);
  EXPECT_TRUE(Present(keys[0]));  // keys[1] is now the coldest
  ASSERT_TRUE(Store({keys[4]}, 4).status.ok());
  EXPECT_FALSE(Present(keys[1]));
  for (size_t i : {0, 2, 3, 4}) EXPECT_TRUE(Present(keys[i])) << i;
  EXPECT_EQ(cache_->counters().evictions[kHost], 1u);
  EXPECT_EQ(cache_->Usage(Tier::kHost).blocks, 4u);
  EXPECT_EQ(cache_->Usage(Tier::kHost).used_bytes, 4 * BlockBytes());
}

// Without a disk tier the host watermarks drop nothing early: dropping
// blocks there is nowhere to write only loses hits (the trace replay showed
// 2.6 points below LRU). The tier fills and evicts its coldest on demand.
TEST_F(BlockCacheTest, WithoutADiskTierTheHostTierFillsAndEvictsOnlyOnDemand) {
  Start({.host_slots = 10, .host_watermarks = {.high = 0.8, .low = 0.5}});
  const std::vector<StoredKey> keys = NewKeys(11);
  StoreEach({keys.begin(), keys.begin() + 10}, 0);  // all 10 slots, above the high watermark
  EXPECT_EQ(cache_->Usage(Tier::kHost).blocks, 10u);
  EXPECT_EQ(cache_->counters().evictions[kHost], 0u);
  ASSERT_TRUE(Store({keys[10]}, 10).status.ok());  // no room: the coldest goes
  EXPECT_EQ(cache_->Usage(Tier::kHost).blocks, 10u);
  EXPECT_EQ(cache_->counters().evictions[kHost], 1u);
  EXPECT_FALSE(Present(keys[0])) << "the coldest block";
  for (size_t i = 1; i < 11; ++i) EXPECT_TRUE(Present(keys[i])) << i;
}

// Two models with different block sizes on one node: the second size gets
// room although the first took every extent, from the first size's coldest
// extent, and both keep serving exact bytes.
TEST_F(BlockCacheTest, ASecondBlockSizeIsNotStarvedByTheFirst) {
  Start({.host_slots = 256});  // 2 MiB: extents of 32 KiB, 4 slots of 8 KiB
  const std::vector<StoredKey> a = NewKeys(256);
  for (size_t i = 0; i < a.size(); ++i)
    ASSERT_TRUE(Store({a[i]}, static_cast<uint32_t>(i % 64)).status.ok());
  ASSERT_EQ(cache_->Usage(Tier::kHost).blocks, 256u) << "the first size has the whole tier";
  // The oldest 32 are read again: the coldest are now a[32..63], in the
  // middle of the arena.
  auto cold = [](size_t i) { return i >= 32 && i < 64; };
  for (size_t i = 0; i < 32; ++i) ASSERT_TRUE(Present(a[i]));

  Result<std::unique_ptr<EngineMemory>> other = EngineMemory::Create(*backend_, SmallSpec(2), 64);
  ASSERT_TRUE(other.has_value()) << other.error();
  EngineMemory& engine2 = **other;
  ASSERT_EQ(SlotPool::StrideFor(engine2.block_bytes()), 4096u);
  const EngineTarget target2{engine2.layout(), engine2.mapping()};
  const std::vector<StoredKey> b = NewKeys(64);
  for (uint32_t i = 0; i < b.size(); ++i) {
    engine2.Fill(i, b[i]);
    auto op = std::make_shared<Op>();
    cache_->Store(kTenant, std::span(&b[i], 1), std::span(&i, 1), std::nullopt, target2, owner_,
                  Recorder(op));
    ASSERT_TRUE(DrainUntil([&] { return op->done; }));
    ASSERT_TRUE(op->outcome.status.ok()) << "block " << i << ": " << op->outcome.status;
  }
  // 64 blocks of 4 KiB took 8 extents of the first size: those of its 32
  // coldest blocks.
  EXPECT_EQ(cache_->counters().extents_reclaimed, 8u);
  EXPECT_EQ(cache_->Usage(Tier::kHost).blocks, 256u - 32u + 64u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(Present(a[i]), !cold(i)) << "a[" << i << "]";

  // Both sizes load exactly.
  for (uint32_t i = 0; i < b.size(); ++i) {
    const uint32_t to = 32 + (i % 32);
    engine2.Zero(to);
    auto op = std::make_shared<Op>();
    cache_->Load(kTenant, std::span(&b[i], 1), std::span(&to, 1), target2, owner_, Recorder(op));
    ASSERT_TRUE(DrainUntil([&] { return op->done; }));
    ASSERT_EQ(op->outcome.blocks, 1u);
    EXPECT_TRUE(engine2.Holds(to, b[i]));
  }
  EXPECT_EQ(Load({a[200]}, 10).blocks, 1u);
  EXPECT_TRUE(engine_->Holds(10, a[200]));

  // And the first size wins the room back once the second's blocks are the
  // colder ones: 64 new blocks take the second size's 8 extents (32 slots)
  // and then evict the first size's own coldest.
  for (size_t i = 0; i < a.size(); ++i) {
    if (!cold(i)) {
      ASSERT_TRUE(Present(a[i]));  // touched: now hotter than b
    }
  }
  const std::vector<StoredKey> more = NewKeys(64);
  for (size_t i = 0; i < more.size(); ++i)
    ASSERT_TRUE(Store({more[i]}, static_cast<uint32_t>(i)).status.ok());
  for (const StoredKey& k : more) EXPECT_TRUE(Present(k));
  EXPECT_EQ(cache_->counters().extents_reclaimed, 16u);
  for (const StoredKey& k : b) EXPECT_FALSE(Present(k));
  EXPECT_LE(cache_->Usage(Tier::kHost).used_bytes, cache_->Usage(Tier::kHost).capacity_bytes);
  ASSERT_TRUE(Settle());
}

TEST_F(BlockCacheTest, PrefixAwareEvictionTakesLeavesBeforeTheirParents) {
  Start({.host_slots = 4});
  const std::vector<StoredKey> k = NewKeys(8);  // A B C D E F G H
  // A -> B -> C, linked within one store and across two; A is the coldest.
  ASSERT_TRUE(Store({k[0], k[1]}, 0).status.ok());
  ASSERT_TRUE(Store({k[2]}, 2, k[1]).status.ok());
  ASSERT_TRUE(Store({k[3]}, 3).status.ok());  // D, unrelated and hotter than the chain
  // Each check looks up only the missing key: a miss touches nothing.
  ASSERT_TRUE(Store({k[4]}, 4).status.ok());
  EXPECT_FALSE(Present(k[2])) << "the leaf C goes first";
  ASSERT_TRUE(Store({k[5]}, 5).status.ok());
  EXPECT_FALSE(Present(k[1])) << "then B";
  ASSERT_TRUE(Store({k[6]}, 6).status.ok());
  EXPECT_FALSE(Present(k[0])) << "then the head A";
  ASSERT_TRUE(Store({k[7]}, 7).status.ok());
  EXPECT_FALSE(Present(k[3])) << "then D";
  for (size_t i = 4; i < 8; ++i) EXPECT_TRUE(Present(k[i]));
  EXPECT_EQ(cache_->counters().evictions[kHost], 4u);
  EXPECT_EQ(cache_->counters().prefix_fallbacks, 0u);
}

TEST_F(BlockCacheTest, PrefixUnawareEvictionIsPlainLru) {
  Start({.host_slots = 4, .prefix_aware = false});
  const std::vector<StoredKey> k = NewKeys(5);
  // A chain stored together arrives tail first (its tail coldest); a hit on
  // the tail alone leaves k[1], a parent, the coldest.
  ASSERT_TRUE(Store({k[0], k[1], k[2]}, 0).status.ok());
  ASSERT_EQ(cache_->Lookup(kTenant, std::span(&k[2], 1)).hits, 1u);
  ASSERT_TRUE(Store({k[3]}, 3).status.ok());
  ASSERT_TRUE(Store({k[4]}, 4).status.ok());
  EXPECT_FALSE(Present(k[1])) << "the coldest, children or not";
}

TEST_F(BlockCacheTest, EvictionFallsBackToAParentWhenEveryLeafIsLeased) {
  Start({.host_slots = 3});
  const std::vector<StoredKey> k = NewKeys(4);
  ASSERT_TRUE(Store({k[0], k[1], k[2]}, 0).status.ok());
  std::shared_ptr<Op> load = LoadAsync({k[2]}, 10);  // leases the leaf only
  ASSERT_TRUE(Store({k[3]}, 3).status.ok());
  EXPECT_EQ(cache_->counters().prefix_fallbacks, 1u);
  // The chain arrived tail first: k[2] (leased), then k[1], then k[0].
  EXPECT_FALSE(Present(k[1])) << "the coldest block with cached children";
  ASSERT_TRUE(DrainUntil([&] { return load->done; }));
  EXPECT_EQ(load->outcome.blocks, 1u);
  EXPECT_TRUE(engine_->Holds(10, k[2]));
}

TEST_F(BlockCacheTest, StoreThatCannotFitFailsAtOnceWithResourceExhausted) {
  Start({.host_slots = 2});
  const std::vector<StoredKey> k = NewKeys(4);
  ASSERT_TRUE(Store({k[0], k[1]}, 0).status.ok());
  std::shared_ptr<Op> load = LoadAsync({k[0], k[1]}, 10);  // every block leased
  std::shared_ptr<Op> store = StoreAsync({k[2], k[3]}, 2);
  EXPECT_EQ(cache_->inflight_copies(), 1u) << "only the load copies";
  // Its answer is already posted; draining may run the load's first.
  ASSERT_TRUE(DrainUntil([&] { return store->done; }));
  EXPECT_EQ(store->outcome.status.code(), StatusCode::kResourceExhausted) << store->outcome.status;
  EXPECT_EQ(store->outcome.blocks, 0u);
  EXPECT_EQ(cache_->counters().store_rejected, 2u);
  EXPECT_EQ(Hits({k[2]}), 0u);
  ASSERT_TRUE(DrainUntil([&] { return load->done; }));
  EXPECT_EQ(load->outcome.blocks, 2u);
  EXPECT_TRUE(Loaded({k[0], k[1]}, 10, 2));
  // With the leases gone, the same store evicts and fits.
  const OpOutcome retry = Store({k[2], k[3]}, 2);
  EXPECT_TRUE(retry.status.ok()) << retry.status;
  EXPECT_EQ(retry.blocks, 2u);
}

TEST_F(BlockCacheTest, PartlyFittingStoreKeepsTheBlocksBeforeTheFirstRefused) {
  Start({.host_slots = 3});
  const std::vector<StoredKey> k = NewKeys(5);
  ASSERT_TRUE(Store({k[0], k[1]}, 0).status.ok());
  std::shared_ptr<Op> load = LoadAsync({k[0], k[1]}, 10);
  const OpOutcome o = Store({k[2], k[3], k[4]}, 2);
  EXPECT_EQ(o.status.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(o.blocks, 1u);
  EXPECT_EQ(cache_->counters().store_rejected, 2u);
  EXPECT_EQ(Hits({k[2], k[3]}), 1u);
  ASSERT_TRUE(Settle());
  EXPECT_EQ(cache_->leases(), 0u);
}

TEST_F(BlockCacheTest, BlocksOfAStoreInFlightCannotBeEvicted) {
  Start({.host_slots = 2});
  const std::vector<StoredKey> k = NewKeys(3);
  std::shared_ptr<Op> first = StoreAsync({k[0], k[1]}, 0);
  std::shared_ptr<Op> second = StoreAsync({k[2]}, 2);
  ASSERT_TRUE(DrainUntil([&] { return first->done && second->done; }));
  EXPECT_TRUE(first->outcome.status.ok());
  EXPECT_EQ(second->outcome.status.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(Hits({k[0], k[1]}), 2u);
}

TEST_F(BlockCacheTest, TenantOverItsHostQuotaEvictsItsOwnBlocks) {
  Start({.host_slots = 8});
  TenantQuota quota;
  quota.bytes[kHost] = 2 * BlockBytes();
  cache_->SetQuota(kTenant, quota);
  constexpr TenantId kOther = 2;
  const std::vector<StoredKey> theirs = NewKeys(2);
  const std::vector<StoredKey> mine = NewKeys(3);
  StoreEach(theirs, 0, kOther);  // the coldest blocks in the tier
  StoreEach(mine, 2, kTenant);
  EXPECT_FALSE(Present(mine[0])) << "the tenant's own coldest block made room";
  EXPECT_TRUE(Present(mine[1]));
  EXPECT_TRUE(Present(mine[2]));
  EXPECT_TRUE(Present(theirs[0])) << "another tenant's colder block was not touched";
  EXPECT_TRUE(Present(theirs[1]));
  EXPECT_EQ(cache_->TenantUsedBytes(kTenant, Tier::kHost), 2 * BlockBytes());
  EXPECT_EQ(cache_->TenantBlocks(kTenant), 2u);
  EXPECT_EQ(cache_->TenantBlocks(kOther), 2u);
  EXPECT_EQ(cache_->Usage(Tier::kHost).blocks, 4u);

  // Over quota with only leased blocks of its own: refused, though the tier has room.
  std::shared_ptr<Op> load = LoadAsync({mine[1]}, 10);
  std::shared_ptr<Op> load2 = LoadAsync({mine[2]}, 11);
  const OpOutcome refused = Store(NewKeys(1), 5);
  EXPECT_EQ(refused.status.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status.message().find("quota"), std::string::npos) << refused.status;
  ASSERT_TRUE(Settle());
}

TEST_F(BlockCacheTest, HbmQuotaSendsStoresToHost) {
  Start({.hbm_slots = 8, .host_slots = 8});
  TenantQuota quota;
  quota.bytes[kHbm] = BlockBytes();
  cache_->SetQuota(kTenant, quota);
  const std::vector<StoredKey> k = NewKeys(3);
  StoreEach(k, 0);
  EXPECT_EQ(Tiers(k), (std::vector<Tier>{Tier::kHbm, Tier::kHost, Tier::kHost}));
  EXPECT_EQ(cache_->TenantUsedBytes(kTenant, Tier::kHbm), BlockBytes());
  EXPECT_EQ(cache_->TenantUsedBytes(kTenant, Tier::kHost), 2 * BlockBytes());
  // ... and keeps loads from promoting past it.
  EXPECT_EQ(Load(k, 10).blocks, 3u);
  ASSERT_TRUE(Settle());
  EXPECT_EQ(cache_->counters().promotions, 0u);
  EXPECT_TRUE(Loaded(k, 10, 3));
}

TEST_F(BlockCacheTest, StoreWhoseOwnerDiedCommitsNothing) {
  Start({.hbm_slots = 4, .host_slots = 8});
  const std::vector<StoredKey> k = NewKeys(6);
  for (size_t i = 0; i < k.size(); ++i) engine_->Fill(static_cast<uint32_t>(i), k[i]);
  auto owner = std::make_shared<int>(0);
  // Six blocks: four land in hbm, two in host.
  std::shared_ptr<Op> op = StoreBlocksAsync(kTenant, k, {0, 1, 2, 3, 4, 5}, std::nullopt, owner);
  EXPECT_EQ(cache_->Usage(Tier::kHbm).blocks, 4u);
  EXPECT_EQ(cache_->Usage(Tier::kHost).blocks, 2u);
  owner.reset();  // the client dies with its copy in flight
  ASSERT_TRUE(Settle());
  ASSERT_TRUE(op->done);
  EXPECT_EQ(op->outcome.blocks, 0u);
  EXPECT_EQ(Hits(k), 0u);
  EXPECT_EQ(cache_->counters().stores, 0u);
  EXPECT_EQ(cache_->counters().stores_discarded, 6u);
  for (Tier t : {Tier::kHbm, Tier::kHost}) {
    EXPECT_EQ(cache_->Usage(t).blocks, 0u) << TierName(t);
    EXPECT_EQ(cache_->Usage(t).used_bytes, 0u) << TierName(t);
    EXPECT_EQ(cache_->TenantUsedBytes(kTenant, t), 0u);
  }
  EXPECT_EQ(cache_->TenantBlocks(kTenant), 0u);
  EXPECT_EQ(cache_->leases(), 0u);
  EXPECT_EQ(cache_->counters().evictions[kHbm] + cache_->counters().evictions[kHost], 0u);

  // The keys were never stored: a live client stores them anew.
  const OpOutcome again = Store(k, 0);
  EXPECT_EQ(again.blocks, 6u);
  EXPECT_EQ(again.already, 0u);
  EXPECT_EQ(Load(k, 10).blocks, 6u);
  EXPECT_TRUE(Loaded(k, 10, 6));
}

TEST_F(BlockCacheTest, ClientMappingIsReleasedOnlyAfterTheLastCopyCompleted) {
  Start({.copy_threads = 1});
  EXPECT_EQ(host_backend_->live_mappings(), 1u);
  const std::vector<StoredKey> k = NewKeys(2);
  for (uint32_t i = 0; i < 2; ++i) engine_->Fill(i, k[i]);
  uint64_t live_at_completion = 99;
  std::shared_ptr<Op> op = std::make_shared<Op>();
  {
    WorkerGate gate(*host_backend_);  // the only worker is busy: the store's copy waits
    cache_->Store(kTenant, k, std::vector<uint32_t>{0, 1}, std::nullopt, Target(), owner_,
                  [&, record = Recorder(op)](OpOutcome o) {
                    live_at_completion = host_backend_->live_mappings();
                    record(std::move(o));
                  });
    engine_->DropMapping();  // the client is gone; only the copy holds its memory
    EXPECT_EQ(host_backend_->live_mappings(), 1u);
    EXPECT_EQ(RunPosted(SIZE_MAX), 0u);
    EXPECT_EQ(host_backend_->live_mappings(), 1u);
  }
  ASSERT_TRUE(DrainUntil([&] { return op->done; }));
  EXPECT_EQ(live_at_completion, 0u);
  EXPECT_EQ(host_backend_->live_mappings(), 0u);
  EXPECT_EQ(op->outcome.blocks, 2u);
  EXPECT_EQ(Hits(k), 2u);
}

TEST_F(BlockCacheTest, EvictDropsOnlyMatchingUnleasedBlocks) {
  // Holding the load's copy keeps its lease while the evicts' steps run.
  Start({.hbm_slots = 10, .host_slots = 20, .holding_backend = true});
  constexpr TenantId kOther = 2;
  const std::vector<StoredKey> a = NewKeys(5);
  const std::vector<StoredKey> b = NewKeys(5);
  StoreEach({a.begin(), a.begin() + 3}, 0, kTenant);
  StoreEach({b.begin(), b.begin() + 3}, 3, kOther);
  cache_->SetWatermarks(TierWatermarks{.high = 0, .low = 0}, TierWatermarks{});
  ASSERT_TRUE(Settle());
  cache_->SetWatermarks(TierWatermarks{}, TierWatermarks{});
  StoreEach({a.begin() + 3, a.end()}, 6, kTenant);
  StoreEach({b.begin() + 3, b.end()}, 8, kOther);
  ASSERT_TRUE(Settle());
  // a0..a2, b0..b2 in host; a3, a4, b3, b4 in hbm.
  ASSERT_EQ(cache_->Usage(Tier::kHost).blocks, 6u);
  ASSERT_EQ(cache_->Usage(Tier::kHbm).blocks, 4u);

  holding_->HoldLoads(true);
  std::shared_ptr<Op> load = LoadAsync({a[0]}, 30);  // leased until released
  EXPECT_EQ(EvictNow(std::vector<TenantId>{kTenant}, std::nullopt, Tier::kHost), 2u);
  EXPECT_TRUE(Present(a[0])) << "leased";
  EXPECT_FALSE(Present(a[1]));
  EXPECT_FALSE(Present(a[2]));
  for (const StoredKey& key : b) EXPECT_TRUE(Present(key));
  EXPECT_TRUE(Present(a[3]) && Present(a[4]));

  const LayoutFingerprint mine = engine_->layout()->layout().fingerprint();
  LayoutSpec other_spec = SmallSpec();
  other_spec.model_id = "test/other";
  Result<Layout> other = Layout::Create(other_spec);
  ASSERT_TRUE(other.has_value());
  EXPECT_TRUE(cache_->FindNamespaceId(mine).has_value());
  EXPECT_EQ(cache_->FindNamespaceId(other->fingerprint()), std::nullopt) << "looking creates none";
  EXPECT_EQ(EvictNow(std::nullopt, other->fingerprint(), std::nullopt), 0u);
  EXPECT_EQ(EvictNow(std::nullopt, mine, Tier::kHbm), 4u);
  EXPECT_EQ(cache_->Usage(Tier::kHbm).blocks, 0u);
  EXPECT_EQ(EvictNow(std::vector<TenantId>{kOther, 7}, std::nullopt, std::nullopt), 3u);
  EXPECT_EQ(EvictNow(std::vector<TenantId>{}, std::nullopt, std::nullopt), 0u);
  EXPECT_EQ(EvictNow(std::nullopt, std::nullopt, std::nullopt), 0u) << "a[0] is still leased";

  ASSERT_TRUE(holding_->WaitHeld(1));
  holding_->HoldLoads(false);
  holding_->ReleaseAll();
  ASSERT_TRUE(DrainUntil([&] { return load->done; }));
  EXPECT_TRUE(engine_->Holds(30, a[0]));
  ASSERT_TRUE(Settle());  // a[0] may be on its way to hbm: moving blocks are not evicted
  EXPECT_EQ(EvictNow(std::nullopt, std::nullopt, std::nullopt), 1u);
  EXPECT_EQ(cache_->Usage(Tier::kHost).blocks + cache_->Usage(Tier::kHbm).blocks, 0u);
  EXPECT_EQ(cache_->Usage(Tier::kHost).used_bytes + cache_->Usage(Tier::kHbm).used_bytes, 0u);
}

// A load leases a block whose demotion is in flight, so the block's old hbm
// slot is retired (kept for that load) when the demotion lands. Until that
// load is done, the block must not move again: an entry keeps one retired slot.
TEST_F(BlockCacheTest, PrefetchDoesNotMoveABlockWhoseOldSlotIsStillRead) {
  Start({.hbm_slots = 4, .host_slots = 8, .holding_backend = true});
  const std::vector<StoredKey> x = NewKeys(1);
  ASSERT_TRUE(Store(x, 0).status.ok());
  ASSERT_TRUE(Settle());
  cache_->SetWatermarks(TierWatermarks{.high = 0, .low = 0}, TierWatermarks{});
  ASSERT_EQ(cache_->inflight_copies(), 1u) << "the demotion";
  holding_->HoldLoads(true);
  std::shared_ptr<Op> load = LoadAsync(x, 10);  // reads the hbm slot
  ASSERT_TRUE(DrainUntil([&] { return cache_->counters().demotions == 1; }));
  EXPECT_EQ(cache_->leases(), 1u);
  cache_->SetWatermarks(TierWatermarks{}, TierWatermarks{});  // hbm has room again

  EXPECT_EQ(cache_->Prefetch(kTenant, x), (std::pair<uint32_t, uint32_t>{1, 0}));
  ASSERT_TRUE(DrainUntil([&] { return cache_->inflight_copies() == 1; }));  // the held load only
  ASSERT_TRUE(holding_->WaitHeld(1));
  ASSERT_TRUE(holding_->WaitHeld(1));
  holding_->HoldLoads(false);
  holding_->ReleaseAll();
  ASSERT_TRUE(DrainUntil([&] { return load->done; }));
  EXPECT_EQ(load->outcome.blocks, 1u);
  EXPECT_TRUE(engine_->Holds(10, x[0]));
  ASSERT_TRUE(Settle());
  EXPECT_EQ(cache_->leases(), 0u);
  // With the old slot free, the load's completion promoted the block.
  EXPECT_EQ(cache_->counters().promotions, 1u);
  EXPECT_EQ(cache_->Usage(Tier::kHbm).blocks, 1u);
  EXPECT_EQ(Load(x, 11).blocks, 1u);
  EXPECT_TRUE(engine_->Holds(11, x[0]));
}

// As above, with the second move started by another load of the block.
TEST_F(BlockCacheTest, LaterLoadDoesNotPromoteABlockWhoseOldSlotIsStillRead) {
  Start({.hbm_slots = 4, .host_slots = 8, .copy_threads = 1, .holding_backend = true});
  const std::vector<StoredKey> x = NewKeys(1);
  ASSERT_TRUE(Store(x, 0).status.ok());
  ASSERT_TRUE(Settle());
  cache_->SetWatermarks(TierWatermarks{.high = 0, .low = 0}, TierWatermarks{});
  holding_->HoldLoads(true);
  std::shared_ptr<Op> first = LoadAsync(x, 10);  // reads the hbm slot
  ASSERT_TRUE(DrainUntil([&] { return cache_->counters().demotions == 1; }));
  ASSERT_TRUE(holding_->WaitHeld(1));
  cache_->SetWatermarks(TierWatermarks{}, TierWatermarks{});
  std::shared_ptr<Op> second = LoadAsync(x, 11);  // reads the host slot
  ASSERT_TRUE(holding_->WaitHeld(2));
  holding_->HoldLoads(false);
  holding_->ReleaseNewest();  // the second load finishes first
  ASSERT_TRUE(DrainUntil([&] { return second->done; }));
  EXPECT_EQ(cache_->counters().promotions, 0u);
  EXPECT_EQ(cache_->inflight_copies(), 1u) << "only the first load: no move was started";
  holding_->ReleaseAll();
  ASSERT_TRUE(DrainUntil([&] { return first->done; }));
  ASSERT_TRUE(Settle());
  EXPECT_TRUE(engine_->Holds(10, x[0]));
  EXPECT_TRUE(engine_->Holds(11, x[0]));
  EXPECT_EQ(cache_->counters().promotions, 1u);
  EXPECT_EQ(cache_->leases(), 0u);
}

// Thousands of random stores, loads, lookups, prefetches, evictions and
// watermark changes, with completions run at random points. What must hold
// whatever was evicted: every block a load returns is byte-exact, a Load
// right after a Lookup loads exactly its hits, and usage adds up.
TEST_F(BlockCacheTest, RandomOpsKeepTheInvariants) {
  Start({.hbm_slots = 8, .host_slots = 24, .copy_threads = 2, .engine_blocks = 96});
  TenantQuota quota;
  quota.bytes[kHbm] = 2 * BlockBytes();
  quota.bytes[kHost] = 4 * BlockBytes();
  cache_->SetQuota(2, quota);
  constexpr size_t kChains = 8;
  constexpr size_t kLen = 6;
  std::vector<std::vector<StoredKey>> chains;
  for (size_t c = 0; c < kChains; ++c) chains.push_back(NewKeys(kLen));
  std::vector<uint32_t> free_blocks(engine_->num_blocks());
  std::iota(free_blocks.begin(), free_blocks.end(), 0);
  std::mt19937_64 rng(20240607);
  uint64_t blocks_checked = 0;
  uint64_t rejected = 0;

  auto take_blocks = [&](size_t n) {
    if (free_blocks.size() < n) {
      EXPECT_TRUE(Settle());
    }
    std::vector<uint32_t> ids(free_blocks.end() - static_cast<std::ptrdiff_t>(n),
                              free_blocks.end());
    free_blocks.resize(free_blocks.size() - n);
    return ids;
  };
  auto give_back = [&](const std::vector<uint32_t>& ids) {
    free_blocks.insert(free_blocks.end(), ids.begin(), ids.end());
  };
  auto check_usage = [&](int step) {
    uint64_t total = 0;
    for (Tier t : {Tier::kHbm, Tier::kHost}) {
      const TierUsage u = cache_->Usage(t);
      ASSERT_EQ(u.used_bytes, u.blocks * BlockBytes()) << "step " << step << " " << TierName(t);
      ASSERT_LE(u.used_bytes, u.capacity_bytes);
      total += u.used_bytes;
    }
    uint64_t by_tenant = 0;
    for (TenantId tenant = 0; tenant < 3; ++tenant) {
      by_tenant += cache_->TenantUsedBytes(tenant, Tier::kHbm) +
                   cache_->TenantUsedBytes(tenant, Tier::kHost);
    }
    ASSERT_EQ(total, by_tenant) << "step " << step;
  };

  for (int step = 0; step < 3000; ++step) {
    if (step % 100 == 0) {
      const Result<BlockCache::OrderCounts> orders = cache_->CheckOrders();
      ASSERT_TRUE(orders.has_value()) << "step " << step << ": " << orders.error();
    }
    const std::vector<StoredKey>& chain = chains[rng() % kChains];
    const size_t start = rng() % 2 ? 0 : rng() % kLen;  // requests mostly start at a chain's head
    const size_t len = 1 + rng() % std::min<size_t>(4, kLen - start);
    const std::vector<StoredKey> keys(chain.begin() + static_cast<std::ptrdiff_t>(start),
                                      chain.begin() + static_cast<std::ptrdiff_t>(start + len));
    const TenantId tenant = static_cast<TenantId>(rng() % 3);
    const uint32_t r = static_cast<uint32_t>(rng() % 100);
    if (r < 35) {
      const std::vector<uint32_t> ids = take_blocks(len);
      for (size_t i = 0; i < len; ++i) engine_->Fill(ids[i], keys[i]);
      auto owner = std::make_shared<int>(0);
      std::weak_ptr<void> weak = owner;
      if (rng() % 10 == 0) owner.reset();  // a client that dies before its copy lands
      const std::optional<StoredKey> parent =
          start > 0 ? std::optional<StoredKey>(chain[start - 1]) : std::nullopt;
      cache_->Store(tenant, keys, ids, parent, Target(), weak, [&, ids, owner, len](OpOutcome o) {
        EXPECT_TRUE(o.status.ok() || o.status.code() == StatusCode::kResourceExhausted) << o.status;
        if (!o.status.ok()) ++rejected;
        EXPECT_LE(o.blocks + o.already, len);
        give_back(ids);
      });
    } else if (r < 65) {
      const std::vector<uint32_t> ids = take_blocks(len);
      for (uint32_t id : ids) engine_->Zero(id);
      const CacheLookup hits = cache_->Lookup(kTenant, keys);
      cache_->Load(tenant, keys, ids, Target(), owner_, [&, ids, keys, hits](OpOutcome o) {
        EXPECT_TRUE(o.status.ok()) << o.status;
        EXPECT_EQ(o.blocks, hits.hits) << "a Load right after a Lookup loads its hits";
        for (size_t i = 0; i < o.blocks; ++i) EXPECT_TRUE(engine_->Holds(ids[i], keys[i]));
        for (size_t i = o.blocks; i < ids.size(); ++i) EXPECT_TRUE(engine_->IsZero(ids[i]));
        blocks_checked += o.blocks;
        give_back(ids);
      });
    } else if (r < 75) {
      const uint64_t leases = cache_->leases();
      const CacheLookup l = cache_->Lookup(kTenant, keys);
      ASSERT_LE(l.hits, len);
      ASSERT_EQ(l.tiers.size(), l.hits);
      ASSERT_EQ(cache_->leases(), leases);
    } else if (r < 80) {
      const auto [present, queued] = cache_->Prefetch(tenant, keys);
      ASSERT_LE(queued, present);
      ASSERT_LE(present, len);
    } else if (r < 83) {
      std::optional<std::vector<TenantId>> owners;
      if (rng() % 2) owners = std::vector<TenantId>{tenant};
      std::optional<Tier> tier;
      if (rng() % 2) tier = rng() % 2 ? Tier::kHbm : Tier::kHost;
      cache_->Evict(EvictFilter{owners, std::nullopt, tier}, [](uint64_t) {});
    } else if (r < 86) {
      const double high = 0.2 + 0.8 * static_cast<double>(rng() % 100) / 100;
      const double low = high * static_cast<double>(rng() % 100) / 100;
      cache_->SetWatermarks(TierWatermarks{.high = high, .low = low}, TierWatermarks{});
    } else if (r < 99) {
      RunPosted(rng() % 6);
    } else {
      ASSERT_TRUE(Settle());
      ASSERT_EQ(cache_->leases(), 0u);
    }
    check_usage(step);
    if (HasFatalFailure() || HasFailure()) break;
  }
  ASSERT_TRUE(Settle());
  EXPECT_EQ(cache_->leases(), 0u);
  EXPECT_EQ(free_blocks.size(), engine_->num_blocks()) << "every op completed once";
  check_usage(-1);
  const CacheCounters c = cache_->counters();
  // The mix did exercise what it is meant to.
  EXPECT_GT(blocks_checked, 300u);
  EXPECT_GT(c.stores, 100u);
  EXPECT_GT(c.already_stored, 0u);
  EXPECT_GT(c.stores_discarded, 0u);
  EXPECT_GT(c.demotions, 0u);
  EXPECT_GT(c.promotions, 0u);
  EXPECT_GT(c.evictions[kHost], 0u);
  RecordProperty("blocks_checked", std::to_string(blocks_checked));
  RecordProperty("rejected_stores", std::to_string(rejected));
}

}  // namespace
}  // namespace kvtier
