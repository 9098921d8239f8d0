#include "daemon/kv_event_publisher.h"

#include <spdlog/spdlog.h>

#include <array>
#include <map>
#include <zmq.hpp>

namespace kvtier {

struct KvEventPublisher::Sockets {
  zmq::context_t context{1};
  zmq::socket_t pub{context, zmq::socket_type::xpub};
  std::optional<zmq::socket_t> router;
};

namespace {

constexpr std::array<uint8_t, 8> kEndOfReplay = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};

std::array<uint8_t, 8> BigEndian(uint64_t v) {
  std::array<uint8_t, 8> out{};
  for (size_t i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(v >> (56 - 8 * i));
  return out;
}

double WallSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

Result<std::unique_ptr<KvEventPublisher>> KvEventPublisher::Start(KvEventPublisherOptions options) {
  if (options.max_batch_events == 0 || options.max_queued_events == 0 || options.buffer_batches == 0 ||
      options.buffer_bytes == 0 || options.cadence.count() <= 0 || options.send_high_water_mark <= 0 ||
      options.replay_batches_per_turn == 0 || options.replay_bytes_per_second == 0 ||
      options.max_pending_replays == 0) {
    return Err(InvalidArgument(
        "events: batch size, queue, buffer, cadence, high-water mark and replay budgets must be > 0"));
  }
  auto sockets = std::make_unique<Sockets>();
  try {
    sockets->pub.set(zmq::sockopt::sndhwm, options.send_high_water_mark);
    sockets->pub.set(zmq::sockopt::linger, 0);
    sockets->pub.set(zmq::sockopt::xpub_verbose, 1);  // every subscription, also a repeated one
    sockets->pub.bind(options.endpoint);
    if (!options.replay_endpoint.empty()) {
      sockets->router.emplace(sockets->context, zmq::socket_type::router);
      sockets->router->set(zmq::sockopt::linger, 0);
      sockets->router->bind(options.replay_endpoint);
    }
  } catch (const zmq::error_t& e) {
    return Err(StatusCode::kUnavailable, "events: binding " + options.endpoint +
                                             (options.replay_endpoint.empty() ? "" : " and " + options.replay_endpoint) +
                                             ": " + e.what());
  }
  std::unique_ptr<KvEventPublisher> publisher(new KvEventPublisher(std::move(options), std::move(sockets)));
  publisher->thread_ = std::thread([p = publisher.get()] { p->Loop(); });
  return publisher;
}

KvEventPublisher::KvEventPublisher(KvEventPublisherOptions options, std::unique_ptr<Sockets> sockets)
    : options_(std::move(options)), sockets_(std::move(sockets)) {}

KvEventPublisher::~KvEventPublisher() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

bool KvEventPublisher::Publish(std::string topic, KvEvent event) {
  std::lock_guard lock(mu_);
  if (queue_.size() >= options_.max_queued_events) {
    ++counters_.events_dropped;
    return false;
  }
  queue_.emplace_back(std::move(topic), std::move(event));
  return true;
}

void KvEventPublisher::PublishWaiting(std::string topic, KvEvent event) {
  std::unique_lock lock(mu_);
  room_.wait(lock, [&] { return queue_.size() < options_.max_queued_events || stopping_; });
  queue_.emplace_back(std::move(topic), std::move(event));
}

KvEventPublisherCounters KvEventPublisher::counters() const {
  std::lock_guard lock(mu_);
  return counters_;
}

void KvEventPublisher::Loop() {
  replay_refilled_ = std::chrono::steady_clock::now();
  replay_tokens_ = static_cast<double>(options_.replay_bytes_per_second);
  grace_ends_ = replay_refilled_ + options_.subscriber_grace;
  holding_ = options_.subscriber_grace.count() > 0;
  bool replaying = false;  // replays wait for their next slice
  while (true) {
    bool stopping = false;
    {
      std::lock_guard lock(mu_);
      stopping = stopping_;
    }
    // Subscriptions and replay requests are taken between batches. While
    // replays wait, a short wait: their next slice comes after this turn's
    // live batches.
    std::array<zmq::pollitem_t, 2> items{zmq::pollitem_t{sockets_->pub.handle(), 0, ZMQ_POLLIN, 0},
                                         zmq::pollitem_t{nullptr, 0, ZMQ_POLLIN, 0}};
    size_t n = 1;
    if (sockets_->router) items[n++].socket = sockets_->router->handle();
    zmq::poll(items.data(), n, replaying || holding_ ? std::chrono::milliseconds(1) : options_.cadence);
    if ((items[0].revents & ZMQ_POLLIN) != 0) TakeSubscriptions();
    if (n > 1 && (items[1].revents & ZMQ_POLLIN) != 0) TakeReplayRequests();
    if (holding_) {
      const auto now = std::chrono::steady_clock::now();
      holding_ = now < grace_ends_ && !(last_subscription_ && now - *last_subscription_ >= kSubscriberSettle);
    }
    if (!holding_ || stopping) SendQueued();  // live first
    if (sockets_->router) replaying = ServeReplaySlice();
    if (stopping) return;
  }
}

void KvEventPublisher::TakeSubscriptions() {
  // [1 or 0, topic prefix]: a subscription or its end; the first kind ends
  // the start's grace once they settle.
  for (int taken = 0; taken < 1024; ++taken) {
    zmq::message_t m;
    if (!sockets_->pub.recv(m, zmq::recv_flags::dontwait)) return;
    if (m.size() >= 1 && m.data<uint8_t>()[0] == 1) last_subscription_ = std::chrono::steady_clock::now();
  }
}

void KvEventPublisher::SendQueued() {
  std::vector<std::pair<std::string, KvEvent>> taken;
  {
    std::lock_guard lock(mu_);
    taken.swap(queue_);
  }
  room_.notify_all();
  if (taken.empty()) return;
  // One batch per topic (in the order of each topic's first event), split at
  // max_batch_events.
  std::map<std::string, std::vector<KvEvent>> by_topic;
  std::vector<const std::string*> order;
  for (auto& [topic, event] : taken) {
    auto [it, first] = by_topic.try_emplace(topic);
    if (first) order.push_back(&it->first);
    it->second.push_back(std::move(event));
  }
  uint64_t published = 0, batches = 0;
  const double ts = WallSeconds();
  for (const std::string* topic : order) {
    const std::vector<KvEvent>& events = by_topic[*topic];
    for (size_t at = 0; at < events.size(); at += options_.max_batch_events) {
      const size_t n = std::min<size_t>(options_.max_batch_events, events.size() - at);
      std::string payload =
          EncodeKvEventBatch(ts, std::span(events).subspan(at, n), options_.dp_rank, options_.encoding);
      const uint64_t seq = next_seq_.fetch_add(1);
      const std::array<uint8_t, 8> seq_bytes = BigEndian(seq);
      // PUB never blocks: past its high-water mark a subscriber's messages
      // are dropped by ZMQ (a gap it sees, and replays).
      try {
        sockets_->pub.send(zmq::buffer(*topic), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
        sockets_->pub.send(zmq::buffer(seq_bytes), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
        sockets_->pub.send(zmq::buffer(payload), zmq::send_flags::dontwait);
      } catch (const zmq::error_t& e) {
        spdlog::warn("events: sending batch {}: {}", seq, e.what());
      }
      sent_bytes_ += payload.size();
      sent_.push_back(SentBatch{.seq = seq, .topic = *topic, .payload = std::move(payload)});
      while (sent_.size() > options_.buffer_batches || (sent_bytes_ > options_.buffer_bytes && sent_.size() > 1)) {
        sent_bytes_ -= sent_.front().payload.size();
        sent_.pop_front();
      }
      published += n;
      ++batches;
    }
  }
  std::lock_guard lock(mu_);
  counters_.events_published += published;
  counters_.batches_published += batches;
}

void KvEventPublisher::TakeReplayRequests() {
  zmq::socket_t& router = *sockets_->router;
  uint64_t refused = 0;
  // At most a turn's worth of requests are read now; more wait in ZMQ.
  for (size_t taken = 0; taken < options_.replay_batches_per_turn; ++taken) {
    // [identity, "", start_seq (8 bytes, big endian)] and an optional topic prefix.
    std::vector<zmq::message_t> frames;
    zmq::message_t frame;
    if (!router.recv(frame, zmq::recv_flags::dontwait)) break;
    frames.push_back(std::move(frame));
    while (frames.back().more()) {
      zmq::message_t next;
      if (!router.recv(next, zmq::recv_flags::none)) break;
      frames.push_back(std::move(next));
    }
    if ((frames.size() != 3 && frames.size() != 4) || frames[2].size() != 8) {
      ++refused;
      spdlog::warn("events: a replay request of {} frames ignored (expected identity, empty, start sequence, "
                   "and maybe a topic prefix)",
                   frames.size());
      continue;
    }
    if (replays_.size() >= options_.max_pending_replays) {
      ++refused;  // unanswered: the client asks again
      continue;
    }
    uint64_t start = 0;
    for (size_t i = 0; i < 8; ++i) start = (start << 8) | frames[2].data<uint8_t>()[i];
    replays_.push_back(PendingReplay{.identity = frames[0].to_string(),
                                     .next = start,
                                     .end = next_seq_.load(),
                                     .prefix = frames.size() == 4 ? frames[3].to_string() : std::string()});
  }
  if (refused > 0) {
    std::lock_guard lock(mu_);
    counters_.replays_refused += refused;
  }
}

bool KvEventPublisher::ServeReplaySlice() {
  if (replays_.empty()) return false;
  const auto now = std::chrono::steady_clock::now();
  const auto rate = static_cast<double>(options_.replay_bytes_per_second);
  replay_tokens_ =
      std::min(rate, replay_tokens_ + rate * std::chrono::duration<double>(now - replay_refilled_).count());
  replay_refilled_ = now;
  zmq::socket_t& router = *sockets_->router;
  uint64_t served = 0, resent = 0;
  size_t looked = 0;
  // Each pending replay in turn gets a share of this turn's budget.
  const size_t share = std::max<size_t>(1, options_.replay_batches_per_turn / replays_.size());
  for (size_t turns = replays_.size(); turns > 0 && looked < options_.replay_batches_per_turn &&
                                       replay_tokens_ > 0;
       --turns) {
    PendingReplay r = std::move(replays_.front());
    replays_.pop_front();
    auto reply = [&](std::string_view topic, std::span<const uint8_t> seq, std::string_view payload) {
      // dontwait: a client that does not read loses replies (ROUTER drops
      // past its high-water mark), never this thread's time.
      router.send(zmq::buffer(r.identity), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
      router.send(zmq::const_buffer(nullptr, 0), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
      router.send(zmq::buffer(topic), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
      router.send(zmq::buffer(seq.data(), seq.size()), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
      router.send(zmq::buffer(payload), zmq::send_flags::dontwait);
    };
    try {
      const uint64_t first = sent_.empty() ? next_seq_.load() : sent_.front().seq;
      r.next = std::max(r.next, first);  // what left the buffer is gone
      for (size_t mine = 0; r.next < r.end && mine < share && replay_tokens_ > 0; ++mine, ++r.next, ++looked) {
        const size_t at = r.next - first;  // sequences in the buffer are contiguous
        if (at >= sent_.size()) {
          r.next = r.end;
          break;
        }
        const SentBatch& b = sent_[at];
        if (!b.topic.starts_with(r.prefix)) continue;
        reply(b.topic, BigEndian(b.seq), b.payload);
        replay_tokens_ -= static_cast<double>(b.payload.size() + b.topic.size());
        ++resent;
      }
      if (r.next >= r.end) {
        reply("", kEndOfReplay, "");
        ++served;
        continue;
      }
    } catch (const zmq::error_t& e) {
      spdlog::warn("events: answering a replay request: {}", e.what());
      continue;
    }
    replays_.push_back(std::move(r));
  }
  std::lock_guard lock(mu_);
  counters_.replays_served += served;
  counters_.replay_batches += resent;
  return !replays_.empty();
}

}  // namespace kvtier
