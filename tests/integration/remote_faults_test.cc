// Faults of the shared remote tier, through two real kvtierd nodes on a Redis
// Cluster the test starts: a master killed mid-traffic, a live reshard, the
// whole cluster down and back, values evicted by maxmemory, values corrupted
// or replaced by a writer of the cluster's own, and an unreachable seed at
// start-up. In none may a node serve a wrong byte, and each ends with the
// nodes serving their local tiers (and the cluster again where it is back).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <mutex>
#include <set>
#include <thread>

#include <hiredis/hiredis.h>

#include "tests/integration/remote_nodes.h"
#include "tiers/remote/redis_cluster.h"
#include "tiers/remote/redis_connection.h"
#include "tiers/remote/remote_value.h"

namespace kvtier::testing {
namespace {

constexpr uint32_t kPromptBlocks = 8;

// Prompts stored through node A and loaded through node B, each with clients
// of its own, until stopped: counts what B loaded and any wrong byte.
class Traffic {
 public:
  Traffic(const std::string& a_socket, const std::string& b_socket, uint64_t first_seed)
      : thread_([this, a_socket, b_socket, first_seed] { Run(a_socket, b_socket, first_seed); }) {}
  ~Traffic() { Stop(); }

  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  // Until B has loaded `n` more blocks from the cluster (or 20 s).
  bool WaitLoaded(uint64_t n) const {
    const uint64_t target = loaded_ + n;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (loaded_ < target && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return loaded_ >= target;
  }

  uint64_t loaded() const { return loaded_; }
  uint64_t wrong() const { return wrong_; }
  uint64_t errors() const { return errors_; }
  // The first errors seen (for a failure's message).
  std::string first_errors() const {
    std::lock_guard<std::mutex> lock(mu_);
    return first_errors_;
  }

 private:
  void Run(const std::string& a_socket, const std::string& b_socket, uint64_t seed) {
    Engine a, b;
    if (Status c = a.Connect(a_socket); !c.ok()) return Count(c.ToString());
    if (Status c = b.Connect(b_socket); !c.ok()) return Count(c.ToString());
    for (; !stop_; ++seed) {
      Result<std::vector<BlockKey>> keys = a.Store(seed, kPromptBlocks);
      if (!keys) {
        Count("store: " + keys.error().ToString());
        continue;
      }
      // This prompt (its put may still be in flight) and an older one.
      for (uint64_t s : {seed, seed > 4 ? seed - 4 : seed}) {
        Result<std::vector<BlockKey>> k = b.Keys(s, kPromptBlocks);
        uint32_t wrong = 0;
        Result<uint32_t> n = k ? b.Load(*k, 0, &wrong) : Result<uint32_t>(Err(k.error()));
        if (!n) {
          Count("load: " + n.error().ToString());
          continue;
        }
        loaded_ += *n;
        wrong_ += wrong;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

  void Count(const std::string& error) {
    ++errors_;
    std::lock_guard<std::mutex> lock(mu_);
    if (errors_ <= 3) first_errors_ += error + "\n";
  }

  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> loaded_{0}, wrong_{0}, errors_{0};
  mutable std::mutex mu_;
  std::string first_errors_;
  std::thread thread_;
};

// The keys this deployment has in the cluster (SCAN on every master).
std::set<std::string> RemoteKeys(const RedisClusterProcess& cluster) {
  std::set<std::string> keys;
  Result<std::vector<NodeAddress>> masters = cluster.Masters();
  EXPECT_TRUE(masters.has_value()) << masters.error();
  for (const NodeAddress& m : masters.value_or(std::vector<NodeAddress>{})) {
    auto c = RedisConnection::Connect(RedisConnectionOptions{.address = m});
    EXPECT_TRUE(c.has_value()) << c.error();
    if (!c) continue;
    std::string cursor = "0";
    do {
      const std::string_view argv[] = {"SCAN", cursor, "MATCH", "test-fleet/*", "COUNT", "1000"};
      Result<RedisReply> r = (*c)->Command(argv);
      EXPECT_TRUE(r.has_value() && (*r)->type == REDIS_REPLY_ARRAY && (*r)->elements == 2);
      if (!r || (*r)->type != REDIS_REPLY_ARRAY || (*r)->elements != 2) break;
      cursor.assign((*r)->element[0]->str, (*r)->element[0]->len);
      const redisReply* found = (*r)->element[1];
      for (size_t i = 0; i < found->elements; ++i) keys.emplace(found->element[i]->str, found->element[i]->len);
    } while (cursor != "0");
  }
  return keys;
}

// A client of the cluster of the test's own (a writer that is not kvtier).
std::unique_ptr<RedisCluster> Writer(const RedisClusterProcess& cluster) {
  Result<std::unique_ptr<RedisCluster>> c = RedisCluster::Connect(RedisClusterOptions{.seeds = cluster.seeds()});
  EXPECT_TRUE(c.has_value()) << c.error();
  return c ? std::move(*c) : nullptr;
}

std::string NodeId(const NodeAddress& node) {
  auto c = RedisConnection::Connect(RedisConnectionOptions{.address = node});
  if (!c) return "";
  const std::string_view argv[] = {"CLUSTER", "MYID"};
  Result<RedisReply> r = (*c)->Command(argv);
  return r && (*r)->type == REDIS_REPLY_STRING ? std::string((*r)->str, (*r)->len) : "";
}

class RemoteFaultsTest : public ::testing::Test {
 protected:
  // A cluster with `options`, node A, and node B with A's tenant secrets.
  void StartAll(const RedisClusterProcess::Options& options) {
    Result<std::unique_ptr<RedisClusterProcess>> cluster = RedisClusterProcess::Start(options);
    ASSERT_TRUE(cluster.has_value()) << cluster.error();
    cluster_ = std::move(*cluster);
    dir_ = std::filesystem::temp_directory_path() / ("kvtier-remote-faults-" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_ / "a");
    // A short cooldown: the breaker probes again soon once the cluster is back.
    a_ = Node::Start(cluster_->seeds(), (dir_ / "a").string(), {"tiers.remote.breaker_cooldown_ms=300"});
    ASSERT_NE(a_, nullptr);
    b_ = StartSharing("b", cluster_->seeds());
    ASSERT_NE(b_, nullptr);
  }
  // Another node with A's tenant secrets, on `seeds`, with `more` settings.
  std::unique_ptr<Node> StartSharing(const std::string& name, const std::vector<NodeAddress>& seeds,
                                     std::vector<std::string> more = {}) {
    std::filesystem::create_directories(dir_ / name);
    std::filesystem::copy(dir_ / "a" / "salts", dir_ / name / "salts", std::filesystem::copy_options::recursive);
    more.insert(more.begin(), "tiers.remote.breaker_cooldown_ms=300");
    return Node::Start(seeds, (dir_ / name).string(), std::move(more));
  }
  // Until B loads `keys_on_b` whole, byte for byte, from the cluster: each
  // try, `driver` stores a fresh one-block prompt first (its loop runs its
  // put retries and write-back after other work).
  void ExpectBLoadsOnceDriven(Node& driver, const std::vector<BlockKey>& keys_on_b, uint64_t seed) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    uint32_t loaded = 0, wrong = 0;
    for (; loaded < keys_on_b.size() && std::chrono::steady_clock::now() < deadline; ++seed) {
      ASSERT_TRUE(driver.Store(seed, 1).has_value());
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      Result<uint32_t> n = b_->Load(keys_on_b, 0, &wrong);
      ASSERT_TRUE(n.has_value()) << n.error();
      loaded = *n;
    }
    EXPECT_EQ(loaded, keys_on_b.size()) << driver.daemon.Log();
    EXPECT_EQ(wrong, 0u);
  }
  void TearDown() override {
    a_.reset();
    b_.reset();
    std::error_code ec;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
  }

  // Node A serves what its host tier holds (`keys`, a prompt it stored),
  // byte for byte.
  void ExpectLocalServing(const std::vector<BlockKey>& keys) {
    Result<LookupResult> hit = a_->client->Lookup(a_->id, keys);
    ASSERT_TRUE(hit.has_value()) << hit.error();
    EXPECT_EQ(hit->hits, keys.size());
    EXPECT_THAT(hit->tiers, ::testing::Each(BlockTier::kHost));
    uint32_t wrong = 0;
    Result<uint32_t> n = a_->Load(keys, 128, &wrong);
    ASSERT_TRUE(n.has_value()) << n.error();
    EXPECT_EQ(*n, keys.size());
    EXPECT_EQ(wrong, 0u);
  }

  // A prompt stored through A now, served from A's host tier.
  void ExpectStoresServedLocally(uint64_t seed) {
    Result<std::vector<BlockKey>> keys = a_->Store(seed, kPromptBlocks);
    ASSERT_TRUE(keys.has_value()) << keys.error();
    ExpectLocalServing(*keys);
  }

  // Until a prompt stored through A now is a whole remote hit on B, loaded
  // byte for byte (new prompts each try: a put is tried once); B then
  // serves it from its own host tier.
  void ExpectSharedAgain(uint64_t seed) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    uint32_t loaded = 0, wrong = 0;
    for (; loaded < kPromptBlocks && std::chrono::steady_clock::now() < deadline; ++seed) {
      Result<std::vector<BlockKey>> keys = a_->Store(seed, kPromptBlocks);
      ASSERT_TRUE(keys.has_value()) << keys.error();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      Result<uint32_t> n = b_->Load(*keys, 0, &wrong);
      ASSERT_TRUE(n.has_value()) << n.error();
      loaded = *n;
    }
    EXPECT_EQ(loaded, kPromptBlocks) << a_->daemon.Log() << b_->daemon.Log();
    EXPECT_EQ(wrong, 0u);
    Result<std::vector<BlockKey>> keys = b_->Keys(seed - 1, kPromptBlocks);
    ASSERT_TRUE(keys.has_value());
    Result<LookupResult> hit = b_->client->Lookup(b_->id, *keys);
    ASSERT_TRUE(hit.has_value());
    EXPECT_THAT(hit->tiers, ::testing::Each(BlockTier::kHost));
  }

  std::unique_ptr<RedisClusterProcess> cluster_;
  std::filesystem::path dir_;
  std::unique_ptr<Node> a_, b_;
};

TEST_F(RemoteFaultsTest, AMasterKilledMidTrafficFailsOverWithoutAWrongByte) {
  StartAll({.maxmemory = "512mb"});
  Traffic traffic(a_->daemon.socket_path(), b_->daemon.socket_path(), 1000);
  ASSERT_TRUE(traffic.WaitLoaded(64));
  Result<std::vector<NodeAddress>> masters = cluster_->Masters();
  ASSERT_TRUE(masters.has_value()) << masters.error();
  for (size_t i = 0; i < cluster_->size(); ++i) {
    if (cluster_->node(i) == masters->front()) cluster_->Kill(i);
  }
  // Its replica takes over (node timeout 1.5 s); traffic goes on throughout.
  ASSERT_TRUE(cluster_->WaitHealthy().ok());
  EXPECT_TRUE(traffic.WaitLoaded(64));
  traffic.Stop();
  EXPECT_EQ(traffic.wrong(), 0u);
  EXPECT_EQ(traffic.errors(), 0u) << "misses, never errors; the first:\n" << traffic.first_errors();
  ExpectStoresServedLocally(4000);
  ExpectSharedAgain(5000);
  EXPECT_GE(b_->Counter("remote_topology_refreshes"), 2u);
  EXPECT_EQ(b_->Counter("remote_corrupt"), 0u);
}

TEST_F(RemoteFaultsTest, ALiveReshardDuringTrafficServesNoWrongByte) {
  StartAll({.masters = 3, .replicas = 0, .maxmemory = "512mb"});
  const std::vector<BlockKey> mine = a_->StoreShared(1, kPromptBlocks);
  Traffic traffic(a_->daemon.socket_path(), b_->daemon.socket_path(), 1000);
  ASSERT_TRUE(traffic.WaitLoaded(64));
  Result<std::vector<NodeAddress>> masters = cluster_->Masters();
  ASSERT_TRUE(masters.has_value());
  const std::string from = NodeId((*masters)[0]), to = NodeId((*masters)[1]);
  ASSERT_FALSE(from.empty() || to.empty());
  // A third of the slots move while blocks are stored and loaded.
  ASSERT_TRUE(cluster_->Cli("--cluster reshard " + cluster_->node(0).ToString() + " --cluster-from " + from +
                            " --cluster-to " + to + " --cluster-slots 5000 --cluster-yes")
                  .ok());
  EXPECT_TRUE(traffic.WaitLoaded(64));
  traffic.Stop();
  EXPECT_EQ(traffic.wrong(), 0u);
  EXPECT_EQ(traffic.errors(), 0u) << traffic.first_errors();
  EXPECT_GE(a_->Counter("remote_redirects") + b_->Counter("remote_redirects"), 1u);
  ExpectStoresServedLocally(4000);
  ExpectSharedAgain(5000);
  // What was stored before the reshard moved with its slots (B has not
  // loaded it before).
  uint32_t wrong = 0;
  Result<uint32_t> n = b_->Load(mine, 0, &wrong);
  ASSERT_TRUE(n.has_value());
  EXPECT_EQ(*n, kPromptBlocks);
  EXPECT_EQ(wrong, 0u);
}

TEST_F(RemoteFaultsTest, TheWholeClusterDownThenBack) {
  StartAll({.masters = 3, .replicas = 0});
  const std::vector<BlockKey> keys = a_->StoreShared(9, kPromptBlocks);
  for (size_t i = 0; i < cluster_->size(); ++i) cluster_->Kill(i);
  ExpectLocalServing(keys);
  // Node B: misses, never an error, and quick once the breaker is open.
  for (int i = 0; i < 5; ++i) {
    const auto start = std::chrono::steady_clock::now();
    Result<LookupResult> miss = b_->client->Lookup(b_->id, keys);
    ASSERT_TRUE(miss.has_value()) << miss.error();
    EXPECT_EQ(miss->hits, 0u);
    if (i >= 4) {
      EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(200));
    }
    uint32_t wrong = 0;
    Result<uint32_t> none = b_->Load(keys, 0, &wrong);
    ASSERT_TRUE(none.has_value()) << none.error();
    EXPECT_EQ(*none, 0u);
  }
  EXPECT_EQ(b_->Counter("remote_breaker_open"), 1u);
  // Stores through A go on (locally) while the cluster is down.
  const uint64_t failures = a_->Counter("remote_write_failures");
  Result<std::vector<BlockKey>> during = a_->Store(10, kPromptBlocks);
  ASSERT_TRUE(during.has_value());
  ExpectLocalServing(*during);

  // Back (empty: persistence is off): after the cooldown a probe closes the
  // breaker and prompts are shared again.
  for (size_t i = 0; i < cluster_->size(); ++i) ASSERT_TRUE(cluster_->Restart(i).ok());
  ASSERT_TRUE(cluster_->WaitHealthy().ok());
  ExpectSharedAgain(5000);
  EXPECT_EQ(b_->Counter("remote_breaker_open"), 0u);
  EXPECT_GT(a_->CounterWhen("remote_write_failures", failures + 1), failures);
  ExpectLocalServing(keys);
  // The prompt A stored while the cluster was down is put once it is back
  // (a put that did not reach the cluster is tried again after a pause), so
  // B finds it too. Before, a failed put counted as done: never tried again.
  Result<std::vector<BlockKey>> during_on_b = b_->Keys(10, kPromptBlocks);
  ASSERT_TRUE(during_on_b.has_value());
  ExpectBLoadsOnceDriven(*a_, *during_on_b, 6000);
}

// tiers.remote.write=demote without a disk tier: host is written back to
// the cluster only. While the cluster is down, write-back waits and host
// drops nothing that exists nowhere else; it fills, and only a store that
// needs room evicts (as a full cache does). Before, a put that failed
// marked its block as in the cluster, and write-back then dropped it.
TEST_F(RemoteFaultsTest, WriteBackWithoutADiskDropsNothingWhileTheClusterIsDown) {
  StartAll({.masters = 3, .replicas = 0});
  // 8 MiB of host: 128 blocks of 64 KiB, written back above 50% (64 blocks).
  std::unique_ptr<Node> c =
      StartSharing("c", cluster_->seeds(),
                   {"tiers.remote.write=demote", "tiers.host.bytes=8MiB", "policy.watermarks.host={high: 0.5, low: 0.3}"});
  ASSERT_NE(c, nullptr);
  for (size_t i = 0; i < cluster_->size(); ++i) cluster_->Kill(i);
  // 96 blocks: past the high watermark, with room left.
  std::vector<std::vector<BlockKey>> prompts;
  for (uint64_t seed = 300; seed < 312; ++seed) {
    Result<std::vector<BlockKey>> keys = c->Store(seed, kPromptBlocks);
    ASSERT_TRUE(keys.has_value()) << keys.error();
    prompts.push_back(*keys);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // write-back's tries run meanwhile
  }
  std::this_thread::sleep_for(std::chrono::seconds(1));  // for write-back to drop something, were it to
  EXPECT_GT(c->CounterWhen("remote_write_failures", 1), 0u) << c->daemon.Log();
  EXPECT_EQ(c->Counter("evictions_host"), 0u) << c->daemon.Log();
  for (const std::vector<BlockKey>& keys : prompts) {
    Result<LookupResult> hit = c->client->Lookup(c->id, keys);
    ASSERT_TRUE(hit.has_value()) << hit.error();
    EXPECT_EQ(hit->hits, keys.size()) << c->daemon.Log();
  }

  // Back: write-back puts the coldest and lets them go, and B finds the
  // first prompt in the cluster.
  for (size_t i = 0; i < cluster_->size(); ++i) ASSERT_TRUE(cluster_->Restart(i).ok());
  ASSERT_TRUE(cluster_->WaitHealthy().ok());
  Result<std::vector<BlockKey>> first_on_b = b_->Keys(300, kPromptBlocks);
  ASSERT_TRUE(first_on_b.has_value());
  ExpectBLoadsOnceDriven(*c, *first_on_b, 7000);
}

// A cluster that takes each write slowly (CLIENT PAUSE WRITE: every SET waits
// 10 s) holds the puts in flight, each leasing its host block until its
// deadline. They may hold a quarter of host at most: write-through puts
// beyond it wait in the retry line, unleased, and stores go on evicting.
// Before, every block stored was leased by its put, and once host was all
// leased a store failed ("no block of this size can be evicted now").
TEST_F(RemoteFaultsTest, PutsHeldByASlowClusterNeverTakeTheRoomStoresNeed) {
  StartAll({.masters = 3, .replicas = 0});
  // 8 MiB of host: 128 blocks of 64 KiB.
  std::unique_ptr<Node> c =
      StartSharing("c", cluster_->seeds(), {"tiers.host.bytes=8MiB", "tiers.remote.timeout_ms=15000"});
  ASSERT_NE(c, nullptr);
  for (size_t i = 0; i < cluster_->size(); ++i) {
    ASSERT_TRUE(cluster_->Cli("-h 127.0.0.1 -p " + std::to_string(cluster_->node(i).port) +
                              " CLIENT PAUSE 10000 WRITE")
                    .ok());
  }
  // 384 blocks: three times host, in far less than the pause.
  for (uint64_t seed = 600; seed < 648; ++seed) {
    Result<std::vector<BlockKey>> keys = c->Store(seed, kPromptBlocks);
    ASSERT_TRUE(keys.has_value()) << "prompt " << seed << ": " << keys.error() << "\n" << c->daemon.Log();
  }
  EXPECT_EQ(c->Counter("remote_writes"), 0u) << "the pause held every put";
  EXPECT_EQ(c->Counter("store_rejected"), 0u);
  // The last prompt is served from host, and is put once the pause ends.
  Result<std::vector<BlockKey>> last = c->Keys(647, kPromptBlocks);
  ASSERT_TRUE(last.has_value());
  uint32_t wrong = 0;
  Result<uint32_t> n = c->Load(*last, 0, &wrong);
  ASSERT_TRUE(n.has_value()) << n.error();
  EXPECT_EQ(*n, kPromptBlocks);
  EXPECT_EQ(wrong, 0u);
  for (size_t i = 0; i < cluster_->size(); ++i) {
    ASSERT_TRUE(cluster_->Cli("-h 127.0.0.1 -p " + std::to_string(cluster_->node(i).port) + " CLIENT UNPAUSE").ok());
  }
  Result<std::vector<BlockKey>> last_on_b = b_->Keys(647, kPromptBlocks);
  ASSERT_TRUE(last_on_b.has_value());
  ExpectBLoadsOnceDriven(*c, *last_on_b, 7000);
}

// A remote fetch takes host room only from free slots and blocks held
// below host: on a node whose host is full of blocks that exist nowhere else
// (write: demote, not written back yet), a fetch is a miss and drops none of
// them. Before, it evicted the coldest of them for good.
TEST_F(RemoteFaultsTest, ARemoteFetchNeverDropsAHostBlockThatExistsNowhereElse) {
  StartAll({.masters = 3, .replicas = 0});
  const std::vector<BlockKey> shared = a_->StoreShared(400, kPromptBlocks);
  // 8 MiB of host: 128 blocks of 64 KiB, never written back (above a high
  // watermark of 1.0: never), so none of them is in the cluster.
  std::unique_ptr<Node> c =
      StartSharing("c", cluster_->seeds(),
                   {"tiers.remote.write=demote", "tiers.host.bytes=8MiB", "policy.watermarks.host={high: 1.0, low: 0.99}"});
  ASSERT_NE(c, nullptr);
  std::vector<std::vector<BlockKey>> prompts;
  for (uint64_t seed = 500; seed < 517; ++seed) {  // 17 x 8 blocks: host full
    Result<std::vector<BlockKey>> keys = c->Store(seed, kPromptBlocks);
    ASSERT_TRUE(keys.has_value()) << keys.error();
    prompts.push_back(*keys);
  }
  ASSERT_EQ(c->Counter("remote_writes"), 0u) << "nothing written back";
  // What host holds before the fetch stays.
  std::vector<std::vector<BlockKey>> held;
  for (const std::vector<BlockKey>& keys : prompts) {
    Result<LookupResult> hit = c->client->Lookup(c->id, keys);
    ASSERT_TRUE(hit.has_value()) << hit.error();
    if (hit->hits == keys.size()) held.push_back(keys);
  }
  ASSERT_GE(held.size(), 14u);
  const uint64_t evictions = c->Counter("evictions_host");
  uint32_t wrong = 0;
  Result<uint32_t> fetched = c->Load(shared, 200, &wrong);
  ASSERT_TRUE(fetched.has_value()) << fetched.error();
  EXPECT_EQ(*fetched, 0u) << "no clean room in host: a miss";
  EXPECT_EQ(wrong, 0u);
  EXPECT_EQ(c->Counter("evictions_host"), evictions) << c->daemon.Log();
  for (const std::vector<BlockKey>& keys : held) {
    Result<LookupResult> hit = c->client->Lookup(c->id, keys);
    ASSERT_TRUE(hit.has_value()) << hit.error();
    EXPECT_EQ(hit->hits, keys.size());
  }
}

TEST_F(RemoteFaultsTest, ValuesEvictedByMaxmemoryAreMissesNeverWrongBytes) {
  // 3 x 4 MiB of cluster (less Redis' own) for 20 MiB of blocks:
  // allkeys-lru evicts most.
  StartAll({.masters = 3, .replicas = 0, .maxmemory = "4mb"});
  std::vector<std::vector<BlockKey>> prompts;
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    Result<std::vector<BlockKey>> keys = a_->Store(seed, kPromptBlocks);
    ASSERT_TRUE(keys.has_value()) << keys.error();
    prompts.push_back(*keys);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (a_->Counter("remote_writes") + a_->Counter("remote_writes_refused") < 40 * kPromptBlocks &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  // Each block on its own (a prompt's load stops at its first miss).
  uint64_t loaded = 0;
  for (const std::vector<BlockKey>& keys : prompts) {
    for (const BlockKey& key : keys) {
      uint32_t wrong = 0;
      Result<uint32_t> n = b_->Load({key}, 0, &wrong);
      ASSERT_TRUE(n.has_value()) << n.error();
      EXPECT_EQ(wrong, 0u);
      loaded += *n;
    }
  }
  EXPECT_GT(loaded, 0u);
  EXPECT_LT(loaded, 40u * kPromptBlocks / 2) << "most were evicted";
  EXPECT_EQ(b_->Counter("remote_corrupt"), 0u);
  for (const std::vector<BlockKey>& keys : prompts) ExpectLocalServing(keys);
}

TEST_F(RemoteFaultsTest, CorruptedOrReplacedValuesAreMissesAndDeleted) {
  StartAll({.masters = 3, .replicas = 0});
  // One block each, so each one's Redis key is the one that appears.
  const std::vector<BlockKey> p = a_->StoreShared(1, 1);
  const std::set<std::string> after_p = RemoteKeys(*cluster_);
  ASSERT_EQ(after_p.size(), 1u);
  const std::string key_p = *after_p.begin();
  const std::vector<BlockKey> q = a_->StoreShared(2, 1);
  std::set<std::string> after_q = RemoteKeys(*cluster_);
  ASSERT_EQ(after_q.size(), 2u);
  after_q.erase(key_p);
  const std::string key_q = *after_q.begin();
  const std::vector<BlockKey> r = a_->StoreShared(3, 4);

  // P: a payload byte flipped; Q: P's (intact) value written under its key.
  std::unique_ptr<RedisCluster> writer = Writer(*cluster_);
  ASSERT_NE(writer, nullptr);
  const RedisCommand get[] = {{{"GET", key_p}}};
  std::vector<Result<RedisReply>> got = writer->Run(get);
  ASSERT_TRUE(got[0].has_value() && (*got[0])->type == REDIS_REPLY_STRING);
  const std::string value_p((*got[0])->str, (*got[0])->len);
  std::string flipped = value_p;
  flipped[RemoteValueHeader::kBytes + 1000] ^= 0x40;
  const RedisCommand set[] = {{{"SET", key_p, flipped}}, {{"SET", key_q, value_p}}};
  for (const Result<RedisReply>& s : writer->Run(set)) ASSERT_TRUE(s.has_value());

  // B: both are misses (the lookup's EXISTS cannot tell, the load checks).
  for (const std::vector<BlockKey>* keys : {&p, &q}) {
    uint32_t wrong = 0;
    Result<uint32_t> n = b_->Load(*keys, 0, &wrong);
    ASSERT_TRUE(n.has_value()) << n.error();
    EXPECT_EQ(*n, 0u);
    EXPECT_EQ(wrong, 0u);
  }
  EXPECT_EQ(b_->Counter("remote_corrupt"), 2u);
  const std::set<std::string> left = RemoteKeys(*cluster_);
  EXPECT_EQ(left.count(key_p) + left.count(key_q), 0u) << "deleted";
  EXPECT_EQ(left.size(), 4u);
  Result<LookupResult> hit = b_->client->Lookup(b_->id, p);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->hits, 0u);
  // The others are served; A still has its own.
  uint32_t wrong = 0;
  Result<uint32_t> n = b_->Load(r, 0, &wrong);
  ASSERT_TRUE(n.has_value());
  EXPECT_EQ(*n, 4u);
  EXPECT_EQ(wrong, 0u);
  ExpectLocalServing(p);
  ExpectLocalServing(q);
}

TEST_F(RemoteFaultsTest, AnUnreachableSeedAtStartUp) {
  StartAll({.masters = 3, .replicas = 0});
  const std::vector<BlockKey> keys = a_->StoreShared(1, kPromptBlocks);
  // Node C lists a dead seed first: it reads the topology from the next.
  std::vector<NodeAddress> seeds = cluster_->seeds();
  seeds.insert(seeds.begin(), NodeAddress{"127.0.0.1", 1});
  std::unique_ptr<Node> c = StartSharing("c", seeds);
  ASSERT_NE(c, nullptr);
  uint32_t wrong = 0;
  Result<uint32_t> n = c->Load(keys, 0, &wrong);
  ASSERT_TRUE(n.has_value()) << n.error();
  EXPECT_EQ(*n, kPromptBlocks);
  EXPECT_EQ(wrong, 0u);

  // Node D has no seed that answers: it starts, serves its local tiers, and
  // misses (quickly, once its breaker is open) what is only in the cluster.
  std::unique_ptr<Node> d = StartSharing("d", {NodeAddress{"127.0.0.1", 1}});
  ASSERT_NE(d, nullptr);
  Result<std::vector<BlockKey>> own = d->Store(77, kPromptBlocks);
  ASSERT_TRUE(own.has_value()) << own.error();
  for (int i = 0; i < 4; ++i) {
    Result<LookupResult> hit = d->client->Lookup(d->id, keys);
    ASSERT_TRUE(hit.has_value()) << hit.error();
    EXPECT_EQ(hit->hits, 0u);
    Result<LookupResult> local = d->client->Lookup(d->id, *own);
    ASSERT_TRUE(local.has_value());
    EXPECT_EQ(local->hits, kPromptBlocks);
  }
  EXPECT_GE(d->Counter("remote_errors_unavailable") + d->Counter("remote_refused_breaker"), 1u);
  EXPECT_EQ(d->Counter("remote_breaker_open"), 1u);
}

}  // namespace
}  // namespace kvtier::testing
