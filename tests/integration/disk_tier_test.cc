// The disk tier end to end: a real kvtierd with segment files and its RocksDB
// index in a temporary directory, and real client processes.
//   - byte-exact round trips through hbm, host and disk, with io_uring and
//     with the thread-pool I/O path;
// (The crash test is disk_crash_test.cc.)
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "tests/integration/disk_helpers.h"
#include "tests/integration/stats_when.h"

namespace kvtier::testing {
namespace {

class DiskRoundTripTest : public ::testing::TestWithParam<std::string> {};

TEST_P(DiskRoundTripTest, ThroughAllThreeTiers) {
  std::vector<std::string> sets = DiskSets(GetParam());
  sets.push_back("tiers.hbm.enabled=true");
  sets.push_back("tiers.hbm.bytes=1MiB");
  Result<DaemonProcess> d = DaemonProcess::Start(sets);
  if (!d && d.error().message().find("io_uring") != std::string::npos) {
    GTEST_SKIP() << "io_uring is not available here: " << d.error();
  }
  ASSERT_TRUE(d.has_value()) << d.error();
  EXPECT_NE(d->Log().find("disk I/O: " + GetParam()), std::string::npos) << d->Log();
  DiskSession s = Open(*d);
  ASSERT_NE(s.client, nullptr);
  std::vector<BlockKey> keys;
  for (uint64_t p = 0; p < 40; ++p) {
    const std::vector<BlockKey> k = s.client->ComputeKeys(s.id, Prompt(p, 16)).value();
    keys.insert(keys.end(), k.begin(), k.end());
  }
  // 640 blocks of 16 KiB (10 MiB): five times the host tier. Each batch is
  // flushed and waited for, at the pace of the disk, so nothing is dropped.
  for (size_t i = 0; i < keys.size(); i += 32) {
    const std::vector<BlockKey> batch(keys.begin() + i, keys.begin() + i + 32);
    ASSERT_EQ(StoreAck(s, batch).size(), batch.size());
    ASSERT_TRUE(SettleOutOfHost(s, std::vector<BlockKey>(keys.begin(), keys.begin() + i + 32))) << d->Log();
  }
  const DaemonStats st = s.client->Stats().value();
  EXPECT_GT(st.Counter("demotions"), 0u);
  EXPECT_GE(st.Counter("disk_demotions"), keys.size() / 2);
  EXPECT_EQ(st.Counter("evictions_host"), 0u);
  int exact = 0;
  for (const BlockKey& k : keys) {
    const int r = LoadOne(s, k);
    ASSERT_NE(r, -1) << "wrong bytes served";
    exact += r;
  }
  EXPECT_EQ(exact, static_cast<int>(keys.size())) << "the disk holds everything the memory tiers let go";
  const DaemonStats after = s.client->Stats().value();
  EXPECT_GT(after.Counter("disk_promotions"), 0u);
  EXPECT_EQ(after.Counter("disk_checksum_failures"), 0u);
  EXPECT_EQ(after.leases, 0u);
}

TEST_P(DiskRoundTripTest, BurstFasterThanTheDiskDropsColdBlocksButNeverServesWrongBytes) {
  Result<DaemonProcess> d = DaemonProcess::Start(DiskSets(GetParam()));
  if (!d && d.error().message().find("io_uring") != std::string::npos) {
    GTEST_SKIP() << "io_uring is not available here: " << d.error();
  }
  ASSERT_TRUE(d.has_value()) << d.error();
  DiskSession s = Open(*d);
  ASSERT_NE(s.client, nullptr);
  std::vector<BlockKey> keys;
  for (uint64_t p = 100; p < 140; ++p) {
    const std::vector<BlockKey> k = s.client->ComputeKeys(s.id, Prompt(p, 16)).value();
    keys.insert(keys.end(), k.begin(), k.end());
  }
  // A store that finds every block leased or in flight to disk is refused
  // (kResourceExhausted, by design); on a loaded machine a few may be. The
  // point here is that nothing wrong is ever served.
  const size_t acked = StoreAck(s, keys).size();
  ASSERT_GE(acked, keys.size() / 2) << "most of the burst should be taken";
  int exact = 0;
  for (const BlockKey& k : keys) {
    const int r = LoadOne(s, k);
    ASSERT_NE(r, -1) << "wrong bytes served";
    exact += r;
  }
  // Demotions finish in the background: wait for the first (at most 10 s).
  DaemonStats st = s.client->Stats().value();
  for (int i = 0; i < 1000 && st.Counter("disk_demotions") == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    st = s.client->Stats().value();
  }
  EXPECT_GT(st.Counter("disk_demotions"), 0u);
  EXPECT_GT(exact, 0);
  EXPECT_EQ(st.Counter("disk_checksum_failures"), 0u);
}

TEST(DiskRestartTest, CleanShutdownWritesHostBlocksAndTheRestartIsWarm) {
  std::vector<std::string> sets = DiskSets("auto", "64MiB");  // everything fits in host
  Result<DaemonProcess> d = DaemonProcess::Start(sets);
  ASSERT_TRUE(d.has_value()) << d.error();
  std::vector<BlockKey> keys;
  {
    DiskSession s = Open(*d);
    ASSERT_NE(s.client, nullptr);
    keys = s.client->ComputeKeys(s.id, Prompt(77, 48)).value();
    ASSERT_EQ(StoreAck(s, keys).size(), keys.size());
    EXPECT_EQ(s.client->Stats().value().Counter("disk_demotions"), 0u) << "nothing was written yet";
  }
  const int status = d->Stop();  // SIGTERM
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << d->Log();
  ASSERT_TRUE(d->Restart().ok()) << d->Log();
  DiskSession s = Open(*d);
  ASSERT_NE(s.client, nullptr);
  for (const BlockKey& k : keys) ASSERT_EQ(LoadOne(s, k), 1) << "a block stored before a clean stop misses";
}

TEST(DiskRegistrationTest, ABlockLargerThanADiskRegionIsRefusedWithTheKey) {
  // 1 MiB regions; a layout of 2 MiB blocks could never be written to disk.
  Result<DaemonProcess> d = DaemonProcess::Start(DiskSets("auto"));
  ASSERT_TRUE(d.has_value()) << d.error();
  Result<std::unique_ptr<Client>> c =
      Client::Connect({.socket_path = d->socket_path(), .client_name = "big"});
  ASSERT_TRUE(c.has_value()) << c.error();
  const Layout big = Layout::Create(LayoutSpec{.model_id = "kvtier/big-blocks",
                                               .num_layers = 32,
                                               .kv_kind = KvKind::kSeparateKv,
                                               .num_kv_heads = 8,
                                               .head_dim = 128,
                                               .dtype = DType::kBf16,
                                               .block_tokens = 16,
                                               .tp_rank = 0,
                                               .tp_size = 1,
                                               .scale_bytes_per_layer = 0})
                         .value();
  ASSERT_EQ(big.block_bytes(), 2u << 20);
  Result<ShmKvCache> cache = ShmKvCache::Create(big, 2);
  ASSERT_TRUE(cache.has_value()) << cache.error();
  Result<CacheId> id = (*c)->RegisterKvCache(*cache);
  ASSERT_FALSE(id.has_value());
  EXPECT_EQ(id.error().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(id.error().message().find("tiers.disk.region_bytes"), std::string::npos) << id.error();
  // The session goes on: a layout that fits registers.
  Result<ShmKvCache> small = ShmKvCache::Create(SmallLayout(), 4);
  ASSERT_TRUE(small.has_value());
  EXPECT_TRUE((*c)->RegisterKvCache(*small).has_value());
}

TEST(DiskRestartTest, StopWithEveryTierFullWritesHostBlocksAndTheRestartIsWarm) {
  // An 8 MiB host over a 16 MiB disk, both filled many times over: the stop
  // writes what host holds onto a full disk (reclaiming as it goes) while a
  // verify runs, and must still end promptly.
  std::vector<std::string> sets = DiskSets("auto", "8MiB");
  sets.insert(sets.end(),
              {"tiers.hbm.enabled=false", "tiers.disk.bytes=16MiB",
               "tiers.disk.stop_flush_seconds=8", "policy.watermarks.host={high: 0.9, low: 0.8}"});
  Result<DaemonProcess> d = DaemonProcess::Start(sets);
  ASSERT_TRUE(d.has_value()) << d.error();
  std::vector<BlockKey> keys;
  std::vector<BlockKey> in_host;  // at the stop: what the stop must write
  {
    DiskSession s = Open(*d);
    ASSERT_NE(s.client, nullptr);
    // A prompt at a time, at the pace of the disk: on a busy machine a
    // store that outruns write-back drops dirty host blocks instead, and
    // the disk would not wrap.
    for (uint64_t p = 0; p < 100; ++p) {
      const std::vector<BlockKey> k = s.client->ComputeKeys(s.id, Prompt(500 + p, 32)).value();
      keys.insert(keys.end(), k.begin(), k.end());
      StoreAck(s, k);
      StatsWhen(*s.client, [](const DaemonStats& st) { return st.Counter("disk_writes_pending") == 0; });
    }
    const DaemonStats st = s.client->Stats().value();
    ASSERT_GT(st.Counter("disk_regions_reclaimed"), 16u) << "the disk did not wrap";
    // Host holds at most 512 blocks, all among the newest: look there only.
    // (A lookup is a hit, and a reclaim carries forward what was hit since
    // it was written: heating the whole disk would make the flush compete
    // with carried blocks for a disk smaller than both.)
    for (size_t i = keys.size() - 512; i < keys.size(); ++i) {
      Result<LookupResult> l = s.client->Lookup(s.id, std::span(&keys[i], 1));
      if (l && l->hits == 1 && l->tiers[0] == BlockTier::kHost) in_host.push_back(keys[i]);
    }
    ASSERT_GT(in_host.size(), 300u) << "the host tier is not full";
    ASSERT_TRUE(s.client->VerifyDisk(/*start=*/true).has_value());
  }
  const auto t0 = std::chrono::steady_clock::now();
  const int status = d->Stop();  // SIGTERM
  const double stop_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << d->Log();
  std::printf("stop with every tier full: %.2f s\n", stop_s);
  // A liveness bound, far above the figure (tiers.disk.stop_flush_seconds
  // caps the flush); a stop that hangs fails here rather than at ctest's
  // timeout.
  EXPECT_LT(stop_s, 60.0) << d->Log();
  ASSERT_TRUE(d->Restart().ok()) << d->Log();
  DiskSession s = Open(*d);
  ASSERT_NE(s.client, nullptr);
  // What host held at the stop was written then, so it is warm now.
  size_t hits = 0;
  for (const BlockKey& k : in_host) {
    const int r = LoadOne(s, k);
    ASSERT_NE(r, -1) << "wrong bytes served after the restart";
    hits += static_cast<size_t>(r);
  }
  EXPECT_EQ(hits, in_host.size()) << "blocks in host at the stop were not written";
  std::printf("stop wrote %zu host blocks onto a full disk; all hit after the restart\n",
              in_host.size());
  EXPECT_EQ(s.client->Stats().value().Counter("disk_checksum_failures"), 0u);
}

INSTANTIATE_TEST_SUITE_P(Engines, DiskRoundTripTest, ::testing::Values("io_uring", "threadpool"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace kvtier::testing
