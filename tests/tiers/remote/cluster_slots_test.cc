// Redis Cluster routing against the cases of the Redis Cluster specification
// (key hash slots, hash tags, MOVED / ASK), with slots a live redis-server
// 7.0.15 gave for the same keys (CLUSTER KEYSLOT).
#include "tiers/remote/cluster_slots.h"

#include <gtest/gtest.h>

namespace kvtier {
namespace {

TEST(ClusterSlotsTest, Crc16IsTheXmodemVariant) {
  EXPECT_EQ(Crc16Xmodem("123456789"), 0x31C3);  // the specification's check value
  EXPECT_EQ(Crc16Xmodem(""), 0);
}

TEST(ClusterSlotsTest, KeySlotsAreCrc16Mod16384) {
  EXPECT_EQ(KeySlot("foo"), 12182);
  EXPECT_EQ(KeySlot("hello"), 866);
  EXPECT_EQ(KeySlot("somekey"), 11058);
  for (int i = 0; i < 1000; ++i) EXPECT_LT(KeySlot("key:" + std::to_string(i)), kClusterSlots);
}

TEST(ClusterSlotsTest, HashTagsFollowTheSpecification) {
  // Only the bytes between the first '{' and the next '}' are hashed.
  EXPECT_EQ(KeySlot("{user1000}.following"), KeySlot("user1000"));
  EXPECT_EQ(KeySlot("{user1000}.followers"), KeySlot("{user1000}.following"));
  EXPECT_EQ(KeySlot("foo{bar}{zap}"), KeySlot("bar"));
  EXPECT_EQ(KeySlot("foo{{bar}}zap"), KeySlot("{bar"));
  // "{}" has nothing between: the whole key is hashed.
  EXPECT_EQ(KeySlot("foo{}{bar}"), Crc16Xmodem("foo{}{bar}") % kClusterSlots);
  // No closing brace: the whole key.
  EXPECT_EQ(KeySlot("foo{bar"), Crc16Xmodem("foo{bar") % kClusterSlots);
  // What redis-server 7.0.15 answers to CLUSTER KEYSLOT for these.
  EXPECT_EQ(KeySlot("{user1000}.following"), 3443);
  EXPECT_EQ(KeySlot("foo{{bar}}zap"), 4015);
  EXPECT_EQ(KeySlot("foo{}{bar}"), 8363);
  // Binary bytes hash as bytes.
  const std::string binary("\xff\x00{\x01}", 5);
  EXPECT_EQ(KeySlot(binary), KeySlot(std::string("\x01", 1)));
}

TEST(ClusterSlotsTest, RedirectionsParse) {
  std::optional<Redirect> moved = ParseRedirect("MOVED 3999 127.0.0.1:6381");
  ASSERT_TRUE(moved.has_value());
  EXPECT_EQ(moved->kind, Redirect::Kind::kMoved);
  EXPECT_EQ(moved->slot, 3999);
  EXPECT_EQ(moved->to, (NodeAddress{"127.0.0.1", 6381}));

  std::optional<Redirect> ask = ParseRedirect("ASK 16383 redis-2.internal:7002");
  ASSERT_TRUE(ask.has_value());
  EXPECT_EQ(ask->kind, Redirect::Kind::kAsk);
  EXPECT_EQ(ask->slot, 16383);
  EXPECT_EQ(ask->to, (NodeAddress{"redis-2.internal", 7002}));

  // IPv6, bare as Redis writes it, or bracketed; an unknown endpoint (":port"
  // means the host that answered).
  EXPECT_EQ(ParseRedirect("MOVED 1 ::1:7000")->to, (NodeAddress{"::1", 7000}));
  EXPECT_EQ(ParseRedirect("MOVED 1 [fe80::1]:7000")->to, (NodeAddress{"fe80::1", 7000}));
  EXPECT_EQ(ParseRedirect("MOVED 1 :7000")->to, (NodeAddress{"", 7000}));

  // Anything else is not a redirection, and a malformed one is never guessed.
  for (const char* text : {"ERR unknown command", "CLUSTERDOWN The cluster is down", "MOVED", "MOVED x 1.2.3.4:1",
                           "MOVED 16384 1.2.3.4:1", "ASK 5 nowhere", "ASK 5 host:0", "ASK 5 host:70000",
                           "MOVED 5 host:12a", "moved 5 host:1"}) {
    EXPECT_FALSE(ParseRedirect(text).has_value()) << text;
  }
}

TEST(ClusterSlotsTest, TheSlotMapFollowsAssignmentsAndMoves) {
  SlotMap map;
  EXPECT_EQ(map.covered(), 0u);
  EXPECT_EQ(map.NodeOf(0), SlotMap::kNoNode);
  const NodeAddress a{"10.0.0.1", 7000};
  const NodeAddress b{"10.0.0.2", 7000};
  const NodeAddress c{"10.0.0.3", 7000};
  ASSERT_TRUE(map.Assign(0, 5460, a).ok());
  ASSERT_TRUE(map.Assign(5461, 10922, b).ok());
  ASSERT_TRUE(map.Assign(10923, 16383, c).ok());
  EXPECT_EQ(map.covered(), 16384u);
  EXPECT_EQ(map.num_nodes(), 3u);
  EXPECT_EQ(map.node(map.NodeOf(KeySlot("foo"))), c);  // slot 12182
  map.Move(12182, a);
  EXPECT_EQ(map.node(map.NodeOf(12182)), a);
  EXPECT_EQ(map.node(map.NodeOf(12181)), c);
  EXPECT_EQ(map.num_nodes(), 3u) << "a known node is not added twice";
  EXPECT_FALSE(map.Assign(10, 5, a).ok());
  EXPECT_FALSE(map.Assign(0, 16384, a).ok());
}

}  // namespace
}  // namespace kvtier
