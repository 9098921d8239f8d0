// KvEventPublisher against real ZMQ sockets of the test's own: a SUB sees
// each batch as three frames (topic, big-endian sequence, msgpack batch) in
// order; a REQ gets buffered batches again from a sequence number, then the
// end marker; a full queue drops and counts, never blocks.
#include "daemon/kv_event_publisher.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <optional>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>

namespace kvtier {
namespace {

std::string Endpoint(const std::string& name) {
  return "ipc:///tmp/kvtier-events-test-" + std::to_string(::getpid()) + "-" + name;
}

KvEvent Removed(uint64_t hash) {
  return BlockRemovedEvent{.block_hashes = {EngineBlockHash::FromU64(hash)}, .medium = KvEventMedium::kDisk};
}

uint64_t Sequence(const zmq::message_t& m) {
  uint64_t v = 0;
  for (size_t i = 0; i < m.size(); ++i) v = (v << 8) | m.data<uint8_t>()[i];
  return v;
}

// The payload's events, as the encoder makes them (ts aside): the payload
// from its 10th byte (after 93 cb <8-byte ts>) must equal a fresh encoding's.
std::string AfterTs(const std::string& payload) { return payload.substr(10); }

// Sends a replay request from `start` (with a topic prefix frame unless
// null) on `dealer`; returns each batch resent, or nullopt when no end
// marker came.
struct Replayed {
  std::string topic;
  uint64_t seq = 0;
  std::string payload;
};
std::optional<std::vector<Replayed>> Replay(zmq::socket_t& dealer, uint64_t start, const char* prefix) {
  std::array<uint8_t, 8> start_bytes{};
  for (size_t i = 0; i < 8; ++i) start_bytes[i] = static_cast<uint8_t>(start >> (56 - 8 * i));
  dealer.send(zmq::const_buffer(nullptr, 0), zmq::send_flags::sndmore);
  if (prefix == nullptr) {
    dealer.send(zmq::buffer(start_bytes));
  } else {
    dealer.send(zmq::buffer(start_bytes), zmq::send_flags::sndmore);
    dealer.send(zmq::buffer(std::string(prefix)));
  }
  std::vector<Replayed> got;
  while (true) {
    zmq::message_t empty, topic, seq, payload;
    if (!dealer.recv(empty) || !dealer.recv(topic) || !dealer.recv(seq) || !dealer.recv(payload)) return std::nullopt;
    EXPECT_EQ(empty.size(), 0u);
    if (seq.to_string() == std::string(8, '\xff')) {
      EXPECT_EQ(topic.size() + payload.size(), 0u);
      return got;
    }
    got.push_back(Replayed{.topic = topic.to_string(), .seq = Sequence(seq), .payload = payload.to_string()});
  }
}

// Until the publisher has given `n` sequence numbers (sent n batches), at
// most `limit`.
void WaitForSequence(const KvEventPublisher& publisher, uint64_t n, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (publisher.next_sequence() < n && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// PUB/SUB: a subscriber misses what is sent before its subscription arrives.
// Publishes warm-up events on `topic` until one comes through `sub`.
::testing::AssertionResult WarmUp(zmq::socket_t& sub, KvEventPublisher& publisher, const std::string& topic) {
  sub.set(zmq::sockopt::rcvtimeo, 50);
  for (int i = 0; i < 200; ++i) {
    if (!publisher.Publish(topic, Removed(0))) return ::testing::AssertionFailure() << "the queue refused a warm-up";
    zmq::message_t m;
    if (sub.recv(m)) {
      while (m.more()) {
        if (!sub.recv(m)) return ::testing::AssertionFailure() << "a warm-up's frames were cut";
      }
      return ::testing::AssertionSuccess();
    }
  }
  return ::testing::AssertionFailure() << "no warm-up event came through";
}

TEST(KvEventPublisherTest, ASubscriberSeesOrderedBatchesOfThreeFrames) {
  KvEventPublisherOptions o;
  o.endpoint = Endpoint("pub");
  o.cadence = std::chrono::milliseconds(5);
  o.max_batch_events = 2;
  Result<std::unique_ptr<KvEventPublisher>> publisher = KvEventPublisher::Start(o);
  ASSERT_TRUE(publisher.has_value()) << publisher.error();
  zmq::context_t context;
  zmq::socket_t sub(context, zmq::socket_type::sub);
  sub.set(zmq::sockopt::subscribe, "kv@node-a");
  sub.set(zmq::sockopt::rcvtimeo, 5000);
  sub.connect(o.endpoint);
  ASSERT_TRUE(WarmUp(sub, **publisher, "kv@node-a@warm-up"));  // the test's own follow
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the last warm-ups are sent
  const uint64_t base = (*publisher)->next_sequence();
  const KvEventPublisherCounters before = (*publisher)->counters();
  sub.set(zmq::sockopt::rcvtimeo, 5000);
  auto next_message = [&](std::vector<zmq::message_t>* frames) {  // the test's own, warm-ups skipped
    while (true) {
      frames->clear();
      do {
        frames->emplace_back();
        if (!sub.recv(frames->back())) return false;
      } while (frames->back().more());
      if (frames->front().to_string() != "kv@node-a@warm-up") return true;
    }
  };

  for (uint64_t h = 1; h <= 5; ++h) ASSERT_TRUE((*publisher)->Publish("kv@node-a@m", Removed(h)));
  ASSERT_TRUE((*publisher)->Publish("other", Removed(99)));  // not subscribed
  // 5 events in batches of at most 2: 3 batches, in order, each [ts, [events], nil].
  for (uint64_t batch = 0; batch < 3; ++batch) {
    std::vector<zmq::message_t> frames;
    ASSERT_TRUE(next_message(&frames));
    ASSERT_EQ(frames.size(), 3u);
    const zmq::message_t& topic = frames[0];
    const zmq::message_t& seq = frames[1];
    const zmq::message_t& payload = frames[2];
    EXPECT_EQ(topic.to_string(), "kv@node-a@m");
    EXPECT_EQ(seq.size(), 8u);
    EXPECT_EQ(Sequence(seq), base + batch);
    std::vector<KvEvent> expected;
    for (uint64_t h = 1 + 2 * batch; h <= std::min<uint64_t>(5, 2 + 2 * batch); ++h) expected.push_back(Removed(h));
    EXPECT_EQ(AfterTs(payload.to_string()), AfterTs(EncodeKvEventBatch(0, expected, std::nullopt, {})));
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while ((*publisher)->counters().events_published < before.events_published + 6 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ((*publisher)->counters().events_published, before.events_published + 6);
  EXPECT_EQ((*publisher)->counters().batches_published, before.batches_published + 4);
  EXPECT_EQ((*publisher)->next_sequence(), base + 4);
}

TEST(KvEventPublisherTest, TheReplaySocketResendsFromASequenceThenTheEndMarker) {
  KvEventPublisherOptions o;
  o.endpoint = Endpoint("pub2");
  o.replay_endpoint = Endpoint("replay");
  o.cadence = std::chrono::milliseconds(5);
  o.max_batch_events = 1;
  o.buffer_batches = 4;  // the oldest of 6 are gone
  Result<std::unique_ptr<KvEventPublisher>> publisher = KvEventPublisher::Start(o);
  ASSERT_TRUE(publisher.has_value()) << publisher.error();
  for (uint64_t h = 0; h < 6; ++h) ASSERT_TRUE((*publisher)->Publish("t", Removed(h)));
  WaitForSequence(**publisher, 6, std::chrono::seconds(5));
  ASSERT_EQ((*publisher)->next_sequence(), 6u);

  zmq::context_t context;
  zmq::socket_t dealer(context, zmq::socket_type::dealer);
  dealer.set(zmq::sockopt::rcvtimeo, 5000);
  dealer.connect(o.replay_endpoint);
  auto replay_from = [&](uint64_t start) {
    std::optional<std::vector<Replayed>> got = Replay(dealer, start, nullptr);
    std::vector<uint64_t> seqs;
    if (!got) {
      ADD_FAILURE() << "no reply";
      return seqs;
    }
    for (const Replayed& r : *got) {
      EXPECT_EQ(r.topic, "t");
      EXPECT_EQ(AfterTs(r.payload),
                AfterTs(EncodeKvEventBatch(0, std::vector<KvEvent>{Removed(r.seq)}, std::nullopt, {})));
      seqs.push_back(r.seq);
    }
    return seqs;
  };
  EXPECT_EQ(replay_from(3), (std::vector<uint64_t>{3, 4, 5}));
  EXPECT_EQ(replay_from(0), (std::vector<uint64_t>{2, 3, 4, 5})) << "what is left of 0 and on";
  EXPECT_EQ(replay_from(6), (std::vector<uint64_t>{}));
  // Counted once a request's replies are sent: the client may see them first.
  const auto counted = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while ((*publisher)->counters().replays_served < 3 && std::chrono::steady_clock::now() < counted) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ((*publisher)->counters().replays_served, 3u);
  EXPECT_EQ((*publisher)->counters().replay_batches, 7u);
}

// A replay names a topic prefix as a subscription does: it gets only that
// prefix's batches (before: every topic's, other tenants' token ids too).
TEST(KvEventPublisherTest, AReplayWithATopicPrefixGetsOnlyThatPrefixsBatches) {
  KvEventPublisherOptions o;
  o.endpoint = Endpoint("pub4");
  o.replay_endpoint = Endpoint("replay4");
  o.cadence = std::chrono::milliseconds(5);
  o.max_batch_events = 1;
  Result<std::unique_ptr<KvEventPublisher>> publisher = KvEventPublisher::Start(o);
  ASSERT_TRUE(publisher.has_value()) << publisher.error();
  for (uint64_t h = 0; h < 6; ++h) ASSERT_TRUE((*publisher)->Publish(h % 2 == 0 ? "kv@a@m" : "kv@b@m", Removed(h)));
  WaitForSequence(**publisher, 6, std::chrono::seconds(5));
  zmq::context_t context;
  zmq::socket_t dealer(context, zmq::socket_type::dealer);
  dealer.set(zmq::sockopt::rcvtimeo, 5000);
  dealer.connect(o.replay_endpoint);
  auto a = Replay(dealer, 0, "kv@a");
  ASSERT_TRUE(a.has_value());
  ASSERT_EQ(a->size(), 3u);
  for (const Replayed& r : *a) EXPECT_EQ(r.topic, "kv@a@m") << r.seq;
  auto all = Replay(dealer, 0, nullptr);
  ASSERT_TRUE(all.has_value());
  EXPECT_EQ(all->size(), 6u) << "no prefix: every topic, as vLLM's replay";
}

// DEALERs that ask for the whole buffer again and again cannot starve the
// live stream: live batches keep their pace, and requests beyond what the
// publisher serves at once are refused (before: every request resent the
// whole buffer in one go, between two turns of live sending).
TEST(KvEventPublisherTest, AFloodOfReplaysDoesNotStarveLiveBatches) {
  KvEventPublisherOptions o;
  o.endpoint = Endpoint("pub5");
  o.replay_endpoint = Endpoint("replay5");
  o.cadence = std::chrono::milliseconds(2);
  o.max_batch_events = 1;
  o.buffer_batches = 1000;
  o.buffer_bytes = size_t{256} << 20;
  o.max_queued_events = 1 << 20;
  Result<std::unique_ptr<KvEventPublisher>> publisher = KvEventPublisher::Start(o);
  ASSERT_TRUE(publisher.has_value()) << publisher.error();
  // A full buffer of fat batches (4096 hashes each, about 37 KiB: 37 MiB).
  BlockRemovedEvent fat{.block_hashes = {}, .medium = KvEventMedium::kDisk};
  for (uint64_t h = 0; h < 4096; ++h) fat.block_hashes.push_back(EngineBlockHash::FromU64(h));
  for (int i = 0; i < 1000; ++i) (*publisher)->PublishWaiting("kv@old@m", fat);
  WaitForSequence(**publisher, 1000, std::chrono::seconds(60));
  ASSERT_EQ((*publisher)->next_sequence(), 1000u);

  zmq::context_t context;
  zmq::socket_t sub(context, zmq::socket_type::sub);
  sub.set(zmq::sockopt::subscribe, "kv@live");
  sub.connect(o.endpoint);
  ASSERT_TRUE(WarmUp(sub, **publisher, "kv@live@warm-up"));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  sub.set(zmq::sockopt::rcvtimeo, 0);
  while (true) {  // the warm-ups still on their way
    zmq::message_t m;
    if (!sub.recv(m)) break;
    while (m.more()) ASSERT_TRUE(sub.recv(m).has_value());
  }

  // 16 DEALERs ask for the whole buffer every millisecond and never read.
  std::atomic<bool> flooding{true};
  std::vector<std::thread> dealers;
  for (int d = 0; d < 16; ++d) {
    dealers.emplace_back([&] {
      zmq::socket_t dealer(context, zmq::socket_type::dealer);
      dealer.set(zmq::sockopt::linger, 0);
      dealer.set(zmq::sockopt::sndtimeo, 100);
      dealer.connect(o.replay_endpoint);
      const std::array<uint8_t, 8> from_zero{};
      while (flooding) {
        (void)dealer.send(zmq::const_buffer(nullptr, 0), zmq::send_flags::sndmore);
        (void)dealer.send(zmq::buffer(from_zero));
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the flood is on
  // Live events every 5 ms for 2 s; the largest gap between two arrivals.
  constexpr int kLive = 400;
  std::thread live([&] {
    for (int i = 0; i < kLive; ++i) {
      EXPECT_TRUE((*publisher)->Publish("kv@live@m", Removed(static_cast<uint64_t>(i))));
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });
  sub.set(zmq::sockopt::rcvtimeo, 5000);
  int received = 0;
  auto last = std::chrono::steady_clock::now();
  std::chrono::steady_clock::duration worst{};
  for (; received < kLive; ++received) {
    zmq::message_t m;
    if (!sub.recv(m)) break;
    while (m.more()) ASSERT_TRUE(sub.recv(m).has_value());
    const auto now = std::chrono::steady_clock::now();
    if (received > 0) worst = std::max(worst, now - last);
    last = now;
  }
  live.join();
  flooding = false;
  for (std::thread& t : dealers) t.join();
  EXPECT_EQ(received, kLive);
  std::printf("largest gap between live batches: %.1f ms\n", std::chrono::duration<double, std::milli>(worst).count());
  // 5 ms apart when sent; the bound leaves room for sanitizers' pace.
  EXPECT_LT(worst, std::chrono::milliseconds(250))
      << "live batches waited on replays: " << std::chrono::duration<double, std::milli>(worst).count() << " ms";
  EXPECT_GT((*publisher)->counters().replay_batches, 0u);
  EXPECT_GT((*publisher)->counters().replays_refused, 0u) << "more requests than it serves at once";
}

TEST(KvEventPublisherTest, AFullQueueDropsAndCountsWithoutBlocking) {
  KvEventPublisherOptions o;
  o.endpoint = Endpoint("pub3");
  o.cadence = std::chrono::milliseconds(1000);  // nothing drains the queue meanwhile
  o.max_queued_events = 100;
  Result<std::unique_ptr<KvEventPublisher>> publisher = KvEventPublisher::Start(o);
  ASSERT_TRUE(publisher.has_value()) << publisher.error();
  uint32_t accepted = 0;
  const auto start = std::chrono::steady_clock::now();
  for (uint64_t h = 0; h < 10000; ++h) accepted += (*publisher)->Publish("t", Removed(h)) ? 1 : 0;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(500));
  EXPECT_LE(accepted, 200u);  // at most a drain's worth more than the bound
  EXPECT_GE((*publisher)->counters().events_dropped, 10000u - accepted);
}

TEST(KvEventPublisherTest, BadOptionsAndEndpointsAreRefused) {
  KvEventPublisherOptions o;
  o.endpoint = "tcp://no-such-host.invalid:1";
  Result<std::unique_ptr<KvEventPublisher>> p = KvEventPublisher::Start(o);
  ASSERT_FALSE(p.has_value());
  EXPECT_EQ(p.error().code(), StatusCode::kUnavailable);
  o.endpoint = Endpoint("pub4");
  o.max_batch_events = 0;
  p = KvEventPublisher::Start(o);
  ASSERT_FALSE(p.has_value());
  EXPECT_EQ(p.error().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtier
