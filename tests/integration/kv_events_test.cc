// KV events from a real kvtierd (events.enabled), read by a ZMQ subscriber
// and the replay socket of the test's own and decoded with msgpack: what a
// store, a flush, an evict and a restart publish, in order and without gaps.
// It runs under the sanitizers too (the Python tests, which check the events
// against vLLM's classes and in long runs, do not).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <msgpack.hpp>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>

#include "common/block_pattern.h"
#include "kvtier/client.h"
#include "kvtier/shm_kv_cache.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/stats_when.h"

namespace kvtier {
namespace {

using testing::DaemonProcess;
using testing::StatsWhen;

constexpr uint32_t kBlockTokens = 16;

Layout SmallLayout() {
  return Layout::Create(LayoutSpec{.model_id = "kvtier/events", .num_layers = 2, .kv_kind = KvKind::kSeparateKv,
                                   .num_kv_heads = 2, .head_dim = 64, .dtype = DType::kBf16,
                                   .block_tokens = kBlockTokens})
      .value();
}

// One event as a consumer reads it (map encoding, u64 hashes).
struct Event {
  std::string type;
  uint64_t hash = 0;
  std::optional<uint64_t> parent;
  std::vector<uint32_t> tokens;
  std::string medium;
};

struct Batch {
  uint64_t seq = 0;
  std::string topic;
  std::string payload;
};

std::vector<Event> Decode(const std::string& payload) {
  const msgpack::object_handle h = msgpack::unpack(payload.data(), payload.size());
  const msgpack::object& batch = h.get();
  EXPECT_EQ(batch.type, msgpack::type::ARRAY);
  EXPECT_EQ(batch.via.array.size, 3u);
  EXPECT_EQ(batch.via.array.ptr[0].type, msgpack::type::FLOAT64);
  std::vector<Event> out;
  const msgpack::object& events = batch.via.array.ptr[1];
  for (uint32_t i = 0; i < events.via.array.size; ++i) {
    std::map<std::string, msgpack::object> fields;
    events.via.array.ptr[i].convert(fields);
    Event e;
    e.type = fields.at("type").as<std::string>();
    if (e.type != "AllBlocksCleared") {
      const auto hashes = fields.at("block_hashes").as<std::vector<uint64_t>>();
      EXPECT_EQ(hashes.size(), 1u);
      e.hash = hashes.at(0);
      e.medium = fields.at("medium").as<std::string>();
    }
    if (e.type == "BlockStored") {
      if (!fields.at("parent_block_hash").is_nil()) e.parent = fields.at("parent_block_hash").as<uint64_t>();
      e.tokens = fields.at("token_ids").as<std::vector<uint32_t>>();
      EXPECT_EQ(fields.at("block_size").as<uint32_t>(), kBlockTokens);
      EXPECT_TRUE(fields.at("lora_name").is_nil());
    }
    out.push_back(std::move(e));
  }
  return out;
}

uint64_t Seq(const zmq::message_t& m) {
  uint64_t v = 0;
  for (size_t i = 0; i < m.size(); ++i) v = (v << 8) | static_cast<const uint8_t*>(m.data())[i];
  return v;
}

class KvEventsDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kvtier-events-it-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    endpoint_ = "ipc://" + dir_ + "/events";
    replay_ = "ipc://" + dir_ + "/replay";
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::vector<std::string> Settings() const {
    return {"tenants=[{name: local, uid: " + std::to_string(::getuid()) +
                ", admin: true, publish_events: true, model: m}]",
            "events.enabled=true", "events.endpoint=" + endpoint_, "events.replay_endpoint=" + replay_,
            "events.node=n", "events.cadence_ms=2", "tiers.host.bytes=4MiB", "tiers.disk.enabled=true",
            "tiers.disk.bytes=16MiB", "tiers.disk.region_bytes=1MiB"};
  }

  // Every buffered batch from `start` on, through the replay socket.
  std::vector<Batch> Replay(uint64_t start) {
    zmq::socket_t dealer(ctx_, zmq::socket_type::dealer);
    dealer.set(zmq::sockopt::rcvtimeo, 5000);
    dealer.connect(replay_);
    uint8_t be[8];
    for (int i = 0; i < 8; ++i) be[i] = static_cast<uint8_t>(start >> (8 * (7 - i)));
    dealer.send(zmq::message_t(), zmq::send_flags::sndmore);
    dealer.send(zmq::buffer(be, 8), zmq::send_flags::none);
    std::vector<Batch> out;
    while (true) {
      std::vector<zmq::message_t> frames;
      zmq::message_t m;
      do {
        if (!dealer.recv(m)) {
          ADD_FAILURE() << "the replay socket did not answer";
          return out;
        }
        frames.push_back(std::move(m));
      } while (frames.back().more());
      EXPECT_EQ(frames.size(), 4u);
      if (frames.size() != 4 || frames[1].size() == 0) break;  // the end marker has an empty topic
      out.push_back({Seq(frames[2]), frames[1].to_string(), frames[3].to_string()});
    }
    return out;
  }

  std::string dir_, endpoint_, replay_;
  zmq::context_t ctx_;
};

TEST_F(KvEventsDaemonTest, StoresFlushesAndEvictsArePublishedInOrderAndReplayed) {
  Result<DaemonProcess> d = DaemonProcess::Start(Settings());
  ASSERT_TRUE(d.has_value()) << d.error();
  zmq::socket_t sub(ctx_, zmq::socket_type::sub);
  sub.set(zmq::sockopt::subscribe, "");
  sub.set(zmq::sockopt::rcvtimeo, 200);
  sub.connect(endpoint_);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the subscription reaches the publisher

  std::unique_ptr<Client> client =
      Client::Connect({.socket_path = d->socket_path(), .client_name = "events"}).value();
  Result<ShmKvCache> cache = ShmKvCache::Create(SmallLayout(), 64);
  ASSERT_TRUE(cache.has_value()) << cache.error();
  const CacheId id = client->RegisterKvCache(*cache).value();
  constexpr uint32_t kBlocks = 32;
  const std::vector<uint32_t> tokens = PseudoTokens(3, kBlocks * kBlockTokens);
  const std::vector<BlockKey> keys = client->ComputeKeys(id, tokens).value();
  std::vector<uint8_t> hashes(kBlocks * 8);
  std::vector<uint64_t> engine(kBlocks);
  std::vector<uint32_t> ids(kBlocks);
  for (uint32_t i = 0; i < kBlocks; ++i) {
    engine[i] = 0x1000000000000000ull * (i % 15 + 1) + i;  // some past 2^63: sent as uint64
    for (int b = 0; b < 8; ++b) hashes[i * 8 + b] = static_cast<uint8_t>(engine[i] >> (8 * (7 - b)));
    ids[i] = i;
    FillFromKey(keys[i], cache->block(i));
  }
  const BlockEventInfo info{.hash_bytes = 8, .engine_hashes = hashes, .parent_hash = {}, .token_ids = tokens,
                            .block_size = kBlockTokens, .lora_name = {}};
  ASSERT_EQ(client->Store(id, keys, ids, std::nullopt, &info).value().blocks, kBlocks);
  const uint64_t flushed = client->Flush().value();
  EXPECT_EQ(flushed, kBlocks);
  StatsWhen(*client, [&](const DaemonStats& s) { return s.Counter("disk_demotions") >= flushed; });
  EXPECT_EQ(client->Evict().value(), kBlocks);

  // 32 stored in CPU, 32 in DISK, then each removed from both, then the clear.
  const size_t expected = 4 * kBlocks + 1;
  std::vector<Batch> received;
  std::vector<Event> events;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (events.size() < expected && std::chrono::steady_clock::now() < deadline) {
    std::vector<zmq::message_t> frames;
    zmq::message_t m;
    if (!sub.recv(m)) continue;
    frames.push_back(std::move(m));
    while (frames.back().more()) {
      ASSERT_TRUE(sub.recv(m));
      frames.push_back(std::move(m));
    }
    ASSERT_EQ(frames.size(), 3u);
    EXPECT_EQ(frames[0].to_string(), "kv@n@m");
    EXPECT_EQ(frames[1].size(), 8u);
    // The start's clear (seq 0) reaches this subscriber only when the
    // publisher's thread sent it after the subscription arrived: a race of
    // the start, not of the events under test. It is checked in the replay.
    if (Seq(frames[1]) == 0) continue;
    received.push_back({Seq(frames[1]), frames[0].to_string(), frames[2].to_string()});
    for (Event& e : Decode(received.back().payload)) events.push_back(std::move(e));
  }
  ASSERT_EQ(events.size(), expected) << d->Log();
  for (size_t i = 1; i < received.size(); ++i) EXPECT_EQ(received[i].seq, received[i - 1].seq + 1) << "a gap";

  std::vector<uint64_t> stored_cpu, stored_disk, removed_cpu, removed_disk;
  for (const Event& e : events) {
    if (e.type == "BlockStored") (e.medium == "CPU" ? stored_cpu : stored_disk).push_back(e.hash);
    if (e.type == "BlockRemoved") (e.medium == "CPU" ? removed_cpu : removed_disk).push_back(e.hash);
  }
  EXPECT_EQ(stored_cpu, engine) << "stored in key order";
  EXPECT_EQ(stored_disk.size(), kBlocks);
  EXPECT_EQ(removed_cpu.size(), kBlocks);
  EXPECT_EQ(removed_disk.size(), kBlocks);
  EXPECT_EQ(events.back().type, "AllBlocksCleared");
  for (uint32_t i = 0; i < kBlocks; ++i) {
    const Event& e = events[i];
    EXPECT_EQ(e.parent, i == 0 ? std::nullopt : std::optional(engine[i - 1]));
    EXPECT_EQ(e.tokens, std::vector<uint32_t>(tokens.begin() + i * kBlockTokens,
                                              tokens.begin() + (i + 1) * kBlockTokens));
  }

  // The replay socket has the start's clear marker (seq 0) and every batch
  // the subscriber got, byte for byte.
  const std::vector<Batch> replayed = Replay(0);
  ASSERT_EQ(replayed.size(), received.size() + 1);
  EXPECT_EQ(replayed[0].seq, 0u);
  EXPECT_EQ(Decode(replayed[0].payload).at(0).type, "AllBlocksCleared");
  for (size_t i = 0; i < received.size(); ++i) {
    EXPECT_EQ(replayed[i + 1].seq, received[i].seq);
    EXPECT_EQ(replayed[i + 1].payload, received[i].payload);
  }
  // The publisher counts a replay once its replies are sent: the end marker
  // may reach the test first.
  const DaemonStats s = StatsWhen(
      *client, [](const DaemonStats& st) { return st.Counter("events_replays_served") >= 1; });
  EXPECT_EQ(s.Counter("events_published"), expected + 1);
  EXPECT_EQ(s.Counter("events_dropped"), 0u);
  EXPECT_EQ(s.Counter("events_replays_served"), 1u);
  EXPECT_EQ(s.Counter("events_blocks_tracked"), 0u);
}

TEST_F(KvEventsDaemonTest, ARestartPublishesTheDiskTierWithItsMetadata) {
  Result<DaemonProcess> d = DaemonProcess::Start(Settings());
  ASSERT_TRUE(d.has_value()) << d.error();
  constexpr uint32_t kBlocks = 16;
  const std::vector<uint32_t> tokens = PseudoTokens(5, kBlocks * kBlockTokens);
  std::vector<uint8_t> hashes(kBlocks * 8);
  for (size_t i = 0; i < hashes.size(); ++i) hashes[i] = static_cast<uint8_t>(i * 37 + 1);
  {
    std::unique_ptr<Client> client =
        Client::Connect({.socket_path = d->socket_path(), .client_name = "events"}).value();
    Result<ShmKvCache> cache = ShmKvCache::Create(SmallLayout(), 32);
    ASSERT_TRUE(cache.has_value()) << cache.error();
    const CacheId id = client->RegisterKvCache(*cache).value();
    const std::vector<BlockKey> keys = client->ComputeKeys(id, tokens).value();
    std::vector<uint32_t> ids(kBlocks);
    for (uint32_t i = 0; i < kBlocks; ++i) ids[i] = i;
    const BlockEventInfo info{.hash_bytes = 8, .engine_hashes = hashes, .parent_hash = {}, .token_ids = tokens,
                              .block_size = kBlockTokens, .lora_name = {}};
    ASSERT_EQ(client->Store(id, keys, ids, std::nullopt, &info).value().blocks, kBlocks);
  }
  EXPECT_EQ(WEXITSTATUS(d->Stop()), 0);  // a clean stop writes host blocks to disk
  ASSERT_TRUE(d->Restart().ok());
  std::unique_ptr<Client> client = Client::Connect({.socket_path = d->socket_path(), .client_name = "events"}).value();
  StatsWhen(*client, [](const DaemonStats& s) { return s.Counter("events_published") >= kBlocks + 1; });
  std::vector<Event> events;
  for (const Batch& b : Replay(0)) {
    for (Event& e : Decode(b.payload)) events.push_back(std::move(e));
  }
  ASSERT_EQ(events.size(), kBlocks + 1) << d->Log();
  EXPECT_EQ(events[0].type, "AllBlocksCleared");
  std::map<uint64_t, Event> by_hash;
  for (size_t i = 1; i < events.size(); ++i) {
    EXPECT_EQ(events[i].type, "BlockStored");
    EXPECT_EQ(events[i].medium, "DISK");
    by_hash[events[i].hash] = events[i];
  }
  for (uint32_t i = 0; i < kBlocks; ++i) {
    uint64_t h = 0;
    for (int b = 0; b < 8; ++b) h = (h << 8) | hashes[i * 8 + b];
    ASSERT_TRUE(by_hash.contains(h)) << i;
    EXPECT_EQ(by_hash[h].tokens, std::vector<uint32_t>(tokens.begin() + i * kBlockTokens,
                                                       tokens.begin() + (i + 1) * kBlockTokens));
  }
  EXPECT_EQ(client->Stats().value().Counter("events_blocks_tracked"), kBlocks);
}

TEST_F(KvEventsDaemonTest, AnEndpointThatCannotBeBoundStopsStartUp) {
  // A port held by the test: kvtierd cannot bind it.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(::listen(fd, 1), 0);
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  std::vector<std::string> settings = Settings();
  settings.push_back("events.endpoint=tcp://127.0.0.1:" + std::to_string(ntohs(a.sin_port)));
  Result<DaemonProcess> d = DaemonProcess::Start(settings);
  ::close(fd);
  ASSERT_FALSE(d.has_value()) << "kvtierd started with its events endpoint in use";
  EXPECT_NE(d.error().message().find("tcp://127.0.0.1:" + std::to_string(ntohs(a.sin_port))), std::string::npos)
      << d.error();
}

}  // namespace
}  // namespace kvtier
