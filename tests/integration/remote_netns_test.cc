// Two kvtierd nodes as separate hosts on a network: each in a network
// namespace of its own, joined to the host's namespace by a veth pair, with
// the Redis Cluster (3 masters, a replica each) listening on the host's side
// of node A's link, with a password (off loopback, Redis takes no client
// without one), which the nodes read from their password_file. A prompt
// stored through node A is a remote hit on node B, byte for byte; the
// cluster sees each node's traffic come from its own address. Needs CAP_NET_ADMIN and CAP_SYS_ADMIN (root); skipped, saying
// why, where network namespaces cannot be made.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include <hiredis/hiredis.h>

#include "tests/integration/remote_nodes.h"
#include "tiers/remote/redis_connection.h"

namespace kvtier::testing {
namespace {

// Runs `command` (ip(8) and the like) through the shell; true on exit 0.
bool Sh(const std::string& command) { return std::system((command + " >/dev/null 2>&1").c_str()) == 0; }

// Two network namespaces, "a" and "b", each linked to this namespace by a
// veth pair: this side 10.N.K.1/30, the namespace's side 10.N.K.2/30 (K = 1
// for a, 2 for b) with its default route through this side. Removed when
// destroyed.
class TwoHosts {
 public:
  // nullptr with `why` set when this machine cannot make them.
  static std::unique_ptr<TwoHosts> Create(std::string* why) {
    auto hosts = std::unique_ptr<TwoHosts>(new TwoHosts());
    for (int k : {1, 2}) {
      const std::string ns = hosts->Namespace(k), veth = hosts->Veth(k), net = hosts->Net(k);
      if (!Sh("ip netns add " + ns)) {
        *why = "`ip netns add` failed: network namespaces need root (CAP_SYS_ADMIN, CAP_NET_ADMIN)";
        return nullptr;
      }
      hosts->made_ = k;
      if (!Sh("ip link add " + veth + " type veth peer name " + veth + "p") ||
          !Sh("ip link set " + veth + "p netns " + ns) || !Sh("ip addr add " + net + ".1/30 dev " + veth) ||
          !Sh("ip link set " + veth + " up") || !Sh("ip -n " + ns + " addr add " + net + ".2/30 dev " + veth + "p") ||
          !Sh("ip -n " + ns + " link set " + veth + "p up") || !Sh("ip -n " + ns + " link set lo up") ||
          !Sh("ip -n " + ns + " route add default via " + net + ".1")) {
        *why = "could not link namespace " + ns + " by a veth pair (ip link/addr/route failed)";
        return nullptr;
      }
    }
    return hosts;
  }
  ~TwoHosts() {
    for (int k = 1; k <= made_; ++k) {
      Sh("ip link del " + Veth(k));
      Sh("ip netns del " + Namespace(k));
    }
  }

  std::string netns_file(int k) const { return "/run/netns/" + Namespace(k); }
  // This namespace's address on host k's link, and host k's own.
  std::string gateway(int k) const { return Net(k) + ".1"; }
  std::string address(int k) const { return Net(k) + ".2"; }

 private:
  TwoHosts() : id_(static_cast<int>(::getpid() % 100000)) {}
  std::string Namespace(int k) const { return "kvtier-" + std::to_string(id_) + "-" + std::to_string(k); }
  std::string Veth(int k) const { return "kvt" + std::to_string(k) + "x" + std::to_string(id_); }
  std::string Net(int k) const { return "10." + std::to_string(100 + id_ % 100) + "." + std::to_string(k); }

  int id_;
  int made_ = 0;
};

// The addresses of the clients connected to `node` (CLIENT LIST).
std::string ClientAddresses(const NodeAddress& node, const std::string& password) {
  auto c = RedisConnection::Connect(RedisConnectionOptions{.address = node, .password = password});
  if (!c) return "";
  const std::string_view argv[] = {"CLIENT", "LIST"};
  Result<RedisReply> r = (*c)->Command(argv);
  return r && (*r)->type == REDIS_REPLY_STRING ? std::string((*r)->str, (*r)->len) : "";
}

TEST(RemoteNetnsTest, TwoNodesOnSeparateHostsShareBlocksThroughTheCluster) {
  std::string why;
  std::unique_ptr<TwoHosts> hosts = TwoHosts::Create(&why);
  if (hosts == nullptr) GTEST_SKIP() << why;
  // The cluster listens on this namespace's side of A's link; B reaches it
  // through its own link and this namespace.
  const std::string password = "kvtier-netns-" + std::to_string(::getpid());
  Result<std::unique_ptr<RedisClusterProcess>> cluster =
      RedisClusterProcess::Start({.host = hosts->gateway(1), .password = password});
  ASSERT_TRUE(cluster.has_value()) << cluster.error();

  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("kvtier-remote-netns-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir / "a");
  const std::string password_file = (dir / "redis-password").string();
  std::ofstream(password_file) << password << "\n";
  const std::vector<std::string> auth = {"tiers.remote.password_file=" + password_file};
  std::unique_ptr<Node> a = Node::Start((*cluster)->seeds(), (dir / "a").string(), auth, hosts->netns_file(1));
  ASSERT_NE(a, nullptr);
  std::filesystem::create_directories(dir / "b");
  std::filesystem::copy(dir / "a" / "salts", dir / "b" / "salts", std::filesystem::copy_options::recursive);
  std::unique_ptr<Node> b = Node::Start((*cluster)->seeds(), (dir / "b").string(), auth, hosts->netns_file(2));
  ASSERT_NE(b, nullptr);

  // Prefill on A, decode on B: B loads the whole prompt from the cluster.
  const std::vector<BlockKey> keys = a->StoreShared(42, 24);
  Result<std::vector<BlockKey>> b_keys = b->Keys(42, 24);
  ASSERT_TRUE(b_keys.has_value());
  ASSERT_EQ(*b_keys, keys);
  Result<LookupResult> hit = b->client->Lookup(b->id, keys);
  ASSERT_TRUE(hit.has_value()) << hit.error();
  EXPECT_EQ(hit->hits, 24u);
  EXPECT_THAT(hit->tiers, ::testing::Each(BlockTier::kRemote));
  uint32_t wrong = 0;
  Result<uint32_t> loaded = b->Load(keys, 0, &wrong);
  ASSERT_TRUE(loaded.has_value()) << loaded.error();
  EXPECT_EQ(*loaded, 24u) << b->daemon.Log();
  EXPECT_EQ(wrong, 0u);

  // Each node's connections come from its own host's address.
  std::string clients;
  for (size_t i = 0; i < (*cluster)->size(); ++i) clients += ClientAddresses((*cluster)->node(i), password);
  EXPECT_THAT(clients, ::testing::HasSubstr("addr=" + hosts->address(1) + ":")) << clients;
  EXPECT_THAT(clients, ::testing::HasSubstr("addr=" + hosts->address(2) + ":")) << clients;

  // A node with the wrong password: misses, counted, and says why.
  std::filesystem::create_directories(dir / "c");
  std::filesystem::copy(dir / "a" / "salts", dir / "c" / "salts", std::filesystem::copy_options::recursive);
  const std::string wrong_file = (dir / "wrong-password").string();
  std::ofstream(wrong_file) << "not-" << password << "\n";
  std::unique_ptr<Node> c =
      Node::Start((*cluster)->seeds(), (dir / "c").string(), {"tiers.remote.password_file=" + wrong_file});
  ASSERT_NE(c, nullptr);
  hit = c->client->Lookup(c->id, keys);
  ASSERT_TRUE(hit.has_value()) << hit.error();
  EXPECT_EQ(hit->hits, 0u);
  EXPECT_GE(c->Counter("remote_errors_rejected"), 1u);
  EXPECT_THAT(c->daemon.Log(), ::testing::HasSubstr("the cluster refused us"));

  a.reset();
  b.reset();
  c.reset();
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

}  // namespace
}  // namespace kvtier::testing
