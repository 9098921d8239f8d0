// RedisCluster (tiers/remote/redis_cluster.h) against a real Redis Cluster of
// 3 masters with a replica each, started by the test (RedisClusterProcess),
// and against a standalone redis-server.
#include "tiers/remote/redis_cluster.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <hiredis/hiredis.h>

#include <random>
#include <set>
#include <string>
#include <vector>

#include "tests/tiers/remote/must_start.h"
#include "tiers/remote/remote_tier.h"
#include "tools/redis_cluster_process.h"

namespace kvtier {
namespace {

using ::kvtier::testing::MustStart;
using ::kvtier::testing::RedisClusterProcess;
using ::testing::HasSubstr;

std::unique_ptr<RedisCluster> MustConnect(const RedisClusterProcess& process) {
  Result<std::unique_ptr<RedisCluster>> c = RedisCluster::Connect(RedisClusterOptions{.seeds = process.seeds()});
  EXPECT_TRUE(c.has_value()) << c.error();
  return c ? std::move(*c) : nullptr;
}

// Binary keys and values: the remote tier's are raw bytes.
std::string Key(int i) { return std::string("kvt\0", 4) + std::to_string(i) + std::string(1, static_cast<char>(i)); }
std::string Value(int i, size_t bytes) {
  std::string v(bytes, '\0');
  for (size_t k = 0; k < bytes; ++k) v[k] = static_cast<char>((k * 131 + static_cast<size_t>(i) * 7) & 0xff);
  return v;
}

// SETs (then GETs) keys [first, first + n) as one batch each.
void SetAll(RedisCluster& c, int first, int n, size_t bytes, std::vector<std::string>* keys,
            std::vector<std::string>* values) {
  keys->clear();
  values->clear();
  for (int i = first; i < first + n; ++i) {
    keys->push_back(Key(i));
    values->push_back(Value(i, bytes));
  }
  std::vector<RedisCommand> batch;
  for (size_t i = 0; i < keys->size(); ++i) batch.push_back({{"SET", (*keys)[i], (*values)[i]}});
  std::vector<Result<RedisReply>> replies = c.Run(batch);
  for (size_t i = 0; i < replies.size(); ++i) {
    ASSERT_TRUE(replies[i].has_value()) << i << ": " << replies[i].error();
    ASSERT_EQ((*replies[i])->type, REDIS_REPLY_STATUS) << RedisErrorText(**replies[i]);
  }
}

void ExpectValues(RedisCluster& c, const std::vector<std::string>& keys, const std::vector<std::string>& values) {
  std::vector<RedisCommand> batch;
  for (const std::string& k : keys) batch.push_back({{"GET", k}});
  std::vector<Result<RedisReply>> replies = c.Run(batch);
  for (size_t i = 0; i < replies.size(); ++i) {
    ASSERT_TRUE(replies[i].has_value()) << i << ": " << replies[i].error();
    const redisReply& r = **replies[i];
    ASSERT_EQ(r.type, REDIS_REPLY_STRING) << i << " " << RedisErrorText(r);
    EXPECT_EQ(std::string(r.str, r.len), values[i]) << "key " << i;
  }
}

// The test helper's ports: a node's port is never another node's bus port
// (port + 10000), nor taken by `avoid`. Seen before: one node on P, another
// on P + 10000, and the first node's bus could not bind. A thousand ports
// from a range just over 10000 wide: without the check, most seeds pair some.
TEST(PickClusterPortsTest, NoNodesPortIsAnotherNodesBusPort) {
  using ::kvtier::testing::PickClusterPorts;
  for (uint32_t seed = 0; seed < 20; ++seed) {
    std::mt19937 random(seed);
    const std::vector<uint16_t> avoid = {12005, 12050};
    const std::vector<uint16_t> ports =
        PickClusterPorts(1000, random, 12000, 22100, [](uint16_t) { return true; }, avoid);
    ASSERT_EQ(ports.size(), 1000u);
    std::set<int> used = {12005, 22005, 12050, 22050};
    for (const uint16_t p : ports) {
      EXPECT_TRUE(used.insert(p).second) << "seed " << seed << ": port " << p << " is in use";
      EXPECT_TRUE(used.insert(p + RedisClusterProcess::kBusOffset).second)
          << "seed " << seed << ": port " << p << "'s bus port is in use";
    }
  }
  // Ports the machine has taken (here: every even port) are never picked,
  // nor ports whose bus port is taken.
  std::mt19937 random(7);
  for (const uint16_t p :
       PickClusterPorts(50, random, 11000, 13000, [](uint16_t q) { return q % 2 == 1; }, {})) {
    EXPECT_EQ(p % 2, 1) << p;
  }
}

TEST(RedisClusterTest, TopologyKeySlotsAndOneRoundTripPerNode) {
  auto process = MustStart();
  ASSERT_NE(process, nullptr);
  auto c = MustConnect(*process);
  ASSERT_NE(c, nullptr);
  EXPECT_FALSE(c->standalone());
  EXPECT_EQ(c->slots().covered(), 16384u);
  EXPECT_EQ(c->slots().num_nodes(), 3u);

  // The servers agree with KeySlot, binary keys included.
  Result<std::unique_ptr<RedisConnection>> one =
      RedisConnection::Connect(RedisConnectionOptions{.address = process->node(0)});
  ASSERT_TRUE(one.has_value()) << one.error();
  for (int i = 0; i < 50; ++i) {
    const std::string key = Key(i * 37);
    const std::string_view argv[] = {"CLUSTER", "KEYSLOT", key};
    Result<RedisReply> r = (*one)->Command(argv);
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ((*r)->integer, KeySlot(key)) << i;
  }

  std::vector<std::string> keys, values;
  const uint64_t before = c->counters().round_trips;
  SetAll(*c, 0, 300, 1000, &keys, &values);
  EXPECT_EQ(c->counters().round_trips - before, 3u) << "one pipeline per master";
  ExpectValues(*c, keys, values);
  EXPECT_EQ(c->counters().moved + c->counters().ask, 0u);
}

TEST(RedisClusterTest, MovedAndAskAreFollowedWhileSlotsMoveLive) {
  auto process = MustStart();
  ASSERT_NE(process, nullptr);
  auto c = MustConnect(*process);
  ASSERT_NE(c, nullptr);
  std::vector<std::string> keys, values;
  SetAll(*c, 0, 400, 256, &keys, &values);

  // A slot migrating: keys still on the source answer there, keys already
  // moved answer ASK. Migrate one key of a slot by hand, as a reshard does.
  const uint16_t slot = KeySlot(keys[0]);
  const NodeAddress from = c->slots().node(c->slots().NodeOf(slot));
  Result<std::vector<NodeAddress>> masters = process->Masters();
  ASSERT_TRUE(masters.has_value()) << masters.error();
  NodeAddress to = masters->front() == from ? (*masters)[1] : masters->front();
  auto id_of = [&](const NodeAddress& node) {
    auto conn = RedisConnection::Connect(RedisConnectionOptions{.address = node});
    const std::string_view argv[] = {"CLUSTER", "MYID"};
    auto r = (*conn)->Command(argv);
    return std::string((*r)->str, (*r)->len);
  };
  const std::string from_id = id_of(from), to_id = id_of(to), slot_text = std::to_string(slot);
  auto on = [&](const NodeAddress& node, std::vector<std::string_view> argv) {
    auto conn = RedisConnection::Connect(RedisConnectionOptions{.address = node});
    ASSERT_TRUE(conn.has_value());
    auto r = (*conn)->Command(argv);
    ASSERT_TRUE(r.has_value());
    ASSERT_NE((*r)->type, REDIS_REPLY_ERROR) << RedisErrorText(**r);
  };
  on(to, {"CLUSTER", "SETSLOT", slot_text, "IMPORTING", from_id});
  on(from, {"CLUSTER", "SETSLOT", slot_text, "MIGRATING", to_id});
  const std::string port = std::to_string(to.port);
  on(from, {"MIGRATE", to.host, port, keys[0], "0", "5000"});
  ExpectValues(*c, keys, values);  // keys[0] through ASK, the rest as before
  EXPECT_GE(c->counters().ask, 1u);
  EXPECT_EQ(c->slots().node(c->slots().NodeOf(slot)), from) << "ASK leaves the map alone";

  // The rest of the slot's keys, then the slot itself: now MOVED.
  for (size_t i = 1; i < keys.size(); ++i) {
    if (KeySlot(keys[i]) == slot) on(from, {"MIGRATE", to.host, port, keys[i], "0", "5000"});
  }
  for (const NodeAddress& node : *masters) on(node, {"CLUSTER", "SETSLOT", slot_text, "NODE", to_id});
  ExpectValues(*c, keys, values);
  EXPECT_GE(c->counters().moved, 1u);
  EXPECT_EQ(c->slots().node(c->slots().NodeOf(slot)), to) << "MOVED updates the map";

  // A whole reshard by redis-cli while batches run: every value stays right.
  const std::string reshard = "--cluster reshard " + process->node(0).ToString() + " --cluster-from " + from_id +
                              " --cluster-to " + to_id + " --cluster-slots 500 --cluster-yes";
  ASSERT_TRUE(process->Cli(reshard).ok());
  ExpectValues(*c, keys, values);
  EXPECT_GE(c->counters().refreshes, 2u);
}

TEST(RedisClusterTest, AKilledMasterFailsOnlyItsSlotsUntilItsReplicaTakesOver) {
  auto process = MustStart();
  ASSERT_NE(process, nullptr);
  auto c = MustConnect(*process);
  ASSERT_NE(c, nullptr);
  std::vector<std::string> keys, values;
  SetAll(*c, 0, 300, 128, &keys, &values);

  const NodeAddress victim = c->slots().node(c->slots().NodeOf(KeySlot(keys[0])));
  size_t victim_index = 0;
  while (!(process->node(victim_index) == victim)) ++victim_index;
  process->Kill(victim_index);

  std::vector<RedisCommand> batch;
  for (const std::string& k : keys) batch.push_back({{"GET", k}});
  std::vector<Result<RedisReply>> replies = c->Run(batch);
  size_t unavailable = 0, served = 0;
  for (size_t i = 0; i < replies.size(); ++i) {
    const bool on_victim = c->slots().node(c->slots().NodeOf(KeySlot(keys[i]))) == victim;
    if (!replies[i]) {
      EXPECT_TRUE(on_victim) << i;
      EXPECT_EQ(replies[i].error().code(), StatusCode::kUnavailable);
      ++unavailable;
    } else {
      ASSERT_EQ((*replies[i])->type, REDIS_REPLY_STRING);
      EXPECT_EQ(std::string((*replies[i])->str, (*replies[i])->len), values[i]);
      ++served;
    }
  }
  EXPECT_GT(unavailable, 0u);
  EXPECT_GT(served, 0u) << "the other masters keep serving";

  // The replica takes over (cluster-node-timeout 1.5 s); after a refresh
  // every key is served again, from the promoted replica (replication is
  // asynchronous, so a value may be missing there: a miss, never another
  // value).
  const Status healthy = process->WaitHealthy();
  ASSERT_TRUE(healthy.ok()) << healthy;
  const Status refreshed = c->RefreshTopology();
  ASSERT_TRUE(refreshed.ok()) << refreshed;
  replies = c->Run(batch);
  for (size_t i = 0; i < replies.size(); ++i) {
    ASSERT_TRUE(replies[i].has_value()) << i << ": " << replies[i].error();
    const redisReply& r = **replies[i];
    if (r.type == REDIS_REPLY_NIL) continue;
    ASSERT_EQ(r.type, REDIS_REPLY_STRING) << RedisErrorText(r);
    EXPECT_EQ(std::string(r.str, r.len), values[i]);
  }
}

// A value that failed its check is deleted only while it is still the value
// found: a valid one another node SET in between stays (before: an
// unconditional DEL). The command goes to the key's node (EVAL's key is its
// fourth word), not to the script's.
TEST(RedisClusterTest, DeleteIfUnchangedKeepsAValueSetSince) {
  auto process = MustStart();
  ASSERT_NE(process, nullptr);
  auto c = MustConnect(*process);
  ASSERT_NE(c, nullptr);
  std::vector<std::string> keys, bad;
  SetAll(*c, 0, 30, 300, &keys, &bad);
  // Half of them replaced by a valid value since the bad one was read.
  std::vector<std::string> good;
  for (int i = 0; i < 30; ++i) good.push_back(Value(1000 + i, 500));
  std::vector<RedisCommand> batch;
  for (size_t i = 0; i < keys.size(); i += 2) batch.push_back({{"SET", keys[i], good[i]}});
  for (const Result<RedisReply>& r : c->Run(batch)) ASSERT_TRUE(r.has_value()) << r.error();

  const uint64_t redirects = c->counters().moved + c->counters().ask;
  batch.clear();
  for (size_t i = 0; i < keys.size(); ++i) batch.push_back(DeleteIfUnchanged(keys[i], bad[i]));
  std::vector<Result<RedisReply>> deleted = c->Run(batch);
  EXPECT_EQ(c->counters().moved + c->counters().ask, redirects) << "each went to its key's node";
  batch.clear();
  for (const std::string& k : keys) batch.push_back({{"GET", k}});
  std::vector<Result<RedisReply>> after = c->Run(batch);
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(deleted[i].has_value()) << deleted[i].error();
    ASSERT_EQ((*deleted[i])->type, REDIS_REPLY_INTEGER) << RedisErrorText(**deleted[i]);
    ASSERT_TRUE(after[i].has_value()) << after[i].error();
    if (i % 2 == 0) {
      EXPECT_EQ((*deleted[i])->integer, 0) << i;
      ASSERT_EQ((*after[i])->type, REDIS_REPLY_STRING) << i;
      EXPECT_EQ(std::string((*after[i])->str, (*after[i])->len), good[i]) << i;
    } else {
      EXPECT_EQ((*deleted[i])->integer, 1) << i;
      EXPECT_EQ((*after[i])->type, REDIS_REPLY_NIL) << i;
    }
  }
}

TEST(RedisClusterTest, AStandaloneEndpointAndUnreachableSeeds) {
  auto process = MustStart({.standalone = true});
  ASSERT_NE(process, nullptr);
  // The first seed is unreachable: the next one serves.
  RedisClusterOptions options{.seeds = {NodeAddress{"127.0.0.1", 1}, process->node(0)},
                              .connect_timeout = std::chrono::milliseconds(200)};
  Result<std::unique_ptr<RedisCluster>> c = RedisCluster::Connect(options);
  ASSERT_TRUE(c.has_value()) << c.error();
  EXPECT_TRUE((*c)->standalone());
  std::vector<std::string> keys, values;
  SetAll(**c, 0, 50, 4096, &keys, &values);
  ExpectValues(**c, keys, values);

  options.seeds = {NodeAddress{"127.0.0.1", 1}};
  Result<std::unique_ptr<RedisCluster>> none = RedisCluster::Connect(options);
  ASSERT_FALSE(none.has_value());
  EXPECT_EQ(none.error().code(), StatusCode::kUnavailable);
  EXPECT_THAT(none.error().message(), HasSubstr("127.0.0.1:1"));
}

}  // namespace
}  // namespace kvtier
