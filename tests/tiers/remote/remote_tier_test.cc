// RemoteTier against real Redis Clusters the tests start: what it serves is
// byte-exact, and every fault (a corrupted or replaced value, maxmemory
// eviction, the whole cluster down and back, an unreachable seed at start-up)
// is a miss, never a wrong byte, and never slow once the breaker is open.
#include "tiers/remote/remote_tier.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <hiredis/hiredis.h>

#include <fstream>
#include <future>
#include <string>
#include <vector>

#include "common/block_pattern.h"
#include "tests/tiers/remote/must_start.h"
#include "tests/tiers/remote/slow_proxy.h"
#include "tiers/remote/remote_value.h"
#include "tools/redis_cluster_process.h"

namespace kvtier {
namespace {

using ::kvtier::testing::MustStart;
using ::kvtier::testing::RedisClusterProcess;

// The caller's side: `post` runs completions on the I/O thread, and each
// call's result comes back through a future.
RemoteTierOptions Options(const std::vector<NodeAddress>& seeds) {
  RemoteTierOptions o;
  o.cluster.seeds = seeds;
  o.cluster.connect_timeout = std::chrono::milliseconds(300);
  o.cluster.io_timeout = std::chrono::milliseconds(1000);
  o.key_prefix = "test:";
  o.breaker_failures = 2;
  o.breaker_cooldown = std::chrono::milliseconds(500);
  o.post = [](std::function<void()> f) { f(); };
  return o;
}

template <typename Call>
Result<uint32_t> Wait(Call call) {
  auto promise = std::make_shared<std::promise<Result<uint32_t>>>();
  std::future<Result<uint32_t>> future = promise->get_future();
  call([promise](Result<uint32_t> r) { promise->set_value(std::move(r)); });
  return future.get();
}

struct Blocks {
  LayoutFingerprint ns;
  std::vector<StoredKey> keys;
  std::vector<std::vector<uint8_t>> data;

  Blocks(int n, size_t bytes, uint8_t salt = 0) {
    ns.bytes.fill(0x5a);
    for (int i = 0; i < n; ++i) {
      StoredKey k;
      for (size_t b = 0; b < k.bytes.size(); ++b) k.bytes[b] = static_cast<uint8_t>(i * 13 + b + salt);
      keys.push_back(k);
      std::vector<uint8_t> d(bytes);
      for (size_t b = 0; b < bytes; ++b) d[b] = static_cast<uint8_t>((b * 31 + static_cast<size_t>(i) + salt) & 0xff);
      data.push_back(std::move(d));
    }
  }
  std::vector<std::span<const uint8_t>> payloads() const {
    return std::vector<std::span<const uint8_t>>(data.begin(), data.end());
  }
};

Result<uint32_t> Put(RemoteTier& tier, const Blocks& b) {
  return Wait([&](RemoteTier::Done d) { tier.Put(b.ns, b.keys, b.payloads(), std::move(d)); });
}

// Fetches into fresh buffers; returns the count, with the bytes in `out`.
Result<uint32_t> Get(RemoteTier& tier, const Blocks& b, std::vector<std::vector<uint8_t>>* out) {
  out->assign(b.keys.size(), {});
  std::vector<std::span<uint8_t>> spans;
  for (size_t i = 0; i < b.keys.size(); ++i) {
    (*out)[i].assign(b.data[i].size(), 0);
    spans.emplace_back((*out)[i]);
  }
  return Wait([&](RemoteTier::Done d) { tier.Get(b.ns, b.keys, spans, std::move(d)); });
}

Result<uint32_t> Exists(RemoteTier& tier, const Blocks& b) {
  return Wait([&](RemoteTier::Done d) { tier.Exists(b.keys, std::move(d)); });
}

void SetRaw(const NodeAddress& any, const std::string& key, const std::string& value) {
  RedisClusterOptions o{.seeds = {any}};
  auto c = RedisCluster::Connect(o);
  ASSERT_TRUE(c.has_value()) << c.error();
  const RedisCommand set[] = {{{"SET", key, value}}};
  auto r = (*c)->Run(set);
  ASSERT_TRUE(r[0].has_value()) << r[0].error();
}

TEST(RemoteTierTest, StoredBlocksAreFetchedByteExactAndCounted) {
  auto cluster = MustStart();
  ASSERT_NE(cluster, nullptr);
  auto tier = RemoteTier::Start(Options(cluster->seeds()));
  ASSERT_TRUE(tier.has_value()) << tier.error();
  Blocks b(64, 256 << 10);
  Result<uint32_t> stored = Put(**tier, b);
  ASSERT_TRUE(stored.has_value()) << stored.error();
  EXPECT_EQ(*stored, 64u);
  EXPECT_EQ(*Exists(**tier, b), 64u);
  std::vector<std::vector<uint8_t>> out;
  Result<uint32_t> got = Get(**tier, b, &out);
  ASSERT_TRUE(got.has_value()) << got.error();
  ASSERT_EQ(*got, 64u);
  for (size_t i = 0; i < out.size(); ++i) EXPECT_EQ(out[i], b.data[i]) << i;

  // A prompt whose tail was never stored: the leading blocks only.
  Blocks tail(8, 256 << 10, 100);
  Blocks mixed = b;
  mixed.keys.resize(10);
  mixed.data.resize(10);
  mixed.keys.insert(mixed.keys.end(), tail.keys.begin(), tail.keys.end());
  mixed.data.insert(mixed.data.end(), tail.data.begin(), tail.data.end());
  EXPECT_EQ(*Exists(**tier, mixed), 10u);
  EXPECT_EQ(*Get(**tier, mixed, &out), 10u);

  // Another namespace asks for the same keys: its check fails, never served.
  Blocks other_ns = b;
  other_ns.ns.bytes[0] ^= 1;
  other_ns.keys.resize(1);
  other_ns.data.resize(1);
  EXPECT_EQ(*Get(**tier, other_ns, &out), 0u);

  // Values far larger than a socket buffer: written in many partial writev
  // calls, without a copy.
  Blocks big(3, 6 << 20, 50);
  ASSERT_EQ(*Put(**tier, big), 3u);
  ASSERT_EQ(*Get(**tier, big, &out), 3u);
  for (size_t i = 0; i < out.size(); ++i) EXPECT_EQ(out[i], big.data[i]) << i;

  const RemoteCounters c = (*tier)->counters();
  EXPECT_EQ(c.stores, 67u);
  EXPECT_EQ(c.hits, 77u);
  EXPECT_EQ(c.corrupt, 1u);
  EXPECT_GE(c.bytes_written, 64u * (256 << 10));
  EXPECT_FALSE(c.breaker_open);
  EXPECT_GT(c.batch_latency.count(), 0u);
}

TEST(RemoteTierTest, CodedValuesAreDecodedOnFetchAndMustBeTheirNamespacesCodec) {
  auto cluster = MustStart();
  ASSERT_NE(cluster, nullptr);
  auto tier = RemoteTier::Start(Options(cluster->seeds()));
  ASSERT_TRUE(tier.has_value()) << tier.error();
  // bf16 blocks of about N(0,1): the lossless codec takes a quarter off.
  Blocks b(6, 64 << 10);
  for (size_t i = 0; i < b.data.size(); ++i) FillKvFromKey(BlockKey{b.keys[i].bytes}, b.data[i]);
  const CodecParams lossless{.kind = CodecKind::kLossless, .dtype = DType::kBf16, .group_elems = 0};
  std::unique_ptr<BlockCodec> coder = BlockCodec::Create().value();
  std::vector<std::vector<uint8_t>> stored(b.data.size());
  std::vector<RemoteTier::Form> forms;
  for (size_t i = 0; i < b.data.size(); ++i) {
    stored[i].resize(BlockCodec::MaxEncodedBytes(lossless, b.data[i].size()));
    const std::optional<size_t> n = coder->Encode(lossless, b.data[i], stored[i]);
    ASSERT_TRUE(n.has_value());
    stored[i].resize(*n);
    forms.push_back({CodecKind::kLossless, b.data[i].size()});
  }
  // The last block goes raw: a namespace's values may be either.
  stored.back() = b.data.back();
  forms.back() = {};
  ASSERT_EQ(*Wait([&](RemoteTier::Done d) {
              (*tier)->Put(b.ns, b.keys, std::vector<std::span<const uint8_t>>(stored.begin(), stored.end()),
                           std::move(d), forms);
            }),
            6u);
  EXPECT_LT((*tier)->counters().bytes_written, 6u * (64 << 10)) << "the coded values are smaller";
  std::vector<std::vector<uint8_t>> out(6, std::vector<uint8_t>(64 << 10));
  std::vector<std::span<uint8_t>> spans(out.begin(), out.end());
  std::vector<uint64_t> checksums(6);
  ASSERT_EQ(*Wait([&](RemoteTier::Done d) { (*tier)->Get(b.ns, b.keys, spans, std::move(d), &checksums, lossless); }),
            6u);
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_EQ(out[i], b.data[i]) << i;
    EXPECT_EQ(checksums[i], RemotePayloadChecksum(b.data[i])) << "the checksum is of the block as served";
  }
  // Fetched as another codec's namespace would (fp8): never decoded, a miss.
  const CodecParams fp8{.kind = CodecKind::kFp8, .dtype = DType::kBf16, .group_elems = 64};
  EXPECT_EQ(*Wait([&](RemoteTier::Done d) { (*tier)->Get(b.ns, b.keys, spans, std::move(d), nullptr, fp8); }), 0u);
  EXPECT_EQ((*tier)->counters().corrupt, 1u);
}

TEST(RemoteTierTest, CorruptedOrReplacedValuesAreMissesAndDeleted) {
  auto cluster = MustStart({.masters = 3, .replicas = 0});
  ASSERT_NE(cluster, nullptr);
  auto tier = RemoteTier::Start(Options(cluster->seeds()));
  ASSERT_TRUE(tier.has_value()) << tier.error();
  Blocks b(4, 4096);
  ASSERT_EQ(*Put(**tier, b), 4u);

  // Block 1: a byte flipped in place; block 2: another block's value written
  // under its key (a test writing to the cluster directly).
  const std::string key1 = RemoteKey("test:", b.keys[1]);
  const std::string key2 = RemoteKey("test:", b.keys[2]);
  {
    RedisClusterOptions o{.seeds = cluster->seeds()};
    auto c = RedisCluster::Connect(o);
    ASSERT_TRUE(c.has_value());
    const std::string key3 = RemoteKey("test:", b.keys[3]);  // the commands hold views of their keys
    const RedisCommand get[] = {{{"GET", key1}}, {{"GET", key3}}};
    auto r = (*c)->Run(get);
    std::string v1((*r[0])->str, (*r[0])->len), v3((*r[1])->str, (*r[1])->len);
    v1[RemoteValueHeader::kBytes + 100] ^= 0x01;
    SetRaw(cluster->node(0), key1, v1);
    SetRaw(cluster->node(0), key2, v3);
  }
  std::vector<std::vector<uint8_t>> out;
  EXPECT_EQ(*Get(**tier, b, &out), 1u) << "block 1 does not check: a miss from there";
  EXPECT_EQ(out[0], b.data[0]);
  EXPECT_EQ((*tier)->counters().corrupt, 1u);
  EXPECT_EQ(*Exists(**tier, b), 1u) << "the corrupt value was deleted";

  Blocks from2 = b;
  from2.keys.erase(from2.keys.begin(), from2.keys.begin() + 2);
  from2.data.erase(from2.data.begin(), from2.data.begin() + 2);
  EXPECT_EQ(*Get(**tier, from2, &out), 0u) << "another block's value is not this block";
  EXPECT_EQ((*tier)->counters().corrupt, 2u);

  // Garbage and a truncated value.
  SetRaw(cluster->node(0), key1, "not a kvtier value");
  Blocks from1 = b;
  from1.keys.erase(from1.keys.begin());
  from1.data.erase(from1.data.begin());
  EXPECT_EQ(*Get(**tier, from1, &out), 0u);
  EXPECT_EQ((*tier)->counters().corrupt, 3u);
}

TEST(RemoteTierTest, ValuesEvictedByMaxmemoryAreMisses) {
  auto cluster = MustStart({.masters = 3, .replicas = 0, .maxmemory = "3mb"});
  ASSERT_NE(cluster, nullptr);
  auto tier = RemoteTier::Start(Options(cluster->seeds()));
  ASSERT_TRUE(tier.has_value()) << tier.error();
  // 48 MiB into 9 MiB of cluster: most are evicted (allkeys-lru).
  Blocks b(192, 256 << 10);
  for (size_t at = 0; at < b.keys.size(); at += 16) {
    Blocks part = b;
    part.keys.assign(b.keys.begin() + static_cast<long>(at), b.keys.begin() + static_cast<long>(at + 16));
    part.data.assign(b.data.begin() + static_cast<long>(at), b.data.begin() + static_cast<long>(at + 16));
    ASSERT_TRUE(Put(**tier, part).has_value());
  }
  uint32_t found = 0;
  for (size_t i = 0; i < b.keys.size(); ++i) {
    Blocks one = b;
    one.keys = {b.keys[i]};
    one.data = {b.data[i]};
    std::vector<std::vector<uint8_t>> out;
    Result<uint32_t> got = Get(**tier, one, &out);
    ASSERT_TRUE(got.has_value()) << got.error();
    if (*got == 1) {
      EXPECT_EQ(out[0], b.data[i]) << i;
      ++found;
    }
  }
  EXPECT_GT(found, 0u);
  EXPECT_LT(found, 100u) << "most were evicted";
  EXPECT_EQ((*tier)->counters().corrupt, 0u);
}

TEST(RemoteTierTest, AClusterThatIsDownOpensTheBreakerAndIsBackAfterwards) {
  auto cluster = MustStart({.masters = 3, .replicas = 0});
  ASSERT_NE(cluster, nullptr);
  auto tier = RemoteTier::Start(Options(cluster->seeds()));
  ASSERT_TRUE(tier.has_value()) << tier.error();
  Blocks b(6, 8192);
  ASSERT_EQ(*Put(**tier, b), 6u);

  for (size_t i = 0; i < cluster->size(); ++i) cluster->Kill(i);
  for (int i = 0; i < 2; ++i) {
    Result<uint32_t> r = Exists(**tier, b);
    ASSERT_FALSE(r.has_value());
    EXPECT_EQ(r.error().code(), StatusCode::kUnavailable);
  }
  EXPECT_TRUE((*tier)->counters().breaker_open);
  // Open: refused at once, without touching the network.
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 100; ++i) {
    Result<uint32_t> r = Exists(**tier, b);
    ASSERT_FALSE(r.has_value());
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(400));
  EXPECT_GE((*tier)->counters().refused_breaker, 100u);

  // The cluster comes back (empty: persistence is off); after the cooldown
  // a probe closes the breaker, and blocks are stored and served again.
  for (size_t i = 0; i < cluster->size(); ++i) ASSERT_TRUE(cluster->Restart(i).ok());
  ASSERT_TRUE(cluster->WaitHealthy().ok());
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  Result<uint32_t> stored = Put(**tier, b);
  while (!stored && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    stored = Put(**tier, b);
  }
  ASSERT_TRUE(stored.has_value()) << stored.error();
  EXPECT_EQ(*stored, 6u);
  EXPECT_FALSE((*tier)->counters().breaker_open);
  // Each I/O thread finds its connections from before the restart broken on
  // first use: that batch is a miss (an error, never data), and the next
  // one connects anew.
  std::vector<std::vector<uint8_t>> out;
  Result<uint32_t> got = Get(**tier, b, &out);
  for (int i = 0; i < 10 && !got; ++i) got = Get(**tier, b, &out);
  ASSERT_TRUE(got.has_value()) << got.error();
  EXPECT_EQ(*got, 6u);
  EXPECT_EQ(out[5], b.data[5]);
}

// A node that answers slowly (a 64 KiB value trickled back 4 KiB every
// 0.4 s: 6.4 s whole) fails its batch within timeout_ms, and such batches
// open the breaker as a dead node's do. Before, timeout_ms bounded each
// read: one Get took 6.8 s, and a slow node counted as reached.
TEST(RemoteTierTest, ASlowNodeFailsItsBatchInTimeAndOpensTheBreaker) {
  auto redis = MustStart({.standalone = true});
  ASSERT_NE(redis, nullptr);
  Blocks b(1, 64 << 10);
  {
    auto direct = RemoteTier::Start(Options(redis->seeds()));
    ASSERT_TRUE(direct.has_value()) << direct.error();
    ASSERT_EQ(*Put(**direct, b), 1u);
  }
  testing::SlowProxy proxy(redis->node(0), 4096, std::chrono::milliseconds(400));
  RemoteTierOptions o = Options({proxy.address()});
  o.cluster.io_timeout = std::chrono::milliseconds(500);
  auto tier = RemoteTier::Start(o);
  ASSERT_TRUE(tier.has_value()) << tier.error();
  std::vector<std::vector<uint8_t>> out;
  for (int i = 0; i < 2; ++i) {
    const auto start = std::chrono::steady_clock::now();
    Result<uint32_t> got = Get(**tier, b, &out);
    const auto took = std::chrono::steady_clock::now() - start;
    EXPECT_FALSE(got.has_value() && *got > 0) << "served through a node too slow to answer in time";
    // The bound, and the connection to the node (also through the proxy).
    EXPECT_LT(took, std::chrono::milliseconds(1500)) << i;
  }
  EXPECT_TRUE((*tier)->counters().breaker_open);
  EXPECT_EQ((*tier)->counters().hits, 0u);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(Get(**tier, b, &out).has_value());  // refused at once while open
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(100));
}

// The other direction: a node that takes a put's bytes slowly, however
// steadily (64 KiB every 30 ms, about 2 MB/s, each piece well within
// io_timeout), fails the batch by its deadline: io_timeout plus its bytes at
// kMinBytesPerSecond. Before, each sendmsg that made some progress waited
// its send timeout again: this 16 MiB put took about 8 s, its blocks leased
// and its I/O thread held all along.
TEST(RemoteTierTest, ANodeThatTakesAPutSlowlyFailsItInTimeAndOpensTheBreaker) {
  auto redis = MustStart({.standalone = true});
  ASSERT_NE(redis, nullptr);
  testing::SlowProxy proxy(redis->node(0), 64 << 10, std::chrono::milliseconds(30),
                           testing::SlowProxy::Slow::kRequests);
  RemoteTierOptions o = Options({proxy.address()});
  o.cluster.io_timeout = std::chrono::milliseconds(500);
  auto tier = RemoteTier::Start(o);
  ASSERT_TRUE(tier.has_value()) << tier.error();
  // More than the kernel's buffers hold: the writes must wait for the node.
  Blocks b(4, 4 << 20);
  // io_timeout + 16 MiB at 100 MB/s is 668 ms; the rest is slack.
  const auto bound = std::chrono::milliseconds(2000);
  for (int i = 0; i < 2; ++i) {
    auto promise = std::make_shared<std::promise<Result<uint32_t>>>();
    std::future<Result<uint32_t>> future = promise->get_future();
    const auto start = std::chrono::steady_clock::now();
    (*tier)->Put(b.ns, b.keys, b.payloads(), [promise](Result<uint32_t> r) { promise->set_value(std::move(r)); });
    ASSERT_EQ(future.wait_for(std::chrono::seconds(30)), std::future_status::ready) << "the put never ended";
    const auto took = std::chrono::steady_clock::now() - start;
    const Result<uint32_t> put = future.get();
    EXPECT_FALSE(put.has_value() && *put > 0) << "stored through a node too slow to take it in time";
    EXPECT_LT(took, bound) << i << ": " << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
                           << " ms";
  }
  EXPECT_TRUE((*tier)->counters().breaker_open);
}

uint64_t RssBytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.starts_with("VmRSS:")) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

// A value far longer than its block (64 MiB under a 64 KiB block's key,
// as anyone who can SET under the prefix could write) is refused by its
// length before it is read: a miss, and the reader keeps no memory for it.
// Before, it was read whole, and its buffer kept for good.
TEST(RemoteTierTest, AnOversizedValueIsRefusedUnreadAndKeepsNoMemory) {
  auto redis = MustStart({.maxmemory = "256mb", .standalone = true});
  ASSERT_NE(redis, nullptr);
  auto tier = RemoteTier::Start(Options(redis->seeds()));
  ASSERT_TRUE(tier.has_value()) << tier.error();
  Blocks b(1, 64 << 10);
  SetRaw(redis->node(0), RemoteKey("test:", b.keys[0]), std::string(64 << 20, 'x'));
  std::vector<std::vector<uint8_t>> out;
  const uint64_t before = RssBytes();
  for (int i = 0; i < 3; ++i) {  // each I/O thread, and again
    Result<uint32_t> got = Get(**tier, b, &out);
    ASSERT_TRUE(got.has_value()) << got.error();
    EXPECT_EQ(*got, 0u);
  }
  EXPECT_LT(RssBytes(), before + (16 << 20)) << "a reader buffered the value";
  EXPECT_EQ((*tier)->counters().corrupt, 3u);
  EXPECT_FALSE((*tier)->counters().breaker_open);
  // The block, stored again, is served (the refused connections reconnect).
  ASSERT_EQ(*Put(**tier, b), 1u);
  ASSERT_EQ(*Get(**tier, b, &out), 1u);
  EXPECT_EQ(out[0], b.data[0]);
}

TEST(RemoteTierTest, AnUnreachableSeedAtStartUpIsAMissUntilItAnswers) {
  auto server = MustStart({.standalone = true});
  ASSERT_NE(server, nullptr);
  server->Kill(0);
  auto tier = RemoteTier::Start(Options(server->seeds()));
  ASSERT_TRUE(tier.has_value()) << tier.error() << " (the tier starts without its cluster)";
  Blocks b(3, 1024);
  Result<uint32_t> r = Exists(**tier, b);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), StatusCode::kUnavailable);

  ASSERT_TRUE(server->Restart(0).ok());
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  Result<uint32_t> stored = Put(**tier, b);
  while (!stored && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    stored = Put(**tier, b);
  }
  ASSERT_TRUE(stored.has_value()) << stored.error();
  EXPECT_EQ(*Exists(**tier, b), 3u);
}

TEST(RemoteTierTest, BadOptionsAreRefused) {
  RemoteTierOptions o = Options({});
  EXPECT_EQ(RemoteTier::Start(o).error().code(), StatusCode::kInvalidArgument);
  o = Options({NodeAddress{"127.0.0.1", 1}});
  o.post = nullptr;
  EXPECT_EQ(RemoteTier::Start(o).error().code(), StatusCode::kInvalidArgument);
  o = Options({NodeAddress{"127.0.0.1", 1}});
  o.max_value_bytes = 10;
  EXPECT_EQ(RemoteTier::Start(o).error().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtier
