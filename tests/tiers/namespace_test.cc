// Namespace ids (issue 13, item 2): ids of layouts that hold no block are
// reused, a tenant holds blocks in a bounded number of layouts, and a
// hostile tenant that stores under more layouts than a 16-bit id can name
// (one block each, pushed to disk) neither aborts the daemon nor takes the
// id space from others. Also the NamespaceTable's own bookkeeping. The disk
// tier runs on the memory block device (the block-device seam); everything
// else is real.
#include "tiers/namespace_table.h"

#include <gtest/gtest.h>

#include <deque>
#include <filesystem>
#include <random>
#include <string>

#include "common/mutex.h"
#include "tests/tiers/disk/cache_loop.h"
#include "tests/tiers/disk/memory_device.h"
#include "tests/tiers/tiers_test_util.h"
#include "tiers/block_cache.h"
#include "devices/host_backend.h"

namespace kvtier {
namespace {

using namespace std::chrono_literals;
using tiers_test::EngineMemory;
using tiers_test::SmallSpec;

LayoutFingerprint Fp(uint64_t n) {
  LayoutFingerprint f;
  for (size_t i = 0; i < 8; ++i) f.bytes[i] = static_cast<uint8_t>(n >> (8 * i));
  f.bytes[15] = 1;
  return f;
}

TEST(NamespaceTableTest, AnIdWhoseBlocksAreGoneIsReused) {
  NamespaceTable t(/*max_namespaces=*/2, /*max_per_tenant=*/8);
  const uint32_t a = t.IdFor(Fp(1), [] { return std::string("a"); }).value();
  t.Charge(a, 1, Tier::kHost, 100, +1);
  const uint32_t b = t.IdFor(Fp(2)).value();
  t.Charge(b, 1, Tier::kDisk, 50, +1);
  EXPECT_NE(a, b);
  EXPECT_EQ(t.IdFor(Fp(1)).value(), a) << "stable while it holds blocks";
  EXPECT_EQ(t.live(), 2u);
  Result<uint32_t> full = t.IdFor(Fp(3));
  ASSERT_FALSE(full.has_value()) << "both ids hold blocks";
  EXPECT_EQ(full.error().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(full.error().message().find("namespace ids"), std::string::npos) << full.error();

  t.Charge(a, 1, Tier::kHost, 100, -1);  // a's last block goes
  EXPECT_EQ(t.live(), 1u);
  const uint32_t c = t.IdFor(Fp(3)).value();
  EXPECT_EQ(c, a) << "a's id is free again";
  EXPECT_EQ(t.Find(Fp(1)), std::nullopt) << "and no longer names a's layout";
  EXPECT_EQ(t.FingerprintOf(c), Fp(3));
}

TEST(NamespaceTableTest, ANewIdWithNoBlockIsReusedUnlessPinned) {
  NamespaceTable t(1, 8);
  const uint32_t a = t.IdFor(Fp(1)).value();  // a store that then stored nothing
  const uint32_t b = t.IdFor(Fp(2)).value();
  EXPECT_EQ(a, b);
  t.Pin(b);
  EXPECT_FALSE(t.IdFor(Fp(3)).has_value()) << "a pinned id stays";
  EXPECT_EQ(t.FingerprintOf(b), Fp(2));
  t.Unpin(b);
  EXPECT_TRUE(t.IdFor(Fp(3)).has_value());
}

TEST(NamespaceTableTest, TenantBoundAndUsageArePerTenant) {
  NamespaceTable t(100, /*max_per_tenant=*/2);
  // Each charged before the next id is made (an id with no block is free).
  const uint32_t a = t.IdFor(Fp(1), [] { return std::string("layout a"); }).value();
  ASSERT_TRUE(t.Admit(7, a).ok());
  t.Charge(a, 7, Tier::kHost, 10, +1);
  const uint32_t b = t.IdFor(Fp(2)).value();
  ASSERT_TRUE(t.Admit(7, b).ok());
  t.Charge(b, 7, Tier::kHost, 10, +1);
  const uint32_t c = t.IdFor(Fp(3)).value();
  t.Charge(a, 7, Tier::kDisk, 30, +1);
  EXPECT_TRUE(t.Admit(7, a).ok()) << "a layout it holds already";
  const Status refused = t.Admit(7, c);
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("limits.max_namespaces_per_tenant"), std::string::npos) << refused;
  EXPECT_TRUE(t.Admit(8, c).ok()) << "another tenant is not held back";
  t.Charge(c, 8, Tier::kHbm, 5, +1);
  t.Charge(a, 8, Tier::kHbm, 5, +1);

  const std::vector<NamespaceUsage> mine = t.Usage(7);
  ASSERT_EQ(mine.size(), 2u);
  uint64_t blocks = 0;
  for (const NamespaceUsage& u : mine) {
    blocks += u.blocks;
    if (u.fingerprint == Fp(1)) {
      EXPECT_EQ(u.description, "layout a");
      EXPECT_EQ(u.used_bytes[static_cast<size_t>(Tier::kHost)], 10u);
      EXPECT_EQ(u.used_bytes[static_cast<size_t>(Tier::kDisk)], 30u);
      EXPECT_EQ(u.used_bytes[static_cast<size_t>(Tier::kHbm)], 0u) << "tenant 8's block is not 7's";
    }
  }
  EXPECT_EQ(blocks, 3u);
  EXPECT_EQ(t.Usage(std::nullopt).size(), 3u);
  EXPECT_EQ(t.Usage(9).size(), 0u);

  t.Charge(b, 7, Tier::kHost, 10, -1);
  EXPECT_EQ(t.TenantNamespaces(7), 1u);
  EXPECT_TRUE(t.Admit(7, c).ok()) << "room again once a layout of its own is empty";
  EXPECT_EQ(t.Usage(7).size(), 1u);
}

constexpr uint64_t kRegionBytes = 64 << 10;
constexpr TenantId kTenant = 1;
constexpr TenantId kOther = 2;

// A block cache over a disk tier on a memory device, whose stores may name
// any of many layouts of the same shape (other model ids), all copied from
// one engine mapping.
class NamespaceCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kvtier-ns-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    backend_ = HostBackend::Create({.copy_threads = 2}).value();
    engine_ = EngineMemory::Create(*backend_, SmallSpec(1), 64).value();
    device_ = std::make_unique<MemoryDevice>(64 * kRegionBytes);
  }
  void TearDown() override {
    if (cache_) {
      EXPECT_TRUE(loop_.Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
    }
    cache_.reset();
    disk_.reset();
    std::filesystem::remove_all(dir_);
  }

  void Open(uint32_t max_namespaces, uint32_t max_per_tenant, uint64_t host_slots = 16) {
    disk_ = tiers_test::OpenDiskUnder(&cache_, {device_.get()}, dir_ + "/index", kRegionBytes, loop_.post()).value();
    BlockCache::Options o;
    o.backend = backend_.get();
    o.post = loop_.post();
    o.host_bytes = host_slots * SlotPool::StrideFor(engine_->block_bytes());
    o.host_watermarks = {.high = 0.5, .low = 0.25};
    o.disk = disk_.get();
    o.max_namespaces = max_namespaces;
    o.max_namespaces_per_tenant = max_per_tenant;
    cache_ = BlockCache::Create(std::move(o)).value();
    cache_->SetTenantName(kTenant, "t1");
    cache_->SetTenantName(kOther, "t2");
  }

  bool Drain(const std::function<bool()>& until) { return loop_.Drain(until, 60s); }

  // The layout of model `n`: the engine's shape under another model id.
  std::shared_ptr<const KvCacheLayout> LayoutOf(uint64_t n) {
    LayoutSpec spec = SmallSpec(1);
    spec.model_id = "hostile/" + std::to_string(n);
    Layout layout = Layout::Create(spec).value();
    const uint64_t size = layout.block_bytes() * engine_->num_blocks();
    return std::make_shared<const KvCacheLayout>(
        KvCacheLayout::Create(layout, engine_->num_blocks(), KvCacheLayout::Contiguous(layout), {size}).value());
  }

  StoredKey NewKey() {
    StoredKey k;
    for (auto& b : k.bytes) b = static_cast<uint8_t>(rng_());
    return k;
  }

  // Starts a store of `key` from engine block `block` under `layout`;
  // `out` gets its outcome.
  void StoreAsync(TenantId tenant, const StoredKey& key, uint32_t block,
                  std::shared_ptr<const KvCacheLayout> layout, std::shared_ptr<std::optional<OpOutcome>> out) {
    engine_->Fill(block, key);
    cache_->Store(tenant, std::span(&key, 1), std::span(&block, 1), std::nullopt,
                  EngineTarget{std::move(layout), engine_->mapping()}, owner_,
                  [out](OpOutcome o) { *out = std::move(o); });
  }
  OpOutcome Store(TenantId tenant, const StoredKey& key, std::shared_ptr<const KvCacheLayout> layout) {
    auto out = std::make_shared<std::optional<OpOutcome>>();
    StoreAsync(tenant, key, 0, std::move(layout), out);
    EXPECT_TRUE(Drain([&] { return out->has_value(); }));
    return out->value_or(OpOutcome{.status = Internal("no outcome")});
  }
  // Loads `key` (under `layout`) into engine block 63: whether it loaded
  // the key's bytes.
  bool LoadExact(TenantId tenant, const StoredKey& key, std::shared_ptr<const KvCacheLayout> layout) {
    engine_->Zero(63);
    const uint32_t block = 63;
    std::optional<OpOutcome> out;
    cache_->Load(tenant, std::span(&key, 1), std::span(&block, 1), EngineTarget{std::move(layout), engine_->mapping()},
                 owner_, [&](OpOutcome o) { out = std::move(o); });
    EXPECT_TRUE(Drain([&] { return out.has_value(); }));
    return out && out->blocks == 1 && engine_->Holds(63, key);
  }
  // Blocks of model n's layout (of `owner`, or anyone's).
  EvictFilter ByLayout(uint64_t n, std::optional<TenantId> owner = std::nullopt) {
    EvictFilter f;
    if (owner) f.owners = std::vector<TenantId>{*owner};
    f.layout = LayoutOf(n)->layout().fingerprint();
    return f;
  }
  uint64_t EvictNow(EvictFilter filter) {
    std::optional<uint64_t> n;
    cache_->Evict(std::move(filter), [&](uint64_t e) { n = e; });
    EXPECT_TRUE(Drain([&] { return n.has_value(); }));
    return n.value_or(0);
  }
  uint64_t BlocksHeld() const {
    return cache_->Usage(Tier::kHost).blocks + cache_->Usage(Tier::kDisk).blocks;
  }

  tiers_test::CacheLoop loop_;  // first: the tier and the cache post to it until they are gone
  std::string dir_;
  std::mt19937_64 rng_{7};
  std::unique_ptr<HostBackend> backend_;
  std::unique_ptr<EngineMemory> engine_;
  std::unique_ptr<MemoryDevice> device_;
  std::unique_ptr<DiskTier> disk_;
  std::unique_ptr<BlockCache> cache_;
  std::shared_ptr<void> owner_ = std::make_shared<int>(0);
};

// The hostile loop: more distinct layouts than 16 bits can name, one block
// each, written back to disk as the host tier fills. Before ids were reused,
// the 65,537th layout's block reached a CHECK on its way to disk and aborted
// the daemon for every tenant.
TEST_F(NamespaceCacheTest, MoreLayoutsThanIdsOneBlockEachNeverAbortAndReuseIds) {
  Open(NamespaceTable::kMaxIds, NamespaceTable::kMaxIds, /*host_slots=*/64);
  constexpr uint64_t kLayouts = NamespaceTable::kMaxIds + 1000;
  std::vector<StoredKey> last_keys;
  constexpr size_t kBatch = 8;  // stores in flight at once
  for (uint64_t n = 0; n < kLayouts; n += kBatch) {
    std::vector<std::shared_ptr<std::optional<OpOutcome>>> outs;
    std::vector<StoredKey> keys;
    for (uint64_t i = n; i < std::min(kLayouts, n + kBatch); ++i) {
      keys.push_back(NewKey());
      outs.push_back(std::make_shared<std::optional<OpOutcome>>());
      StoreAsync(kTenant, keys.back(), static_cast<uint32_t>(i - n), LayoutOf(i), outs.back());
      if (i + 4 >= kLayouts) last_keys.push_back(keys.back());
    }
    ASSERT_TRUE(Drain([&] {
      return std::all_of(outs.begin(), outs.end(), [](const auto& o) { return o->has_value(); });
    }));
    for (size_t j = 0; j < outs.size(); ++j) {
      if ((*outs[j])->status.code() == StatusCode::kResourceExhausted && (*outs[j])->status.message().find("no room") != std::string::npos) {
        // The host tier is all being written to disk: once the writes
        // land, there is room (as an engine retries).
        ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
        *outs[j] = std::nullopt;
        StoreAsync(kTenant, keys[j], static_cast<uint32_t>(j), LayoutOf(n + j), outs[j]);
        ASSERT_TRUE(Drain([&] { return outs[j]->has_value(); }));
      }
      ASSERT_TRUE((*outs[j])->status.ok()) << "layout " << n + j << ": " << (*outs[j])->status;
    }
    ASSERT_LE(cache_->live_namespaces(), BlocksHeld()) << "ids only for layouts that hold blocks";
  }
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
  EXPECT_GT(cache_->counters().disk_demotions, kLayouts / 4) << "the blocks went through the disk tier";
  EXPECT_LE(cache_->live_namespaces(), BlocksHeld());
  EXPECT_LT(cache_->live_namespaces(), NamespaceTable::kMaxIds);
  // The newest layouts' blocks are served, byte for byte, under their own ids.
  for (size_t j = 0; j < last_keys.size(); ++j) {
    EXPECT_TRUE(LoadExact(kTenant, last_keys[j], LayoutOf(kLayouts - last_keys.size() + j))) << j;
  }
  // A tenant that stores nothing hostile stores under a new layout.
  EXPECT_TRUE(Store(kOther, NewKey(), LayoutOf(kLayouts + 1)).status.ok());
}

TEST_F(NamespaceCacheTest, ATenantAtItsLayoutBoundIsRefusedClearlyAndOthersAreNot) {
  Open(NamespaceTable::kMaxIds, /*max_per_tenant=*/3);
  for (uint64_t n = 0; n < 3; ++n) ASSERT_TRUE(Store(kTenant, NewKey(), LayoutOf(n)).status.ok());
  const OpOutcome refused = Store(kTenant, NewKey(), LayoutOf(3));
  EXPECT_EQ(refused.status.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status.message().find("limits.max_namespaces_per_tenant"), std::string::npos)
      << refused.status;
  EXPECT_EQ(refused.blocks, 0u);
  EXPECT_TRUE(Store(kTenant, NewKey(), LayoutOf(1)).status.ok()) << "its own layouts still take blocks";
  EXPECT_TRUE(Store(kOther, NewKey(), LayoutOf(3)).status.ok()) << "the other tenant is not held back";

  // Once one of its layouts holds no block, it may use a new one.
  EXPECT_EQ(EvictNow(ByLayout(0, kTenant)),
            1u);
  EXPECT_TRUE(Store(kTenant, NewKey(), LayoutOf(3)).status.ok());
  EXPECT_EQ(cache_->UsageByNamespace(kTenant).size(), 3u);
}

TEST_F(NamespaceCacheTest, ANodeOutOfIdsRefusesNewLayoutsUntilOneIsEmpty) {
  Open(/*max_namespaces=*/4, /*max_per_tenant=*/100, /*host_slots=*/64);
  for (uint64_t n = 0; n < 4; ++n) ASSERT_TRUE(Store(kTenant, NewKey(), LayoutOf(n)).status.ok());
  const OpOutcome refused = Store(kOther, NewKey(), LayoutOf(4));
  EXPECT_EQ(refused.status.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status.message().find("namespace ids"), std::string::npos) << refused.status;
  EXPECT_EQ(EvictNow(ByLayout(2)), 1u);
  EXPECT_TRUE(Store(kOther, NewKey(), LayoutOf(4)).status.ok()) << "layout 2's id was reused";
  EXPECT_EQ(cache_->FindNamespaceId(LayoutOf(2)->layout().fingerprint()), std::nullopt);
}

// An Evict filtered by layout walks in steps; meanwhile its layout's id must
// not be reused by another layout (the walk would then drop that one's
// blocks).
TEST_F(NamespaceCacheTest, AnEvictByLayoutDropsOnlyThatLayoutEvenAcrossSteps) {
  Open(/*max_namespaces=*/2, /*max_per_tenant=*/100, /*host_slots=*/64);
  const StoredKey a = NewKey();
  const StoredKey b = NewKey();
  ASSERT_TRUE(Store(kTenant, a, LayoutOf(0)).status.ok());
  ASSERT_TRUE(Store(kTenant, b, LayoutOf(1)).status.ok());
  std::optional<uint64_t> evicted;
  cache_->Evict(ByLayout(0), [&](uint64_t n) { evicted = n; });
  EXPECT_EQ(cache_->pending_evicts(), 1u);
  // Layout 0's id holds no block now (the first step dropped it), but the
  // evict still runs: a new layout may not take the id.
  const OpOutcome refused = Store(kOther, NewKey(), LayoutOf(2));
  ASSERT_TRUE(Drain([&] { return evicted.has_value(); }));
  EXPECT_EQ(*evicted, 1u);
  EXPECT_EQ(refused.status.code(), StatusCode::kResourceExhausted) << "the evict pinned its id";
  EXPECT_TRUE(LoadExact(kTenant, b, LayoutOf(1)));
  EXPECT_TRUE(Store(kOther, NewKey(), LayoutOf(2)).status.ok()) << "after the evict, the id is free";
}

// An Evict of blocks that live only on disk walks the disk's records and
// gives their room back to the tier (its accounting, and the index).
TEST_F(NamespaceCacheTest, AnEvictOfDiskBlocksGivesTheirRoomBack) {
  Open(/*max_namespaces=*/8, /*max_per_tenant=*/8, /*host_slots=*/8);
  std::vector<StoredKey> keys;
  for (int i = 0; i < 24; ++i) {
    keys.push_back(NewKey());
    ASSERT_TRUE(Store(kTenant, keys.back(), LayoutOf(i % 2)).status.ok());
    // At the disk's pace: a store that outruns write-back drops dirty blocks.
    ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
  }
  ASSERT_GT(cache_->FlushToDisk(), 0u);
  ASSERT_TRUE(Drain([&] { return cache_->inflight_copies() == 0 && disk_->inflight() == 0; }));
  const uint64_t on_disk = cache_->Usage(Tier::kDisk).blocks;
  ASSERT_GT(on_disk, 8u) << "more than the host holds went to disk";
  ASSERT_GT(disk_->used_bytes(), 0u);
  EvictFilter disk_only;
  disk_only.tier = Tier::kDisk;
  EXPECT_EQ(EvictNow(ByLayout(1, kOther)), 0u) << "another tenant's filter matches nothing";
  const uint64_t evicted = EvictNow(disk_only);
  EXPECT_GT(evicted, 0u);
  EXPECT_EQ(cache_->Usage(Tier::kDisk).blocks, on_disk - evicted);
  EXPECT_EQ(cache_->Usage(Tier::kDisk).blocks, 0u) << "nothing was leased or moving";
  EXPECT_EQ(disk_->live_records(), 0u);
  EXPECT_EQ(disk_->used_bytes(), 0u) << "the records' bytes went back to the tier";
  for (const StoredKey& k : keys) {
    const CacheLookup l = cache_->Lookup(kTenant, std::span(&k, 1));
    EXPECT_TRUE(l.hits == 0 || l.tiers[0] == Tier::kHost);
  }
}

}  // namespace
}  // namespace kvtier
