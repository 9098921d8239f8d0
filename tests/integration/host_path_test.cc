// End-to-end tests of the host data path: a real kvtierd and real client
// processes over its unix socket.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <fstream>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/block_pattern.h"
#include "common/memory_mapping.h"
#include "common/version.h"
#include "ipc/seqpacket.h"
#include "ipc/wire.h"
#include "kvtier/client.h"
#include "kvtier/host_memory.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/raw_session.h"
#include "tests/integration/stats_when.h"
#include "tests/programs.h"

namespace kvtier::testing {
namespace {

using ::testing::HasSubstr;

constexpr uint32_t kBlockTokens = 16;

Layout SmallLayout() {
  // 16 KiB blocks: 2 layers x (K, V) x 16 tokens x 2 heads x 64 dims x bf16.
  return Layout::Create(LayoutSpec{.model_id = "kvtier/integration", .num_layers = 2,
                                   .kv_kind = KvKind::kSeparateKv, .num_kv_heads = 2, .head_dim = 64,
                                   .dtype = DType::kBf16, .block_tokens = kBlockTokens, .tp_rank = 0,
                                   .tp_size = 1, .scale_bytes_per_layer = 0})
      .value();
}

std::vector<uint32_t> Prompt(uint32_t seed, uint32_t blocks) { return PseudoTokens(seed, blocks * kBlockTokens); }

std::vector<uint32_t> Range(uint32_t first, uint32_t n) {
  std::vector<uint32_t> v(n);
  for (uint32_t i = 0; i < n; ++i) v[i] = first + i;
  return v;
}

std::unique_ptr<Client> MustConnect(const DaemonProcess& d, const std::string& token = "") {
  Result<std::unique_ptr<Client>> c = Client::Connect(
      {.socket_path = d.socket_path(), .token = token, .client_name = "test",
       .reconnect_interval = std::chrono::milliseconds(20)});
  EXPECT_TRUE(c.has_value()) << c.error() << "\n" << d.Log();
  return c ? std::move(*c) : nullptr;
}

// Stores `keys` from engine blocks `first..` after filling them from the keys.
void StoreFilled(Client& c, CacheId id, ShmKvCache& cache, const std::vector<BlockKey>& keys, uint32_t first) {
  for (size_t i = 0; i < keys.size(); ++i) FillFromKey(keys[i], cache.block(first + static_cast<uint32_t>(i)));
  Result<OpResult> r = c.Store(id, keys, Range(first, static_cast<uint32_t>(keys.size())));
  ASSERT_TRUE(r.has_value()) << r.error();
  EXPECT_EQ(r->blocks + r->already, keys.size());
}

// Loads into engine blocks `first..` (zeroed first); returns how many loaded
// blocks match their keys' content.
uint32_t LoadAndCount(Client& c, CacheId id, ShmKvCache& cache, const std::vector<BlockKey>& keys, uint32_t first) {
  for (size_t i = 0; i < keys.size(); ++i) {
    auto b = cache.block(first + static_cast<uint32_t>(i));
    std::fill(b.begin(), b.end(), 0);
  }
  Result<OpResult> r = c.Load(id, keys, Range(first, static_cast<uint32_t>(keys.size())));
  EXPECT_TRUE(r.has_value()) << r.error();
  if (!r) return 0;
  uint32_t good = 0;
  for (uint32_t i = 0; i < r->blocks; ++i) good += MatchesKey(keys[i], cache.block(first + i));
  EXPECT_EQ(good, r->blocks) << "a loaded block differs from what was stored";
  return good;
}

TEST(HostPathTest, RoundTripThroughHbmAndHostIsByteExact) {
  Result<DaemonProcess> d = DaemonProcess::Start({"tiers.hbm.enabled=true", "tiers.hbm.bytes=2MiB"});
  ASSERT_TRUE(d.has_value()) << d.error();
  std::unique_ptr<Client> c = MustConnect(*d);
  ASSERT_NE(c, nullptr);
  Result<ShmKvCache> cache = ShmKvCache::Create(SmallLayout(), 512);
  ASSERT_TRUE(cache.has_value());
  Result<CacheId> id = c->RegisterKvCache(*cache);
  ASSERT_TRUE(id.has_value()) << id.error();

  // 20 prompts of 20 blocks: 400 blocks, 6.25 MiB, three times the hbm tier.
  std::vector<std::vector<BlockKey>> prompts;
  for (uint32_t p = 0; p < 20; ++p) {
    Result<std::vector<BlockKey>> keys = c->ComputeKeys(*id, Prompt(p, 20));
    ASSERT_TRUE(keys.has_value());
    ASSERT_EQ(keys->size(), 20u);
    StoreFilled(*c, *id, *cache, *keys, 0);
    prompts.push_back(*keys);
  }
  const DaemonStats after_store = StatsWhen(*c, [](const DaemonStats& s) { return s.Counter("demotions") > 0; });
  EXPECT_GT(after_store.Counter("demotions"), 0u);
  EXPECT_EQ(after_store.Counter("stores"), 400u);

  bool saw_hbm = false, saw_host = false;
  for (const auto& keys : prompts) {
    Result<LookupResult> l = c->Lookup(*id, keys);
    ASSERT_TRUE(l.has_value());
    EXPECT_EQ(l->hits, 20u);
    for (BlockTier t : l->tiers) (t == BlockTier::kHbm ? saw_hbm : saw_host) = true;
    EXPECT_EQ(LoadAndCount(*c, *id, *cache, keys, 100), 20u);
  }
  EXPECT_TRUE(saw_hbm);
  EXPECT_TRUE(saw_host);
  const DaemonStats s = StatsWhen(*c, [](const DaemonStats& st) { return st.leases == 0; });
  EXPECT_EQ(s.leases, 0u);
  EXPECT_EQ(s.Counter("loads"), 400u);
  EXPECT_EQ(s.Counter("bytes_cache_to_engine"), 400u * SmallLayout().block_bytes());
}

// A load by layer (Client::LoadLayersAsync): WaitLayers(l) returns once
// every block's first l layers are in place, with no round trip; the load
// ends as a whole load does. The cache is contiguous, so a block's first l
// layers are its first l * layer_bytes bytes.
TEST(HostPathTest, ALoadByLayerIsInPlaceLayerByLayer) {
  Result<DaemonProcess> d = DaemonProcess::Start({});
  ASSERT_TRUE(d.has_value()) << d.error();
  std::unique_ptr<Client> c = MustConnect(*d);
  ASSERT_NE(c, nullptr);
  constexpr uint32_t kLayers = 12, kBlocks = 96;
  const Layout layout =
      Layout::Create(LayoutSpec{.model_id = "kvtier/by-layer", .num_layers = kLayers, .kv_kind = KvKind::kSeparateKv,
                                .num_kv_heads = 2, .head_dim = 64, .dtype = DType::kBf16,
                                .block_tokens = kBlockTokens, .tp_rank = 0, .tp_size = 1, .scale_bytes_per_layer = 0})
          .value();
  Result<ShmKvCache> cache = ShmKvCache::Create(layout, 2 * kBlocks);
  ASSERT_TRUE(cache.has_value());
  Result<CacheId> id = c->RegisterKvCache(*cache);
  ASSERT_TRUE(id.has_value()) << id.error();
  Result<std::vector<BlockKey>> keys = c->ComputeKeys(*id, Prompt(41, kBlocks));
  ASSERT_TRUE(keys.has_value());
  StoreFilled(*c, *id, *cache, *keys, 0);

  for (uint32_t b = kBlocks; b < 2 * kBlocks; ++b) std::ranges::fill(cache->block(b), 0);
  Result<OpHandle> op = c->LoadLayersAsync(*id, *keys, Range(kBlocks, kBlocks));
  ASSERT_TRUE(op.has_value()) << op.error();
  std::vector<uint8_t> want(layout.block_bytes());
  for (uint32_t l = 1; l <= kLayers; ++l) {
    Result<bool> in_place = c->WaitLayers(*op, l, std::chrono::seconds(30));
    ASSERT_TRUE(in_place.has_value()) << in_place.error();
    ASSERT_TRUE(*in_place) << "layer " << l;
    for (uint32_t i = 0; i < kBlocks; ++i) {
      FillFromKey((*keys)[i], want);
      ASSERT_EQ(std::memcmp(cache->block(kBlocks + i).data(), want.data(), l * layout.layer_bytes()), 0)
          << "block " << i << " lacks one of its first " << l << " layers";
    }
  }
  Result<OpResult> r = c->Wait(*op);
  ASSERT_TRUE(r.has_value()) << r.error();
  EXPECT_EQ(r->blocks, kBlocks);
  for (uint32_t i = 0; i < kBlocks; ++i) EXPECT_TRUE(MatchesKey((*keys)[i], cache->block(kBlocks + i))) << i;
  Result<bool> after = c->WaitLayers(*op, 1);
  ASSERT_TRUE(after.has_value());
  EXPECT_FALSE(*after) << "its result was collected: over";

  // A load of keys never stored loads nothing: every block it loads (none)
  // has its layers, and Wait says 0 blocks.
  Result<std::vector<BlockKey>> missing = c->ComputeKeys(*id, Prompt(42, 4));
  ASSERT_TRUE(missing.has_value());
  Result<OpHandle> none = c->LoadLayersAsync(*id, *missing, Range(0, 4));
  ASSERT_TRUE(none.has_value()) << none.error();
  Result<bool> none_in_place = c->WaitLayers(*none, kLayers, std::chrono::seconds(30));
  ASSERT_TRUE(none_in_place.has_value()) << none_in_place.error();
  Result<OpResult> none_result = c->Wait(*none);
  ASSERT_TRUE(none_result.has_value());
  EXPECT_EQ(none_result->blocks, 0u);

  // WaitLayers and StreamWaitLayers are for loads by layer only, and a
  // stream waits only for an op still running, with a stream.
  int stream_tag = 0;  // never dereferenced: each call is refused before any CUDA call
  const CudaStream stream = &stream_tag;
  Result<OpHandle> whole = c->LoadAsync(*id, *keys, Range(kBlocks, kBlocks));
  ASSERT_TRUE(whole.has_value());
  Result<bool> refused = c->WaitLayers(*whole, 1);
  ASSERT_FALSE(refused.has_value());
  EXPECT_EQ(refused.error().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c->StreamWaitLayers(*whole, 1, stream).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(c->Wait(*whole).has_value());
  EXPECT_EQ(c->StreamWaitLayers(*op, 1, stream).code(), StatusCode::kInvalidArgument) << "its result was collected";
  Result<OpHandle> running = c->LoadLayersAsync(*id, *keys, Range(kBlocks, kBlocks));
  ASSERT_TRUE(running.has_value()) << running.error();
  EXPECT_EQ(c->StreamWaitLayers(*running, 1, nullptr).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(c->Wait(*running).has_value());
  EXPECT_FALSE(c->WaitLayers(*op, 1, std::chrono::milliseconds(-1)).has_value());
}

// A store by layer (Client::StoreLayersAsync): the engine's blocks hold
// nonsense until each layer is written, and LayersWritten hands each layer
// over as it is; what is stored is the blocks as written. A store never
// written whole is given up at limits.store_layers_timeout_ms, one cancelled
// at once, one whose session ends with it: none stores anything, and none
// keeps an op or host room.
TEST(HostPathTest, AStoreByLayerStoresEachLayerAsWrittenAndOneNeverWrittenWholeStoresNothing) {
  Result<DaemonProcess> d = DaemonProcess::Start({"limits.store_layers_timeout_ms=5000"});
  ASSERT_TRUE(d.has_value()) << d.error();
  std::unique_ptr<Client> c = MustConnect(*d);
  ASSERT_NE(c, nullptr);
  constexpr uint32_t kLayers = 12, kBlocks = 64;
  const Layout layout =
      Layout::Create(LayoutSpec{.model_id = "kvtier/store-by-layer", .num_layers = kLayers,
                                .kv_kind = KvKind::kSeparateKv, .num_kv_heads = 2, .head_dim = 64,
                                .dtype = DType::kBf16, .block_tokens = kBlockTokens, .tp_rank = 0, .tp_size = 1,
                                .scale_bytes_per_layer = 0})
          .value();
  Result<ShmKvCache> cache = ShmKvCache::Create(layout, 2 * kBlocks);
  ASSERT_TRUE(cache.has_value());
  Result<CacheId> id = c->RegisterKvCache(*cache);
  ASSERT_TRUE(id.has_value()) << id.error();
  Result<std::vector<BlockKey>> keys = c->ComputeKeys(*id, Prompt(51, kBlocks));
  ASSERT_TRUE(keys.has_value());
  for (uint32_t b = 0; b < kBlocks; ++b) std::ranges::fill(cache->block(b), 0x5a);
  Result<OpHandle> op = c->StoreLayersAsync(*id, *keys, Range(0, kBlocks));
  ASSERT_TRUE(op.has_value()) << op.error();
  std::vector<uint8_t> want(layout.block_bytes());
  const uint64_t layer_bytes = layout.layer_bytes();
  for (uint32_t l = 0; l < kLayers; ++l) {
    for (uint32_t i = 0; i < kBlocks; ++i) {
      FillFromKey((*keys)[i], want);
      std::memcpy(cache->block(i).data() + l * layer_bytes, want.data() + l * layer_bytes, layer_bytes);
    }
    ASSERT_TRUE(c->LayersWritten(*op, l + 1).ok());
  }
  Result<OpResult> stored = c->Wait(*op, std::chrono::seconds(30));
  ASSERT_TRUE(stored.has_value()) << stored.error();
  EXPECT_EQ(stored->blocks, kBlocks);
  EXPECT_TRUE(c->LayersWritten(*op, kLayers).ok()) << "over: nothing to do";
  Result<OpResult> loaded = c->Load(*id, *keys, Range(kBlocks, kBlocks));
  ASSERT_TRUE(loaded.has_value()) << loaded.error();
  ASSERT_EQ(loaded->blocks, kBlocks);
  for (uint32_t i = 0; i < kBlocks; ++i) EXPECT_TRUE(MatchesKey((*keys)[i], cache->block(kBlocks + i))) << i;

  // Written up to layer 3, then never again: given up after 5 s (time
  // enough for the whole store above, however slow the build).
  Result<std::vector<BlockKey>> stalled = c->ComputeKeys(*id, Prompt(52, 8));
  ASSERT_TRUE(stalled.has_value());
  Result<OpHandle> half = c->StoreLayersAsync(*id, *stalled, Range(kBlocks, 8));
  ASSERT_TRUE(half.has_value()) << half.error();
  ASSERT_TRUE(c->LayersWritten(*half, 3).ok());
  Result<OpResult> given_up = c->Wait(*half, std::chrono::seconds(30));
  ASSERT_FALSE(given_up.has_value());
  EXPECT_EQ(given_up.error().code(), StatusCode::kCancelled) << given_up.error();
  EXPECT_EQ(c->Lookup(*id, *stalled).value().hits, 0u);

  // Cancelled: the client opens its layers for the daemon to find the fence
  // cancelled (no copy), so it is over before the timeout (which would count
  // it as given up).
  Result<std::vector<BlockKey>> cancelled = c->ComputeKeys(*id, Prompt(53, 8));
  ASSERT_TRUE(cancelled.has_value());
  Result<OpHandle> dropped = c->StoreLayersAsync(*id, *cancelled, Range(kBlocks, 8));
  ASSERT_TRUE(dropped.has_value()) << dropped.error();
  ASSERT_TRUE(c->Cancel(*dropped).ok());
  const DaemonStats after_cancel = StatsWhen(*c, [](const DaemonStats& s) { return s.inflight_ops == 0; });
  EXPECT_EQ(after_cancel.inflight_ops, 0u);
  EXPECT_EQ(after_cancel.Counter("stores_by_layer_expired"), 1u) << "the cancelled store waited for the timeout";

  // Its session ends with it half written.
  {
    std::unique_ptr<Client> gone = MustConnect(*d);
    ASSERT_NE(gone, nullptr);
    Result<CacheId> gone_id = gone->RegisterKvCache(*cache);
    ASSERT_TRUE(gone_id.has_value()) << gone_id.error();
    Result<std::vector<BlockKey>> its = gone->ComputeKeys(*gone_id, Prompt(54, 8));
    ASSERT_TRUE(its.has_value());
    Result<OpHandle> left = gone->StoreLayersAsync(*gone_id, *its, Range(kBlocks, 8));
    ASSERT_TRUE(left.has_value()) << left.error();
    ASSERT_TRUE(gone->LayersWritten(*left, 5).ok());
  }
  // Its ops go with the session; their blocks once the backend has run
  // their (aborted) copies.
  auto host_blocks = [](const DaemonStats& x) {
    for (const TierStats& t : x.tiers) {
      if (t.tier == BlockTier::kHost) return t.blocks;
    }
    return uint64_t{0};
  };
  const DaemonStats s = StatsWhen(
      *c, [&](const DaemonStats& x) { return x.sessions == 1 && x.inflight_ops == 0 && host_blocks(x) == kBlocks; });
  EXPECT_EQ(s.inflight_ops, 0u);
  EXPECT_EQ(host_blocks(s), kBlocks) << "a store given up keeps no host room";
  EXPECT_EQ(c->Lookup(*id, *c->ComputeKeys(*id, Prompt(54, 8))).value().hits, 0u);
  EXPECT_EQ(s.Counter("stores_by_layer"), 4u);
  EXPECT_EQ(s.Counter("stores_by_layer_expired"), 1u);
  EXPECT_EQ(s.Counter("stores"), kBlocks) << "only the store written whole";

  // LayersWritten is for stores by layer only.
  Result<OpHandle> whole = c->StoreAsync(*id, *keys, Range(0, kBlocks));
  ASSERT_TRUE(whole.has_value());
  EXPECT_EQ(c->LayersWritten(*whole, 1).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(c->Wait(*whole).has_value());
}

TEST(HostPathTest, EvictionDropsColdBlocksAndNeverServesWrongBytes) {
  // 64 KiB of host tier per ... a 1 MiB host tier holds 64 blocks; store 200.
  Result<DaemonProcess> d = DaemonProcess::Start({"tiers.host.bytes=1MiB"});
  ASSERT_TRUE(d.has_value()) << d.error();
  std::unique_ptr<Client> c = MustConnect(*d);
  ASSERT_NE(c, nullptr);
  Result<ShmKvCache> cache = ShmKvCache::Create(SmallLayout(), 256);
  ASSERT_TRUE(cache.has_value());
  const CacheId id = c->RegisterKvCache(*cache).value();
  std::vector<std::vector<BlockKey>> prompts;
  for (uint32_t p = 0; p < 20; ++p) {
    prompts.push_back(c->ComputeKeys(id, Prompt(1000 + p, 10)).value());
    StoreFilled(*c, id, *cache, prompts.back(), 0);
  }
  const DaemonStats s = c->Stats().value();
  EXPECT_GT(s.Counter("evictions_host"), 0u);
  EXPECT_LE(s.tiers.at(1).used_bytes, s.tiers.at(1).capacity_bytes);
  // The newest prompts are cached whole; whatever hits loads exact bytes.
  EXPECT_EQ(c->Lookup(id, prompts.back()).value().hits, 10u);
  for (const auto& keys : prompts) {
    const uint32_t hits = c->Lookup(id, keys).value().hits;
    if (hits > 0) {
      std::vector<BlockKey> head(keys.begin(), keys.begin() + hits);
      EXPECT_EQ(LoadAndCount(*c, id, *cache, head, 100), hits);
    }
  }
}

TEST(HostPathTest, SecondStoreIsAlreadyStoredAndLookupNeverPins) {
  Result<DaemonProcess> d = DaemonProcess::Start({});
  ASSERT_TRUE(d.has_value()) << d.error();
  std::unique_ptr<Client> c = MustConnect(*d);
  ASSERT_NE(c, nullptr);
  Result<ShmKvCache> cache = ShmKvCache::Create(SmallLayout(), 64);
  ASSERT_TRUE(cache.has_value());
  const CacheId id = c->RegisterKvCache(*cache).value();
  const std::vector<BlockKey> keys = c->ComputeKeys(id, Prompt(7, 8)).value();
  for (size_t i = 0; i < keys.size(); ++i) FillFromKey(keys[i], cache->block(static_cast<uint32_t>(i)));

  // Two stores of the same keys in flight at once: one copies, one is "already".
  Result<OpHandle> first = c->StoreAsync(id, keys, Range(0, 8));
  Result<OpHandle> second = c->StoreAsync(id, keys, Range(0, 8));
  ASSERT_TRUE(first.has_value() && second.has_value());
  const OpResult r1 = c->Wait(*first).value();
  const OpResult r2 = c->Wait(*second).value();
  EXPECT_EQ(r1.blocks, 8u);
  EXPECT_EQ(r2.blocks, 0u);
  EXPECT_EQ(r2.already, 8u);
  const OpResult r3 = c->Store(id, keys, Range(0, 8)).value();
  EXPECT_EQ(r3.already, 8u);
  for (int i = 0; i < 50; ++i) ASSERT_EQ(c->Lookup(id, keys).value().hits, 8u);
  const DaemonStats s = c->Stats().value();
  EXPECT_EQ(s.leases, 0u);
  EXPECT_EQ(s.Counter("stores"), 8u);
  EXPECT_EQ(s.Counter("already_stored"), 16u);
  // A wait on a finished op's handle a second time: its result was taken.
  Result<OpResult> again = c->Wait(*first);
  ASSERT_FALSE(again.has_value());
  EXPECT_EQ(again.error().code(), StatusCode::kNotFound);
}

TEST(HostPathTest, SigkilledClientLeavesNoLeaseMappingOrHalfWrittenEntry) {
  Result<DaemonProcess> d = DaemonProcess::Start({"tiers.host.bytes=128MiB"});
  ASSERT_TRUE(d.has_value()) << d.error();
  int progress[2];
  ASSERT_EQ(::pipe(progress), 0);
  constexpr uint32_t kStores = 1000;
  const std::string socket = d->socket_path();
  const pid_t child = ForkChild([&]() -> int {
    ::close(progress[0]);
    Result<std::unique_ptr<Client>> c = Client::Connect({.socket_path = socket, .client_name = "victim"});
    if (!c) return 10;
    Result<ShmKvCache> cache = ShmKvCache::Create(SmallLayout(), kStores);
    if (!cache) return 11;
    Result<CacheId> id = (*c)->RegisterKvCache(*cache);
    if (!id) return 12;
    Result<std::vector<BlockKey>> keys = (*c)->ComputeKeys(*id, Prompt(42, kStores));
    if (!keys) return 13;
    for (uint32_t i = 0; i < kStores; ++i) {
      FillFromKey((*keys)[i], cache->block(i));
      // Stores without waiting, and loads of earlier blocks, so that both are
      // in flight when the kill comes.
      if (!(*c)->StoreAsync(*id, std::span(*keys).subspan(i, 1), std::vector<uint32_t>{i})) return 14;
      if (i % 10 == 9) (void)(*c)->LoadAsync(*id, std::span(*keys).subspan(i - 9, 1), std::vector<uint32_t>{i - 9});
      const char one = 1;
      if (::write(progress[1], &one, 1) != 1) return 15;
    }
    ::pause();  // wait to be killed
    return 0;
  });
  ::close(progress[1]);
  // Kill it in the middle of its stores.
  uint32_t seen = 0;
  char buf[64];
  while (seen < 300) {
    const ssize_t n = ::read(progress[0], buf, sizeof(buf));
    ASSERT_GT(n, 0) << "the client process died early:\n" << d->Log();
    seen += static_cast<uint32_t>(n);
  }
  ::kill(child, SIGKILL);
  EXPECT_EQ(WaitChild(child), 128 + SIGKILL);
  ::close(progress[0]);

  std::unique_ptr<Client> c = MustConnect(*d);
  ASSERT_NE(c, nullptr);
  const DaemonStats s = StatsWhen(*c, [](const DaemonStats& st) {
    return st.sessions == 1 && st.leases == 0 && st.mappings == 0 && st.inflight_ops == 0;
  });
  EXPECT_EQ(s.sessions, 1u);  // ours
  EXPECT_EQ(s.leases, 0u);
  EXPECT_EQ(s.mappings, 0u);
  // Every block the dead client's keys hit holds exactly its bytes.
  Result<ShmKvCache> cache = ShmKvCache::Create(SmallLayout(), 16);
  ASSERT_TRUE(cache.has_value());
  const CacheId id = c->RegisterKvCache(*cache).value();
  const std::vector<BlockKey> keys = c->ComputeKeys(id, Prompt(42, kStores)).value();
  uint32_t present = 0;
  for (uint32_t i = 0; i < kStores; ++i) {
    if (c->Lookup(id, std::span(keys).subspan(i, 1)).value().hits == 0) continue;
    ++present;
    EXPECT_EQ(LoadAndCount(*c, id, *cache, {keys[i]}, 0), 1u) << "block " << i;
  }
  EXPECT_GT(present, 0u);
  EXPECT_LE(present, kStores);
  EXPECT_EQ(c->Stats().value().leases, 0u);
}

std::string Tok(char c) { return std::string(24, c); }

TEST(HostPathTest, TenantsAreIsolatedUnlessTheyShareAGroup) {
  const std::string tenants = "tenants=[{name: a, token: " + Tok('a') + "}, {name: b, token: " + Tok('b') +
                              "}, {name: c, token: " + Tok('c') + ", sharing_group: g}, {name: d, token: " +
                              Tok('d') + ", sharing_group: g}, {name: ops, token: " + Tok('o') + ", admin: true}]";
  Result<DaemonProcess> d = DaemonProcess::Start({tenants});
  ASSERT_TRUE(d.has_value()) << d.error();
  auto a = MustConnect(*d, Tok('a'));
  auto b = MustConnect(*d, Tok('b'));
  auto c = MustConnect(*d, Tok('c'));
  auto dd = MustConnect(*d, Tok('d'));
  ASSERT_TRUE(a && b && c && dd);
  EXPECT_EQ(a->tenant(), "a");
  EXPECT_EQ(dd->tenant(), "d");
  Result<ShmKvCache> cache = ShmKvCache::Create(SmallLayout(), 64);
  ASSERT_TRUE(cache.has_value());
  const CacheId ia = a->RegisterKvCache(*cache).value();
  const CacheId ib = b->RegisterKvCache(*cache).value();
  const CacheId ic = c->RegisterKvCache(*cache).value();
  const CacheId id = dd->RegisterKvCache(*cache).value();

  const std::vector<uint32_t> system_prompt = Prompt(99, 6);
  const std::vector<BlockKey> ka = a->ComputeKeys(ia, system_prompt).value();
  StoreFilled(*a, ia, *cache, ka, 0);
  EXPECT_EQ(a->Lookup(ia, ka).value().hits, 6u);
  // b computes its own keys for the same tokens (another hash secret)...
  const std::vector<BlockKey> kb = b->ComputeKeys(ib, system_prompt).value();
  EXPECT_NE(kb, ka);
  EXPECT_EQ(b->Lookup(ib, kb).value().hits, 0u);
  // ...and even a's exact keys miss for b: stored keys are salted per tenant.
  EXPECT_EQ(b->Lookup(ib, ka).value().hits, 0u);
  EXPECT_EQ(b->Load(ib, ka, Range(10, 6)).value().blocks, 0u);

  // c and d share a group: same chain keys, and d hits what c stored.
  const std::vector<BlockKey> kc = c->ComputeKeys(ic, system_prompt).value();
  EXPECT_EQ(dd->ComputeKeys(id, system_prompt).value(), kc);
  StoreFilled(*c, ic, *cache, kc, 20);
  EXPECT_EQ(dd->Lookup(id, kc).value().hits, 6u);
  EXPECT_EQ(LoadAndCount(*dd, id, *cache, kc, 40), 6u);
  EXPECT_EQ(a->Lookup(ia, kc).value().hits, 0u);

  // Admin calls.
  Result<std::vector<TenantStats>> list = a->ListTenants();
  ASSERT_FALSE(list.has_value());
  EXPECT_EQ(list.error().code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(b->Evict("a").error().code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(b->Evict().value(), 0u);  // b's own: nothing
  EXPECT_EQ(a->Lookup(ia, ka).value().hits, 6u);
  auto ops = MustConnect(*d, Tok('o'));
  ASSERT_NE(ops, nullptr);
  list = ops->ListTenants();
  ASSERT_TRUE(list.has_value()) << list.error();
  ASSERT_EQ(list->size(), 5u);
  EXPECT_EQ((*list)[0].name, "a");
  EXPECT_EQ((*list)[0].blocks, 6u);
  EXPECT_EQ(ops->Evict("a").value(), 6u);
  EXPECT_EQ(a->Lookup(ia, ka).value().hits, 0u);
  EXPECT_EQ(dd->Lookup(id, kc).value().hits, 6u);

  // Peers that are no tenant are refused.
  Result<std::unique_ptr<Client>> wrong = Client::Connect({.socket_path = d->socket_path(), .token = Tok('x')});
  ASSERT_FALSE(wrong.has_value());
  EXPECT_EQ(wrong.error().code(), StatusCode::kUnauthenticated);
  Result<std::unique_ptr<Client>> none = Client::Connect({.socket_path = d->socket_path()});
  ASSERT_FALSE(none.has_value());
  EXPECT_EQ(none.error().code(), StatusCode::kUnauthenticated);
  EXPECT_GE(ops->Stats().value().Counter("sessions_refused"), 2u);
}

TEST(HostPathTest, PeerWhoseUidIsNotConfiguredIsRefused) {
  // The only tenant is some other uid.
  const uint32_t other = ::getuid() + 4242;
  Result<DaemonProcess> d = DaemonProcess::Start({"tenants=[{name: x, uid: " + std::to_string(other) + "}]"});
  ASSERT_TRUE(d.has_value()) << d.error();
  Result<std::unique_ptr<Client>> c = Client::Connect({.socket_path = d->socket_path()});
  ASSERT_FALSE(c.has_value());
  EXPECT_EQ(c.error().code(), StatusCode::kUnauthenticated);
  struct stat st {};
  ASSERT_EQ(::stat(d->socket_path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u);
}

TEST(HostPathTest, MalformedAndOutOfRangeMessagesAreRefusedAndOthersUnaffected) {
  Result<DaemonProcess> d = DaemonProcess::Start({"limits.max_message_bytes=64KiB", "limits.max_keys_per_request=64"});
  ASSERT_TRUE(d.has_value()) << d.error();
  auto good = MustConnect(*d);
  ASSERT_NE(good, nullptr);
  Result<ShmKvCache> cache = ShmKvCache::Create(SmallLayout(), 32);
  ASSERT_TRUE(cache.has_value());
  const CacheId id = good->RegisterKvCache(*cache).value();
  const std::vector<BlockKey> keys = good->ComputeKeys(id, Prompt(5, 4)).value();
  StoreFilled(*good, id, *cache, keys, 0);

  {  // Garbage bytes: an error, then the connection is closed.
    RawSession raw(d->socket_path());
    const std::vector<uint8_t> garbage = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    ASSERT_TRUE(raw.Send(garbage).ok());
    const RawSession::Reply r = raw.Receive();
    EXPECT_EQ(r.body, wire::Body::Error);
    EXPECT_EQ(r.code, StatusCode::kInvalidArgument);
    EXPECT_TRUE(raw.Receive().eof);
  }
  {  // Larger than limits.max_message_bytes.
    RawSession raw(d->socket_path());
    ASSERT_TRUE(raw.Send(std::vector<uint8_t>(128 << 10, 7)).ok());
    const RawSession::Reply r = raw.Receive();
    EXPECT_EQ(r.code, StatusCode::kInvalidArgument);
    EXPECT_THAT(r.message, HasSubstr("max_message_bytes"));
    EXPECT_TRUE(raw.Receive().eof);
  }
  {  // A request before Hello.
    RawSession raw(d->socket_path());
    flatbuffers::FlatBufferBuilder b;
    ASSERT_TRUE(raw.Send(ipc::FinishMessage(b, 3, wire::CreateStats(b))).ok());
    EXPECT_EQ(raw.Receive().code, StatusCode::kUnauthenticated);
    EXPECT_TRUE(raw.Receive().eof);
  }
  {  // A wrong protocol version.
    RawSession raw(d->socket_path());
    flatbuffers::FlatBufferBuilder b;
    ASSERT_TRUE(raw.Send(ipc::FinishMessage(b, 1, wire::CreateHelloDirect(b, 99))).ok());
    const RawSession::Reply refused = raw.Receive();
    EXPECT_EQ(refused.code, StatusCode::kFailedPrecondition);
    EXPECT_EQ(refused.message, "protocol version 99 is not supported; kvtierd speaks " +
                                   std::to_string(ipc::kProtocolVersion) + " (release " + kVersion + ")");
    EXPECT_TRUE(raw.Receive().eof);
  }
  {  // Bad requests on a good session get errors and the session goes on.
    RawSession raw(d->socket_path());
    raw.Hello();
    flatbuffers::FlatBufferBuilder b;
    // Unknown namespace.
    std::vector<wire::Key> wk = {ipc::ToWire(keys[0])};
    ASSERT_TRUE(raw.Send(ipc::FinishMessage(b, 2, wire::CreateLookupDirect(b, 77, &wk))).ok());
    EXPECT_EQ(raw.Receive().code, StatusCode::kNotFound);
    // Register: region fd index that names no descriptor, and bad placements.
    b.Clear();
    std::vector<flatbuffers::Offset<wire::MemoryRegion>> regions = {
        wire::CreateMemoryRegion(b, wire::MemoryKind::HostMemfd, cache->size_bytes(), 3)};
    std::vector<wire::Placement> placements;
    for (const Placement& p : cache->placements()) placements.push_back(ipc::PlacementToWire(p));
    ASSERT_TRUE(raw.Send(ipc::FinishMessage(b, 3, wire::CreateRegisterKvCacheDirect(
                                                      b, ipc::LayoutToWire(b, SmallLayout()), 32, &regions,
                                                      &placements)))
                    .ok());
    EXPECT_EQ(raw.Receive().code, StatusCode::kInvalidArgument);
    // Register with a region larger than the memfd behind it.
    b.Clear();
    regions = {wire::CreateMemoryRegion(b, wire::MemoryKind::HostMemfd, cache->size_bytes() * 2, 0)};
    const int fd = cache->fd();
    ASSERT_TRUE(raw.Send(ipc::FinishMessage(b, 4, wire::CreateRegisterKvCacheDirect(
                                                      b, ipc::LayoutToWire(b, SmallLayout()), 64, &regions,
                                                      &placements)),
                         std::span(&fd, 1))
                    .ok());
    EXPECT_EQ(raw.Receive().code, StatusCode::kInvalidArgument);
    // A good registration, then out-of-range ids, mismatched counts, too many keys.
    b.Clear();
    regions = {wire::CreateMemoryRegion(b, wire::MemoryKind::HostMemfd, cache->size_bytes(), 0)};
    ASSERT_TRUE(raw.Send(ipc::FinishMessage(b, 5, wire::CreateRegisterKvCacheDirect(
                                                      b, ipc::LayoutToWire(b, SmallLayout()), 32, &regions,
                                                      &placements)),
                         std::span(&fd, 1))
                    .ok());
    ASSERT_EQ(raw.Receive().body, wire::Body::Registered);
    b.Clear();
    std::vector<uint32_t> ids = {32};
    ASSERT_TRUE(raw.Send(ipc::FinishMessage(b, 6, wire::CreateLoadDirect(b, 1, &wk, &ids))).ok());
    EXPECT_EQ(raw.Receive().code, StatusCode::kOutOfRange);
    b.Clear();
    ids = {1, 2};
    ASSERT_TRUE(raw.Send(ipc::FinishMessage(b, 7, wire::CreateStoreDirect(b, 1, &wk, &ids))).ok());
    EXPECT_EQ(raw.Receive().code, StatusCode::kInvalidArgument);
    b.Clear();
    std::vector<wire::Key> many(65, ipc::ToWire(keys[0]));
    ASSERT_TRUE(raw.Send(ipc::FinishMessage(b, 8, wire::CreateLookupDirect(b, 1, &many))).ok());
    EXPECT_EQ(raw.Receive().code, StatusCode::kInvalidArgument);
    b.Clear();
    std::vector<wire::Key> two = {ipc::ToWire(keys[0]), ipc::ToWire(keys[1])};
    ids = {3, 3};
    ASSERT_TRUE(raw.Send(ipc::FinishMessage(b, 9, wire::CreateLoadDirect(b, 1, &two, &ids))).ok());
    EXPECT_EQ(raw.Receive().code, StatusCode::kInvalidArgument);
    b.Clear();
    ASSERT_TRUE(raw.Send(ipc::FinishMessage(b, 10, wire::CreateWait(b, 12345, 0))).ok());
    EXPECT_EQ(raw.Receive().code, StatusCode::kNotFound);
    b.Clear();
    ASSERT_TRUE(raw.Send(ipc::FinishMessage(b, 11, wire::CreateStats(b))).ok());
    EXPECT_EQ(raw.Receive().body, wire::Body::StatsReply);
  }
  // The good client never noticed.
  EXPECT_EQ(good->Lookup(id, keys).value().hits, 4u);
  EXPECT_EQ(LoadAndCount(*good, id, *cache, keys, 10), 4u);
  Result<OpResult> bad = good->Load(id, keys, std::vector<uint32_t>{0, 1, 2, 40});
  ASSERT_FALSE(bad.has_value());
  EXPECT_EQ(bad.error().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(good->Lookup(id, keys).value().hits, 4u);
  EXPECT_GE(good->Stats().value().Counter("messages_rejected"), 2u);
}

// A memfd of `size` bytes sealed against shrinking, as a client sends one.
Result<UniqueFd> MakeSealedMemfd(uint64_t size) {
  UniqueFd fd(::memfd_create("kvtier-test", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd) return Err(Status::FromErrno(errno, "memfd_create"));
  if (::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) return Err(Status::FromErrno(errno, "ftruncate"));
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK) != 0) return Err(Status::FromErrno(errno, "F_ADD_SEALS"));
  return fd;
}

// The CUDA parts of the protocol on a host daemon: every one is refused with
// a clear error, and the session goes on.
TEST(HostPathTest, CudaRequestsOnAHostDaemonAreRefusedClearly) {
  Result<DaemonProcess> d = DaemonProcess::Start({"device.backend=host"});
  ASSERT_TRUE(d.has_value()) << d.error();
  auto good = MustConnect(*d);
  ASSERT_NE(good, nullptr);
  EXPECT_THAT(good->Stats().value().backend, HasSubstr("host"));
  Result<ShmKvCache> cache = ShmKvCache::Create(SmallLayout(), 32);
  ASSERT_TRUE(cache.has_value());
  const CacheId id = good->RegisterKvCache(*cache).value();
  const std::vector<BlockKey> keys = good->ComputeKeys(id, Prompt(6, 4)).value();
  StoreFilled(*good, id, *cache, keys, 0);

  // Client side: a stream for a memfd cache, and device memory without a GPU
  // (or, in a build without CUDA, at all).
  int fake_stream = 0;
  const std::vector<uint32_t> ids = {10, 11, 12, 13};
  Result<OpHandle> streamed = good->LoadAsync(id, keys, ids, &fake_stream);
  ASSERT_FALSE(streamed.has_value());
  EXPECT_EQ(streamed.error().code(), StatusCode::kInvalidArgument) << streamed.error();
  std::vector<uint8_t> not_device(4096);
  Result<CacheId> gpu = good->RegisterCudaKvCache(SmallLayout(), 1, KvCacheLayout::Contiguous(SmallLayout()),
                                                  {CudaKvRegion{not_device.data(), not_device.size()}});
  ASSERT_FALSE(gpu.has_value());
  EXPECT_NE(gpu.error().code(), StatusCode::kOk) << gpu.error();

  RawSession raw(d->socket_path());
  raw.Hello();
  flatbuffers::FlatBufferBuilder b;
  std::vector<wire::Placement> placements;
  for (const Placement& p : cache->placements()) placements.push_back(ipc::PlacementToWire(p));
  const int fd = cache->fd();
  {  // IPC events with a memfd cache: the host backend has none.
    std::vector<flatbuffers::Offset<wire::MemoryRegion>> regions = {
        wire::CreateMemoryRegion(b, wire::MemoryKind::HostMemfd, cache->size_bytes(), 0)};
    std::vector<wire::CudaEventHandle> events(2);
    ASSERT_TRUE(raw.Send(ipc::FinishMessage(b, 2, wire::CreateRegisterKvCacheDirect(
                                                      b, ipc::LayoutToWire(b, SmallLayout()), 32, &regions,
                                                      &placements, &events)),
                         std::span(&fd, 1))
                    .ok());
    const RawSession::Reply r = raw.Receive();
    EXPECT_EQ(r.code, StatusCode::kInvalidArgument);
    EXPECT_THAT(r.message, HasSubstr("cuda device backend"));
  }
  {  // A CUDA IPC region: the host backend maps memfds only.
    b.Clear();
    const std::vector<uint8_t> handle(64, 1);
    std::vector<flatbuffers::Offset<wire::MemoryRegion>> regions = {wire::CreateMemoryRegionDirect(
        b, wire::MemoryKind::CudaIpc, cache->size_bytes(), -1, &handle, 0, 0)};
    ASSERT_TRUE(raw.Send(ipc::FinishMessage(b, 3, wire::CreateRegisterKvCacheDirect(
                                                      b, ipc::LayoutToWire(b, SmallLayout()), 32, &regions,
                                                      &placements)))
                    .ok());
    EXPECT_EQ(raw.Receive().code, StatusCode::kInvalidArgument);
  }
  {  // A short CUDA IPC handle, and a short device UUID.
    b.Clear();
    const std::vector<uint8_t> short_handle(63, 1);
    std::vector<flatbuffers::Offset<wire::MemoryRegion>> regions = {wire::CreateMemoryRegionDirect(
        b, wire::MemoryKind::CudaIpc, cache->size_bytes(), -1, &short_handle, 0, 0)};
    ASSERT_TRUE(raw.Send(ipc::FinishMessage(b, 4, wire::CreateRegisterKvCacheDirect(
                                                      b, ipc::LayoutToWire(b, SmallLayout()), 32, &regions,
                                                      &placements)))
                    .ok());
    EXPECT_THAT(raw.Receive().message, HasSubstr("64 bytes"));
    b.Clear();
    const std::vector<uint8_t> handle(64, 1);
    const std::vector<uint8_t> uuid(15, 2);
    regions = {wire::CreateMemoryRegionDirect(b, wire::MemoryKind::CudaIpc, cache->size_bytes(), -1, &handle, 0, 0,
                                              &uuid)};
    ASSERT_TRUE(raw.Send(ipc::FinishMessage(b, 5, wire::CreateRegisterKvCacheDirect(
                                                      b, ipc::LayoutToWire(b, SmallLayout()), 32, &regions,
                                                      &placements)))
                    .ok());
    EXPECT_THAT(raw.Receive().message, HasSubstr("16 bytes"));
  }
  {  // A good memfd registration, then Load and Store naming events it does not have.
    b.Clear();
    std::vector<flatbuffers::Offset<wire::MemoryRegion>> regions = {
        wire::CreateMemoryRegion(b, wire::MemoryKind::HostMemfd, cache->size_bytes(), 0)};
    ASSERT_TRUE(raw.Send(ipc::FinishMessage(b, 6, wire::CreateRegisterKvCacheDirect(
                                                      b, ipc::LayoutToWire(b, SmallLayout()), 32, &regions,
                                                      &placements)),
                         std::span(&fd, 1))
                    .ok());
    ASSERT_EQ(raw.Receive().body, wire::Body::Registered);
    std::vector<wire::Key> wk = {ipc::ToWire(keys[0])};
    std::vector<uint32_t> one = {20};
    b.Clear();
    ASSERT_TRUE(raw.Send(ipc::FinishMessage(b, 7, wire::CreateLoadDirect(b, 1, &wk, &one, false, 0))).ok());
    RawSession::Reply r = raw.Receive();
    EXPECT_EQ(r.code, StatusCode::kInvalidArgument);
    EXPECT_THAT(r.message, HasSubstr("CUDA events"));
    b.Clear();
    ASSERT_TRUE(raw.Send(ipc::FinishMessage(b, 8, wire::CreateStoreDirect(b, 1, &wk, &one, nullptr, false, -7))).ok());
    EXPECT_EQ(raw.Receive().code, StatusCode::kInvalidArgument);
    // Without an event the same load works, and OpStarted says no event was recorded.
    b.Clear();
    ASSERT_TRUE(raw.Send(ipc::FinishMessage(b, 9, wire::CreateLoadDirect(b, 1, &wk, &one, false, -1))).ok());
    r = raw.Receive();
    EXPECT_EQ(r.body, wire::Body::OpStarted);
    EXPECT_FALSE(r.event_recorded);
  }
  {  // A completion page: the daemon writes a store's value into its slot when it is over.
    Result<UniqueFd> page_fd = MakeSealedMemfd(4096);
    ASSERT_TRUE(page_fd.has_value()) << page_fd.error();
    Result<MemoryMapping> page = MemoryMapping::Map(MemoryMapping::Options{
        .size_bytes = 4096, .prot = PROT_READ | PROT_WRITE, .flags = MAP_SHARED, .fd = page_fd->get()});
    ASSERT_TRUE(page.has_value()) << page.error();
    b.Clear();
    std::vector<flatbuffers::Offset<wire::MemoryRegion>> regions = {
        wire::CreateMemoryRegion(b, wire::MemoryKind::HostMemfd, cache->size_bytes(), 0)};
    const std::array<int, 2> fds = {fd, page_fd->get()};
    ASSERT_TRUE(raw.Send(ipc::FinishMessage(b, 10, wire::CreateRegisterKvCacheDirect(
                                                       b, ipc::LayoutToWire(b, SmallLayout()), 32, &regions,
                                                       &placements, nullptr, 1)),
                         fds)
                    .ok());
    ASSERT_EQ(raw.Receive().body, wire::Body::Registered);  // namespace 2
    const std::vector<BlockKey> more = good->ComputeKeys(id, Prompt(61, 1)).value();
    std::vector<wire::Key> wk = {ipc::ToWire(more[0])};
    std::vector<uint32_t> one = {3};
    b.Clear();
    ASSERT_TRUE(raw.Send(ipc::FinishMessage(b, 11, wire::CreateStoreDirect(b, 2, &wk, &one, nullptr, true, -1, 5,
                                                                             77)))
                    .ok());
    EXPECT_EQ(raw.Receive().body, wire::Body::OpResult);
    EXPECT_EQ(std::atomic_ref<uint32_t>(reinterpret_cast<uint32_t*>(page->data())[5]).load(), 77u);
    // A slot past the page, and a slot on a cache with no page.
    b.Clear();
    ASSERT_TRUE(raw.Send(ipc::FinishMessage(b, 12, wire::CreateStoreDirect(b, 2, &wk, &one, nullptr, true, -1,
                                                                             1024, 1)))
                    .ok());
    EXPECT_EQ(raw.Receive().code, StatusCode::kInvalidArgument);
    b.Clear();
    ASSERT_TRUE(raw.Send(ipc::FinishMessage(b, 13, wire::CreateStoreDirect(b, 1, &wk, &one, nullptr, true, -1, 0,
                                                                             1)))
                    .ok());
    EXPECT_THAT(raw.Receive().message, HasSubstr("completion page"));
  }
  EXPECT_EQ(LoadAndCount(*good, id, *cache, keys, 10), 4u);
}

TEST(HostPathTest, ClientReconnectsAndReregistersAfterDaemonRestart) {
  Result<DaemonProcess> d = DaemonProcess::Start({});
  ASSERT_TRUE(d.has_value()) << d.error();
  auto c = MustConnect(*d);
  ASSERT_NE(c, nullptr);
  Result<ShmKvCache> cache = ShmKvCache::Create(SmallLayout(), 32);
  ASSERT_TRUE(cache.has_value());
  const CacheId id = c->RegisterKvCache(*cache).value();
  const std::vector<BlockKey> keys = c->ComputeKeys(id, Prompt(11, 4)).value();
  StoreFilled(*c, id, *cache, keys, 0);
  const OpHandle before = c->LoadAsync(id, keys, Range(10, 4)).value();
  ASSERT_TRUE(c->Wait(before).has_value());
  const OpHandle lost = c->LoadAsync(id, keys, Range(10, 4)).value();

  d->Kill();
  Result<LookupResult> gap = c->Lookup(id, keys);
  ASSERT_FALSE(gap.has_value());
  EXPECT_EQ(gap.error().code(), StatusCode::kUnavailable);
  ASSERT_TRUE(d->Restart().ok()) << d->Log();

  // Within a few reconnect intervals the same cache id works again.
  Result<LookupResult> after = Err(Status(StatusCode::kUnavailable, ""));
  for (int i = 0; i < 200 && !after; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    after = c->Lookup(id, keys);
  }
  ASSERT_TRUE(after.has_value()) << after.error();
  EXPECT_EQ(after->hits, 0u);  // memory tiers start empty (the disk tier will keep them)
  EXPECT_EQ(c->Wait(lost).error().code(), StatusCode::kUnavailable);
  // The hash secret survived the restart: keys are the same.
  EXPECT_EQ(c->ComputeKeys(id, Prompt(11, 4)).value(), keys);
  StoreFilled(*c, id, *cache, keys, 0);
  EXPECT_EQ(LoadAndCount(*c, id, *cache, keys, 10), 4u);
}

TEST(HostPathTest, SighupReloadsWatermarksAndLogLevel) {
  char path[] = "/tmp/kvtier-it-config-XXXXXX.yaml";
  const int fd = ::mkstemps(path, 5);
  ASSERT_GE(fd, 0);
  ::close(fd);
  std::ofstream(path) << "log:\n  level: info\n";
  Result<DaemonProcess> d = DaemonProcess::Start({}, path);
  ASSERT_TRUE(d.has_value()) << d.error();
  std::ofstream(path) << "log:\n  level: debug\npolicy:\n  watermarks:\n    host: {high: 0.7, low: 0.5}\n";
  d->Signal(SIGHUP);
  bool reloaded = false;
  for (int i = 0; i < 500 && !reloaded; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    reloaded = d->Log().find("SIGHUP: reloaded watermarks, quotas and log level (debug)") != std::string::npos;
  }
  EXPECT_TRUE(reloaded) << d->Log();
  // An invalid file is refused and the daemon keeps running.
  std::ofstream(path) << "log:\n  level: loud\n";
  d->Signal(SIGHUP);
  bool refused = false;
  for (int i = 0; i < 500 && !refused; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    refused = d->Log().find("config not reloaded") != std::string::npos;
  }
  EXPECT_TRUE(refused) << d->Log();
  EXPECT_NE(MustConnect(*d), nullptr);
  EXPECT_EQ(WEXITSTATUS(d->Stop()), 0);
  ::unlink(path);
}

TEST(HostPathTest, CApiEngineStoresAndLoads) {
  Result<DaemonProcess> d = DaemonProcess::Start({});
  ASSERT_TRUE(d.has_value()) << d.error();
  const std::string cmd = testing::ProgramPath("c_api_example") + " " + d->socket_path();
  const int status = std::system(cmd.c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "exit " << WEXITSTATUS(status) << "\n" << d->Log();
}

TEST(HostPathTest, AnEngineAllocatedCacheIsAdoptedInPlaceAndServed) {
  // The engine allocates its cache itself (as torch.zeros does: malloc, not
  // page-aligned), one tensor per layer (vLLM's NHD), fills some blocks, and
  // only then registers it: the bytes stay where they are, at the same
  // addresses, and the daemon copies into and out of them. The two layers'
  // tensors lie back to back, so they share a page: adopted together.
  Result<DaemonProcess> d = DaemonProcess::Start({});
  ASSERT_TRUE(d.has_value()) << d.error();
  std::unique_ptr<Client> c = MustConnect(*d);
  ASSERT_NE(c, nullptr);
  const Layout layout = SmallLayout();
  constexpr uint32_t kBlocks = 64;
  const uint64_t layer_bytes = 2 * kBlocks * layout.tensor_bytes();  // [2, blocks, tokens, heads, dim]
  auto* raw = static_cast<uint8_t*>(std::malloc(2 * layer_bytes + 4096 + 64));
  ASSERT_NE(raw, nullptr);
  // Layer 0 at raw+64 (not page-aligned); layer 1 right after it, starting
  // in layer 0's last page.
  std::vector<HostRange> layers = {{raw + 64, layer_bytes}, {raw + 64 + layer_bytes, layer_bytes}};
  // Engine block b in canonical order, gathered from / scattered to the
  // layers (each layer: K block b, then V block b).
  const uint64_t tensor = layout.tensor_bytes();
  auto piece = [&](uint32_t layer, uint32_t kv, uint32_t b) {
    return static_cast<uint8_t*>(layers[layer].data) + (uint64_t{kv} * kBlocks + b) * tensor;
  };
  auto read_block = [&](uint32_t b) {
    std::vector<uint8_t> out;
    for (uint32_t l = 0; l < 2; ++l)
      for (uint32_t kv = 0; kv < 2; ++kv) out.insert(out.end(), piece(l, kv, b), piece(l, kv, b) + tensor);
    return out;
  };
  auto write_block = [&](uint32_t b, const std::vector<uint8_t>& bytes) {
    size_t at = 0;
    for (uint32_t l = 0; l < 2; ++l)
      for (uint32_t kv = 0; kv < 2; ++kv, at += tensor) std::memcpy(piece(l, kv, b), bytes.data() + at, tensor);
  };
  std::vector<uint8_t> pattern(layout.block_bytes());
  BlockKey before;
  before.bytes.fill(7);
  FillFromKey(before, pattern);
  write_block(3, pattern);

  Result<AdoptedHostMemory> adopted = AdoptedHostMemory::Adopt(layers);
  ASSERT_TRUE(adopted.has_value()) << adopted.error();
  EXPECT_EQ(adopted->regions().size(), 1u) << "layers that share a page share one memfd";
  EXPECT_EQ(read_block(3), pattern) << "adopting changed the engine's bytes";
  Result<std::vector<Placement>> placements = adopted->Rebase(KvCacheLayout::VllmNhd(layout, kBlocks));
  ASSERT_TRUE(placements.has_value()) << placements.error();
  Result<CacheId> id = c->RegisterKvCache(layout, kBlocks, *placements, adopted->regions());
  ASSERT_TRUE(id.has_value()) << id.error();

  Result<std::vector<BlockKey>> keys = c->ComputeKeys(*id, Prompt(1, 8));
  ASSERT_TRUE(keys.has_value());
  std::vector<std::vector<uint8_t>> stored_bytes;
  for (uint32_t i = 0; i < 8; ++i) {
    FillFromKey((*keys)[i], pattern);
    write_block(i, pattern);
    stored_bytes.push_back(pattern);
  }
  Result<OpResult> stored = c->Store(*id, *keys, Range(0, 8));
  ASSERT_TRUE(stored.has_value()) << stored.error();
  EXPECT_EQ(stored->blocks, 8u);
  for (uint32_t i = 16; i < 24; ++i) write_block(i, std::vector<uint8_t>(layout.block_bytes(), 0));
  Result<OpResult> loaded = c->Load(*id, *keys, Range(16, 8));
  ASSERT_TRUE(loaded.has_value()) << loaded.error();
  ASSERT_EQ(loaded->blocks, 8u);
  for (uint32_t i = 0; i < 8; ++i) EXPECT_EQ(read_block(16 + i), stored_bytes[i]) << "block " << i;

  // Memory a live adoption holds is refused a second time.
  Result<AdoptedHostMemory> again = AdoptedHostMemory::Adopt(std::span(layers).first(1));
  ASSERT_FALSE(again.has_value());
  EXPECT_EQ(again.error().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(again.error().message(), HasSubstr("registered with kvtier already"));
  EXPECT_EQ(adopted->Rebase({Placement{.region = 2}}).error().code(), StatusCode::kInvalidArgument);

  // Released, the pages stay a mapping of the old memfd (as when the engine
  // frees its cache and its allocator hands the pages out again): they may be
  // adopted anew, bytes unchanged, into a cache that works.
  { AdoptedHostMemory released = std::move(*adopted); }
  Result<AdoptedHostMemory> anew = AdoptedHostMemory::Adopt(layers);
  ASSERT_TRUE(anew.has_value()) << anew.error();
  for (uint32_t i = 0; i < 8; ++i) EXPECT_EQ(read_block(16 + i), stored_bytes[i]) << "block " << i;
  placements = anew->Rebase(KvCacheLayout::VllmNhd(layout, kBlocks));
  ASSERT_TRUE(placements.has_value()) << placements.error();
  id = c->RegisterKvCache(layout, kBlocks, *placements, anew->regions());
  ASSERT_TRUE(id.has_value()) << id.error();
  for (uint32_t i = 16; i < 24; ++i) write_block(i, std::vector<uint8_t>(layout.block_bytes(), 0));
  loaded = c->Load(*id, *keys, Range(16, 8));
  ASSERT_TRUE(loaded.has_value()) << loaded.error();
  ASSERT_EQ(loaded->blocks, 8u);
  for (uint32_t i = 0; i < 8; ++i) EXPECT_EQ(read_block(16 + i), stored_bytes[i]) << "block " << i;
  std::free(raw);
}

TEST(HostPathTest, AdoptionCopiesOnlyPagesWithDataAndSharesEveryWindow) {
  // A cache of 130 MiB (three of Adopt's 64 MiB windows) that is mostly
  // zeros with a page of data every MiB, as a fresh engine cache a few
  // blocks into use, and data in its first and last bytes too.
  constexpr uint64_t kBytes = 130ULL << 20;
  constexpr uint64_t kPage = 4096;
  void* mapped =
      ::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mapped, MAP_FAILED);
  auto* data = static_cast<uint8_t*>(mapped);
  std::memset(data, 0, kBytes);  // touched, as torch.zeros leaves it
  uint64_t data_pages = 0;
  for (uint64_t at = 3 * kPage; at < kBytes; at += (1ULL << 20) + kPage, ++data_pages) {
    for (uint64_t i = 0; i < kPage; ++i)
      data[at + i] = static_cast<uint8_t>((at / kPage + i) % 251 + 1);
  }
  data[0] = 7;
  data[kBytes - 1] = 9;
  const std::vector<uint8_t> before(data, data + kBytes);

  const HostRange range{data + 100, kBytes - 200};
  Result<AdoptedHostMemory> adopted = AdoptedHostMemory::Adopt(std::span(&range, 1));
  ASSERT_TRUE(adopted.has_value()) << adopted.error();
  ASSERT_EQ(adopted->regions().size(), 1u);
  const KvRegion region = adopted->regions()[0];
  EXPECT_EQ(region.size_bytes, kBytes);
  // Zero pages were left as holes: the memfd holds the data pages (and the
  // two edge pages), not 130 MiB. (Checked before anything reads a hole: a
  // read through a shared mapping gives it a page.)
  struct stat st {};
  ASSERT_EQ(::fstat(region.memfd, &st), 0);
  EXPECT_LE(static_cast<uint64_t>(st.st_blocks) * 512, (data_pages + 2) * kPage);
  EXPECT_EQ(std::memcmp(data, before.data(), kBytes), 0) << "adopting changed the engine's bytes";
  // The engine's pages are the memfd's, in every window: what one side
  // writes, the other reads, holes included.
  void* view = ::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, region.memfd, 0);
  ASSERT_NE(view, MAP_FAILED);
  auto* daemon_side = static_cast<uint8_t*>(view);
  EXPECT_EQ(std::memcmp(daemon_side, before.data(), kBytes), 0);
  for (const uint64_t at :
       std::array<uint64_t, 4>{1, (64ULL << 20) + 5, (128ULL << 20) + 7, kBytes - 2}) {
    daemon_side[at] = 0x5a;
    EXPECT_EQ(data[at], 0x5a) << "at " << at;
    data[at] = 0xa5;
    EXPECT_EQ(daemon_side[at], 0xa5) << "at " << at;
  }
  ::munmap(view, kBytes);
  ::munmap(mapped, kBytes);
}

TEST(HostPathTest, MemoryThatIsNotTheEnginesOwnIsNotAdopted) {
  EXPECT_EQ(AdoptedHostMemory::Adopt({}).error().code(), StatusCode::kInvalidArgument);
  const HostRange null{nullptr, 4096};
  EXPECT_EQ(AdoptedHostMemory::Adopt(std::span(&null, 1)).error().code(), StatusCode::kInvalidArgument);
  // A file mapping (here, the executable's own code) is refused, unchanged.
  const HostRange code{reinterpret_cast<void*>(&MustConnect), 4096};
  Result<AdoptedHostMemory> r = AdoptedHostMemory::Adopt(std::span(&code, 1));
  ASSERT_FALSE(r.has_value());
  EXPECT_THAT(r.error().message(), HasSubstr("not anonymous private read-write memory"));
}

TEST(HostPathTest, SigtermStopsCleanlyAndRemovesTheSocket) {
  Result<DaemonProcess> d = DaemonProcess::Start({});
  ASSERT_TRUE(d.has_value()) << d.error();
  auto c = MustConnect(*d);
  ASSERT_NE(c, nullptr);
  const int status = d->Stop();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << d->Log();
  EXPECT_NE(::access(d->socket_path().c_str(), F_OK), 0);
  EXPECT_THAT(d->Log(), HasSubstr("stopped"));
}

}  // namespace
}  // namespace kvtier::testing
