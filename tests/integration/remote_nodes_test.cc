// Two kvtierd nodes sharing one Redis Cluster (3 masters, a replica each,
// started by the test): a prompt stored through node A is a remote hit on
// node B, byte for byte, and a load there promotes it into B's host tier;
// prefill on A, decode on B; blocks written as they leave host
// (tiers.remote.write=demote). The nodes share their tenants' secrets (the
// salts directory), as a fleet's nodes must to share blocks. Faults of the
// cluster: remote_faults_test.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include "tests/integration/remote_nodes.h"

namespace kvtier::testing {
namespace {

using ::testing::HasSubstr;

class RemoteNodesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<std::unique_ptr<RedisClusterProcess>> cluster = RedisClusterProcess::Start({});
    ASSERT_TRUE(cluster.has_value()) << cluster.error();
    cluster_ = std::move(*cluster);
    dir_ = std::filesystem::temp_directory_path() / ("kvtier-remote-nodes-" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_ / "a");
    a_ = Node::Start(cluster_->seeds(), (dir_ / "a").string());
    ASSERT_NE(a_, nullptr);
    // Node B shares A's tenant secrets (salt and chain secret).
    std::filesystem::create_directories(dir_ / "b");
    std::filesystem::copy(dir_ / "a" / "salts", dir_ / "b" / "salts", std::filesystem::copy_options::recursive);
    b_ = Node::Start(cluster_->seeds(), (dir_ / "b").string());
    ASSERT_NE(b_, nullptr);
  }
  // A third node, `name`, sharing A's tenant secrets, with `more` overrides.
  std::unique_ptr<Node> StartNode(const std::string& name, std::vector<std::string> more) {
    std::filesystem::create_directories(dir_ / name);
    std::filesystem::copy(dir_ / "a" / "salts", dir_ / name / "salts", std::filesystem::copy_options::recursive);
    return Node::Start(cluster_->seeds(), (dir_ / name).string(), std::move(more));
  }
  // The overrides that give A's tenant ("local", this uid) a host quota.
  static std::string LocalTenantWithHostQuota(const std::string& quota) {
    return "tenants=[{name: local, uid: " + std::to_string(::getuid()) + ", admin: true, quotas: {host: " + quota +
           "}}]";
  }
  void TearDown() override {
    a_.reset();
    b_.reset();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  std::unique_ptr<RedisClusterProcess> cluster_;
  std::filesystem::path dir_;
  std::unique_ptr<Node> a_, b_;
};

TEST_F(RemoteNodesTest, APromptStoredThroughOneNodeIsARemoteHitOnAnotherByteForByte) {
  const std::vector<BlockKey> keys = a_->StoreShared(7, 24);

  // Node B computes the same keys, finds them in the remote tier only...
  Result<std::vector<BlockKey>> b_keys = b_->client->ComputeKeys(b_->id, PseudoTokens(7, 24 * kRemoteBlockTokens));
  ASSERT_TRUE(b_keys.has_value());
  ASSERT_EQ(*b_keys, keys);
  Result<LookupResult> hit = b_->client->Lookup(b_->id, keys);
  ASSERT_TRUE(hit.has_value()) << hit.error();
  EXPECT_EQ(hit->hits, 24u);
  EXPECT_THAT(hit->tiers, ::testing::Each(BlockTier::kRemote));

  // ... loads them byte for byte into its own engine blocks ...
  for (uint32_t i = 0; i < 24; ++i) std::fill(b_->cache->block(100 + i).begin(), b_->cache->block(100 + i).end(), 0);
  Result<OpResult> loaded = b_->client->Load(b_->id, keys, Range(100, 24));
  ASSERT_TRUE(loaded.has_value()) << loaded.error();
  ASSERT_EQ(loaded->blocks, 24u) << b_->daemon.Log();
  for (uint32_t i = 0; i < 24; ++i) EXPECT_TRUE(MatchesKey(keys[i], b_->cache->block(100 + i))) << i;

  // ... and holds them in its host tier from then on.
  hit = b_->client->Lookup(b_->id, keys);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->hits, 24u);
  EXPECT_THAT(hit->tiers, ::testing::Each(BlockTier::kHost));
  EXPECT_EQ(b_->Counter("remote_promotions"), 24u);
  EXPECT_EQ(b_->Counter("remote_hits"), 24u);
  EXPECT_EQ(b_->Counter("remote_corrupt"), 0u);
  // kvtierctl status shows the remote tier.
  const std::string status = CtlStatus(b_->daemon);
  EXPECT_THAT(status, HasSubstr("remote    breaker closed; 24 hit(s)")) << status;
  EXPECT_THAT(status, HasSubstr("24 promoted")) << status;

  // A prompt sharing a prefix: local hits first, then the remote tail.
  const std::vector<BlockKey> more = a_->StoreShared(8, 6);
  std::vector<BlockKey> mixed(keys.begin(), keys.begin() + 4);
  mixed.insert(mixed.end(), more.begin(), more.end());
  hit = b_->client->Lookup(b_->id, mixed);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->hits, 10u);
  EXPECT_EQ(hit->tiers[3], BlockTier::kHost);
  EXPECT_EQ(hit->tiers[4], BlockTier::kRemote);
}

TEST_F(RemoteNodesTest, LosslessBlocksTravelCompressedAndLoadExactlyOnANodeThatAskedForNoCodec) {
  // Node A's engine registers its cache with the lossless codec too.
  Result<CacheId> coded = a_->client->RegisterKvCache(*a_->cache, {.kind = CodecKind::kLossless});
  ASSERT_TRUE(coded.has_value()) << coded.error();
  Result<std::vector<BlockKey>> keys = a_->client->ComputeKeys(*coded, PseudoTokens(21, 16 * kRemoteBlockTokens));
  ASSERT_TRUE(keys.has_value());
  for (uint32_t i = 0; i < 16; ++i) FillKvFromKey((*keys)[i], a_->cache->block(i));
  ASSERT_TRUE(a_->client->Store(*coded, *keys, Range(0, 16)).has_value());
  ASSERT_EQ(a_->CounterWhen("remote_writes", 16), 16u) << a_->daemon.Log();
  EXPECT_EQ(a_->Counter("codec_encoded"), 16u);
  // The values are the codec's output: about a quarter smaller than the blocks.
  EXPECT_LT(a_->Counter("remote_bytes_written"), 16u * RemoteLayout().block_bytes() * 85 / 100);

  // Node B's cache asked for no codec: the same namespace (lossless is
  // bit-exact), so it hits, and its remote tier decodes the values.
  for (uint32_t i = 0; i < 16; ++i) std::fill(b_->cache->block(100 + i).begin(), b_->cache->block(100 + i).end(), 0);
  Result<OpResult> loaded = b_->client->Load(b_->id, *keys, Range(100, 16));
  ASSERT_TRUE(loaded.has_value()) << loaded.error();
  ASSERT_EQ(loaded->blocks, 16u) << b_->daemon.Log();
  for (uint32_t i = 0; i < 16; ++i) EXPECT_TRUE(MatchesKvKey((*keys)[i], b_->cache->block(100 + i))) << i;
  EXPECT_EQ(b_->Counter("remote_corrupt"), 0u);
}

TEST_F(RemoteNodesTest, APrefetchFetchesRemoteBlocksIntoHostAhead) {
  const std::vector<BlockKey> keys = a_->StoreShared(11, 12);
  Result<uint32_t> present = b_->client->Prefetch(b_->id, keys);
  ASSERT_TRUE(present.has_value()) << present.error();
  EXPECT_EQ(*present, 12u);
  Result<LookupResult> hit = b_->client->Lookup(b_->id, keys);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->hits, 12u);
  EXPECT_THAT(hit->tiers, ::testing::Each(BlockTier::kHost)) << "fetched by the prefetch";
  Result<OpResult> loaded = b_->client->Load(b_->id, keys, Range(0, 12));
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->blocks, 12u);
  for (uint32_t i = 0; i < 12; ++i) EXPECT_TRUE(MatchesKey(keys[i], b_->cache->block(i))) << i;
}

TEST_F(RemoteNodesTest, PrefillOnOneNodeDecodeOnAnother) {
  // Disaggregated serving: the prefill node stores the prompt's KV; the
  // decode node loads it all and computes no prefill.
  const std::vector<BlockKey> keys = a_->StoreShared(42, 40);
  Result<std::vector<BlockKey>> decode_keys =
      b_->client->ComputeKeys(b_->id, PseudoTokens(42, 40 * kRemoteBlockTokens));
  ASSERT_TRUE(decode_keys.has_value());
  Result<OpResult> loaded = b_->client->Load(b_->id, *decode_keys, Range(0, 40));
  ASSERT_TRUE(loaded.has_value()) << loaded.error();
  EXPECT_EQ(loaded->blocks, 40u);
  for (uint32_t i = 0; i < 40; ++i) EXPECT_TRUE(MatchesKey(keys[i], b_->cache->block(i))) << i;
}

// tiers.remote.write=demote: a block is put to the remote tier as it leaves
// host memory, not as it is stored (here without a disk tier: host keeps
// below its watermarks by putting its coldest blocks, then dropping them).
TEST_F(RemoteNodesTest, WithWriteOnDemoteBlocksReachTheClusterAsTheyLeaveHost) {
  // 8 MiB of host: 128 blocks of 64 KiB, written back above 90% (115).
  std::unique_ptr<Node> c = StartNode("c", {"tiers.remote.write=demote", "tiers.host.bytes=8MiB"});
  ASSERT_NE(c, nullptr);
  Result<std::vector<BlockKey>> first = c->Store(100, 10);
  ASSERT_TRUE(first.has_value()) << first.error();
  // Stored and still in host: not shared yet.
  EXPECT_EQ(c->Counter("remote_writes"), 0u);
  Result<LookupResult> hit = b_->client->Lookup(b_->id, *first);
  ASSERT_TRUE(hit.has_value()) << hit.error();
  EXPECT_EQ(hit->hits, 0u);

  // 190 more blocks: host passes its high watermark and the coldest (the
  // first prompt's first) are put, then leave.
  // Stores at an engine's pace: each after the write-back caught up (a
  // store larger than the room above the high watermark would drop blocks
  // not yet put: remote_demotions_missed).
  auto host_settled = [&] {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (std::chrono::steady_clock::now() < deadline) {
      Result<DaemonStats> stats = c->client->Stats();
      if (stats && stats->tiers[1].used_bytes <= (8ull << 20) * 9 / 10) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  };
  for (uint64_t seed = 101; seed < 120; ++seed) {
    ASSERT_TRUE(c->Store(seed, 10).has_value());
    ASSERT_TRUE(host_settled()) << c->daemon.Log();
  }
  EXPECT_GE(c->Counter("remote_writes"), 70u) << c->daemon.Log();
  EXPECT_EQ(c->Counter("remote_write_failures"), 0u);
  EXPECT_EQ(c->Counter("remote_demotions_missed"), 0u) << "host always had blocks in the cluster to let go";

  // Node B finds the first prompt in the cluster, byte for byte; node C
  // itself finds it there too (its host let it go).
  uint32_t wrong = 0;
  Result<uint32_t> loaded = b_->Load(*first, 0, &wrong);
  ASSERT_TRUE(loaded.has_value()) << loaded.error();
  EXPECT_EQ(*loaded, 10u);
  EXPECT_EQ(wrong, 0u);
  hit = c->client->Lookup(c->id, *first);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->hits, 10u);
  EXPECT_EQ(hit->tiers[0], BlockTier::kRemote);
  // The newest prompt is still in C's host and not in the cluster.
  Result<std::vector<BlockKey>> newest = c->Keys(119, 10);
  ASSERT_TRUE(newest.has_value());
  hit = c->client->Lookup(c->id, *newest);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->hits, 10u);
  EXPECT_THAT(hit->tiers, ::testing::Each(BlockTier::kHost));
  hit = b_->client->Lookup(b_->id, *newest);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->hits, 0u);
}

TEST_F(RemoteNodesTest, AFetchAtTheTenantsHostQuotaIsServedNotKeptAndDropsNothing) {
  // Node A puts a prompt to the cluster.
  const std::vector<BlockKey> shared = a_->StoreShared(300, 8);
  ASSERT_EQ(shared.size(), 8u);
  // Node C's tenant (A's "local", sharing its salts) has a host quota of 16
  // blocks of 64 KiB, and puts blocks only as they leave host: its own
  // blocks below are in its host alone.
  std::unique_ptr<Node> c = StartNode("c", {"tiers.remote.write=demote", LocalTenantWithHostQuota("1MiB")});
  ASSERT_NE(c, nullptr);
  Result<std::vector<BlockKey>> own = c->Store(301, 16);
  ASSERT_TRUE(own.has_value()) << own.error();
  EXPECT_EQ(c->Counter("remote_writes"), 0u);

  // Loading the shared prompt on C fetches it from the cluster into host:
  // room within the quota may come only from C's blocks the cluster (or a
  // disk) holds, and there are none. So the fetch takes free host room for
  // the load's time, and its blocks do not stay (the cluster holds them).
  // Nothing of C's is lost.
  uint32_t wrong = 0;
  Result<uint32_t> loaded = c->Load(shared, 100, &wrong);
  ASSERT_TRUE(loaded.has_value()) << loaded.error();
  EXPECT_EQ(*loaded, 8u);
  EXPECT_EQ(wrong, 0u);
  EXPECT_EQ(c->Counter("reads_past_quota"), 8u);
  EXPECT_EQ(c->Counter("reads_not_kept"), 8u);
  Result<LookupResult> hit = c->client->Lookup(c->id, shared);
  ASSERT_TRUE(hit.has_value()) << hit.error();
  EXPECT_EQ(hit->hits, 8u);
  EXPECT_THAT(hit->tiers, ::testing::Each(BlockTier::kRemote)) << "fetched blocks stayed in host past the quota";
  hit = c->client->Lookup(c->id, *own);
  ASSERT_TRUE(hit.has_value()) << hit.error();
  EXPECT_EQ(hit->hits, 16u) << "a fetch dropped blocks that existed nowhere else\n" << c->daemon.Log();
  loaded = c->Load(*own, 100, &wrong);
  ASSERT_TRUE(loaded.has_value()) << loaded.error();
  EXPECT_EQ(*loaded, 16u);
  EXPECT_EQ(wrong, 0u);
}

TEST_F(RemoteNodesTest, AFetchAtTheTenantsHostQuotaWritesItsOwnBlocksToDiskToMakeRoom) {
  const std::vector<BlockKey> shared = a_->StoreShared(310, 8);
  ASSERT_EQ(shared.size(), 8u);
  // As above, with a disk tier: the tenant's blocks not held below host
  // are written back to make room (never dropped), and the fetch goes on.
  std::unique_ptr<Node> c =
      StartNode("c", {"tiers.remote.write=demote", "tiers.disk.enabled=true", "tiers.disk.bytes=32MiB",
                      "tiers.disk.region_bytes=1MiB", LocalTenantWithHostQuota("1MiB")});
  ASSERT_NE(c, nullptr);
  Result<std::vector<BlockKey>> own = c->Store(311, 16);
  ASSERT_TRUE(own.has_value()) << own.error();

  uint32_t wrong = 0;
  Result<uint32_t> loaded = c->Load(shared, 100, &wrong);
  ASSERT_TRUE(loaded.has_value()) << loaded.error();
  EXPECT_EQ(*loaded, 8u) << c->daemon.Log();
  EXPECT_EQ(wrong, 0u);
  loaded = c->Load(*own, 100, &wrong);
  ASSERT_TRUE(loaded.has_value()) << loaded.error();
  EXPECT_EQ(*loaded, 16u) << "a fetch dropped blocks that existed nowhere else\n" << c->daemon.Log();
  EXPECT_EQ(wrong, 0u);
  // The writes that made room end after the fetch went on (they counted as
  // leaving): under a slow build they may still be running here.
  EXPECT_GE(c->CounterWhen("disk_demotions", 8), 8u) << c->daemon.Log();
}

}  // namespace
}  // namespace kvtier::testing
