// KvEventPublisher: sends KV events (daemon/kv_events.h) to KV-aware routers
// as vLLM's ZmqEventPublisher does (0.33.0): a ZMQ PUB socket, each message
// three frames (topic, an 8-byte big-endian sequence number, a msgpack
// batch), and an optional ROUTER socket for replay. A client (a DEALER)
// sends ["", start sequence]; it gets each buffered batch from that sequence
// on as ["", topic, sequence, batch], then ["", "", eight 0xff bytes, ""].
//
// The caller (kvtierd's event loop) only queues events: Publish takes a lock
// for a push and never waits on the network. A thread of the publisher's own
// makes batches on a bounded cadence (at most max_batch_events each), sends
// them, keeps the last buffer_batches for replay and answers replay
// requests. Events beyond the queue's bound are dropped and counted, as are
// batches the PUB socket drops (its high-water mark).
//
// The socket is an XPUB (a PUB that shows who subscribes): at start, batches
// wait for subscribers to come back (subscriber_grace), so that a restart's
// AllBlocksCleared and snapshot reach the routers that were listening.
//
// A replay request may name a topic prefix in a third frame (["", start,
// prefix]): it gets only the batches whose topic starts with it, as a SUB
// subscribed to it would. A replay ends at the sequence that was next when
// it was asked. Replays are answered a slice at a time, after each turn's
// live batches: at most replay_batches_per_turn batches looked at per turn
// and replay_bytes_per_second resent, so no flood of requests starves the
// live stream or the queue; at most max_pending_replays wait (more are
// refused unanswered and counted: the client asks again).
//
// Thread-safe: Publish and counters from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/status.h"
#include "daemon/kv_events.h"

namespace kvtier {

struct KvEventPublisherOptions {
  std::string endpoint = "tcp://127.0.0.1:5557";  // PUB, bound
  std::string replay_endpoint = "";               // ROUTER, bound; empty: no replay
  KvEventEncoding encoding;
  std::optional<int32_t> dp_rank = std::nullopt;
  std::chrono::milliseconds cadence{10};  // a batch at most this long after its first event
  uint32_t max_batch_events = 1024;
  size_t max_queued_events = 100000;  // more are dropped, counted
  size_t buffer_batches = 10000;      // kept for replay...
  size_t buffer_bytes = 64 << 20;     // ... and at most this many payload bytes
  int send_high_water_mark = 100000;  // PUB messages queued per subscriber
  // At start, batches wait until subscribers are back: until a
  // subscription arrived and none for kSubscriberSettle, or this long
  // (0: no wait). A subscriber that was connected to the kvtierd before
  // reconnects on its own (ZMQ), and so gets its AllBlocksCleared and
  // snapshot live instead of losing them before it is back.
  std::chrono::milliseconds subscriber_grace{1000};
  size_t replay_batches_per_turn = 256;
  uint64_t replay_bytes_per_second = uint64_t{256} << 20;
  size_t max_pending_replays = 64;
};

struct KvEventPublisherCounters {
  uint64_t events_published = 0;  // sent in a batch
  uint64_t events_dropped = 0;    // the queue was full
  uint64_t batches_published = 0;
  uint64_t replays_served = 0;    // replay requests answered
  uint64_t replay_batches = 0;    // batches resent by them
  uint64_t replays_refused = 0;   // requests beyond max_pending_replays, or malformed
};

class KvEventPublisher {
 public:
  static constexpr std::chrono::milliseconds kSubscriberSettle{100};
  // Binds the sockets. Errors: kInvalidArgument for options out of range,
  // kUnavailable when an endpoint cannot be bound (its text in the message).
  static Result<std::unique_ptr<KvEventPublisher>> Start(KvEventPublisherOptions options);
  // Sends what is queued, then stops the thread and closes the sockets.
  ~KvEventPublisher();
  KvEventPublisher(const KvEventPublisher&) = delete;
  KvEventPublisher& operator=(const KvEventPublisher&) = delete;

  // Queues `event` under `topic`; false (and counted) when the queue is full.
  bool Publish(std::string topic, KvEvent event);
  // As Publish, but waits for room instead of dropping: for a snapshot taken
  // before kvtierd serves (millions of blocks after a restart must not
  // overflow the queue). Never on a path that serves requests.
  void PublishWaiting(std::string topic, KvEvent event);
  KvEventPublisherCounters counters() const;
  // The sequence number the next batch gets (0 after start).
  uint64_t next_sequence() const { return next_seq_.load(); }

 private:
  struct Sockets;
  KvEventPublisher(KvEventPublisherOptions options, std::unique_ptr<Sockets> sockets);
  void Loop();
  // Batches and sends what is queued (publisher thread).
  void SendQueued();
  // Reads the (un)subscriptions the XPUB socket passes up; ends the
  // start's grace once they settle.
  void TakeSubscriptions();
  // Takes the replay requests waiting on the ROUTER socket into replays_.
  void TakeReplayRequests();
  // Resends a slice of the pending replays, in turn, within the turn's and
  // the second's budgets; true while some wait for budget or their turn.
  bool ServeReplaySlice();

  const KvEventPublisherOptions options_;
  std::unique_ptr<Sockets> sockets_;  // used by the publisher thread only (after Start)
  mutable std::mutex mu_;
  std::condition_variable room_;  // the publisher thread took what was queued
  std::vector<std::pair<std::string, KvEvent>> queue_;  // under mu_
  bool stopping_ = false;                                // under mu_
  KvEventPublisherCounters counters_;                    // under mu_
  std::atomic<uint64_t> next_seq_{0};
  // The last batches within buffer_batches and buffer_bytes, publisher
  // thread only.
  struct SentBatch {
    uint64_t seq;
    std::string topic;
    std::string payload;
  };
  std::deque<SentBatch> sent_;
  size_t sent_bytes_ = 0;
  // Replays being answered, publisher thread only: who asked, the next
  // sequence to look at, where the replay ends and the topic prefix.
  struct PendingReplay {
    std::string identity;
    uint64_t next = 0;
    uint64_t end = 0;
    std::string prefix;
  };
  std::deque<PendingReplay> replays_;
  // The start's grace (publisher thread only): batches wait until then, or
  // until subscriptions settle.
  bool holding_ = true;
  std::chrono::steady_clock::time_point grace_ends_{};
  std::optional<std::chrono::steady_clock::time_point> last_subscription_;
  double replay_tokens_ = 0;  // bytes that may be resent now
  std::chrono::steady_clock::time_point replay_refilled_{};
  std::thread thread_;
};

}  // namespace kvtier
