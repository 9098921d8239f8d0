#include "tools/bench_events.h"

#include <unistd.h>
#include <zmq.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <memory>
#include <thread>

#include "kvtier/shm_kv_cache.h"
#include "tools/bench_report.h"

namespace kvtier::bench {
namespace {

// A subscriber that reads every batch and checks the sequence numbers.
class Subscriber {
 public:
  explicit Subscriber(const std::string& endpoint) : ctx_(zmq_ctx_new()) {
    sub_ = zmq_socket(ctx_, ZMQ_SUB);
    const int timeout_ms = 50;
    zmq_setsockopt(sub_, ZMQ_RCVTIMEO, &timeout_ms, sizeof(timeout_ms));
    zmq_setsockopt(sub_, ZMQ_SUBSCRIBE, "", 0);
    zmq_connect(sub_, endpoint.c_str());
    thread_ = std::thread([this] { Run(); });
  }
  ~Subscriber() {
    stop_ = true;
    thread_.join();
    zmq_close(sub_);
    zmq_ctx_term(ctx_);
  }
  uint64_t batches() const { return batches_.load(); }
  uint64_t bytes() const { return bytes_.load(); }
  uint64_t gaps() const { return gaps_.load(); }

 private:
  void Run() {
    int64_t last = -1;
    while (!stop_) {
      zmq_msg_t frames[3];
      int n = 0;
      bool more = true;
      while (more && n < 3) {
        zmq_msg_init(&frames[n]);
        if (zmq_msg_recv(&frames[n], sub_, 0) < 0) {
          zmq_msg_close(&frames[n]);
          break;
        }
        more = zmq_msg_more(&frames[n]) != 0;
        ++n;
      }
      if (n == 3 && zmq_msg_size(&frames[1]) == 8) {
        const auto* p = static_cast<const uint8_t*>(zmq_msg_data(&frames[1]));
        int64_t seq = 0;
        for (int i = 0; i < 8; ++i) seq = (seq << 8) | p[i];
        if (last >= 0 && seq != last + 1) ++gaps_;
        last = seq;
        ++batches_;
        bytes_ += zmq_msg_size(&frames[2]);
      }
      for (int i = 0; i < n; ++i) zmq_msg_close(&frames[i]);
    }
  }

  void* ctx_;
  void* sub_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> batches_{0}, bytes_{0}, gaps_{0};
  std::thread thread_;
};

struct Node {
  bool events = false;
  StartedDaemon daemon;
  std::unique_ptr<Client> client;
  std::optional<ShmKvCache> cache;
  CacheId id = 0;
  std::vector<double> gbps;
};

}  // namespace

int HostEvents(const HostEventsOptions& o, const StartDaemonFn& start_daemon) {
  const Layout layout = Layout::Create({.model_id = "meta-llama/Llama-3.1-8B",
                                        .num_layers = 32,
                                        .kv_kind = KvKind::kSeparateKv,
                                        .num_kv_heads = 8,
                                        .head_dim = 128,
                                        .dtype = DType::kBf16,
                                        .block_tokens = o.block_tokens,
                                        .tp_rank = 0,
                                        .tp_size = 1,
                                        .scale_bytes_per_layer = 0})
                            .value();
  const uint64_t block_bytes = layout.block_bytes();
  const std::string dir = "/tmp/kvtier-bench-events-" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  const std::string endpoint = "ipc://" + dir + "/events";
  const uint64_t host_bytes = std::max<uint64_t>(256ull << 20, uint64_t{o.blocks} * 4 * block_bytes);
  // Four kvtierd, started off, on, on, off: where a daemon sits in the start
  // order (memory, caches) moved single pairs by ±5%, and this order cancels
  // it; each rep visits them in a rotating order.
  constexpr int kNodes = 4;
  Node nodes[kNodes];
  std::unique_ptr<Subscriber> subscriber;
  for (int k = 0; k < kNodes; ++k) {
    Node& n = nodes[k];
    n.events = k == 1 || k == 2;
    const std::string tenant = "tenants=[{name: local, uid: " + std::to_string(::getuid()) +
                               ", admin: true, publish_events: " + (n.events ? "true" : "false") + "}]";
    std::vector<std::string> sets = {tenant};
    if (n.events) {
      sets.insert(sets.end(), {"events.enabled=true", "events.endpoint=" + endpoint + std::to_string(k)});
    }
    n.daemon = start_daemon(host_bytes, sets);
    Result<std::unique_ptr<Client>> c = Client::Connect({.socket_path = n.daemon.socket, .client_name = "kvtier-bench"});
    if (!c) {
      std::fprintf(stderr, "kvtier-bench: %s\n", c.error().ToString().c_str());
      return 1;
    }
    n.client = std::move(*c);
    Result<ShmKvCache> cache = ShmKvCache::Create(layout, 2 * o.blocks);
    if (!cache) {
      std::fprintf(stderr, "kvtier-bench: %s\n", cache.error().ToString().c_str());
      return 1;
    }
    n.cache.emplace(std::move(*cache));
    const std::optional<CacheId> id = Register(*n.client, *n.cache);
    if (!id) return 1;
    n.id = *id;
  }
  subscriber = std::make_unique<Subscriber>(endpoint + "1");  // node 2's stream is the same, unread
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the subscription reaches the publisher
  std::printf("config:   %u blocks of %.2f MiB (%u tokens) per op with their metadata, store then load, %u reps "
              "(+1 warm-up), on four kvtierd in turn: events off, on, on, off\n",
              o.blocks, static_cast<double>(block_bytes) / (1 << 20), o.block_tokens, o.reps);
  std::fflush(stdout);

  uint64_t mismatches = 0;
  double timed_on_seconds = 0;
  uint64_t events_before_timing = 0;
  for (uint32_t rep = 0; rep <= o.reps; ++rep) {
    for (int j = 0; j < kNodes; ++j) {
      Node& n = nodes[(rep + j) % kNodes];
      const std::vector<uint32_t> tokens = Tokens(rep + 1, o.blocks * o.block_tokens);
      const std::vector<BlockKey> keys = n.client->ComputeKeys(n.id, tokens).value();
      std::vector<uint8_t> hashes(size_t{o.blocks} * 8);
      for (uint32_t i = 0; i < o.blocks; ++i) std::memcpy(&hashes[size_t{i} * 8], keys[i].bytes.data(), 8);
      for (uint32_t i = 0; i < o.blocks; ++i) FillFromKey(keys[i], n.cache->block(i));
      const BlockEventInfo info{.hash_bytes = 8, .engine_hashes = hashes, .parent_hash = {}, .token_ids = tokens,
                                .block_size = o.block_tokens, .lora_name = {}};
      const bool watched = &n == &nodes[1];  // the node the subscriber reads
      if (rep == 1 && watched) events_before_timing = n.client->Stats()->Counter("events_published");
      const auto t0 = Clock::now();
      auto stored = n.client->Store(n.id, keys, Iota(0, o.blocks), std::nullopt, &info);
      auto loaded = n.client->Load(n.id, keys, Iota(o.blocks, o.blocks));
      const auto t1 = Clock::now();
      if (!stored || !loaded || stored->blocks != o.blocks || loaded->blocks != o.blocks) {
        std::fprintf(stderr, "kvtier-bench: store/load failed: %s\n",
                     (!stored ? stored.error() : !loaded ? loaded.error() : Status()).ToString().c_str());
        return 1;
      }
      for (uint32_t i = 0; i < o.blocks; ++i) mismatches += !MatchesKey(keys[i], n.cache->block(o.blocks + i));
      (void)n.client->Evict();  // each rep stores anew: a BlockStored and a BlockRemoved per block
      const auto t2 = Clock::now();
      if (rep == 0) continue;
      n.gbps.push_back(2.0 * o.blocks * static_cast<double>(block_bytes) / Seconds(t1 - t0) / 1e9);
      if (watched) timed_on_seconds += Seconds(t2 - t0);
    }
    if (rep > 0) {
      std::printf("rep %u/%u: events off %.2f, %.2f GB/s, on %.2f, %.2f GB/s\n", rep, o.reps, nodes[0].gbps.back(),
                  nodes[3].gbps.back(), nodes[1].gbps.back(), nodes[2].gbps.back());
      std::fflush(stdout);
    }
  }
  std::vector<double> off, on;
  for (const Node& n : nodes) (n.events ? on : off).insert((n.events ? on : off).end(), n.gbps.begin(), n.gbps.end());
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the last batches arrive
  const Result<DaemonStats> stats = nodes[1].client->Stats();
  const uint64_t published = stats ? stats->Counter("events_published") : 0;
  uint64_t dropped = 0;
  for (Node& n : nodes) {
    if (Result<DaemonStats> st = n.client->Stats(); n.events && st) dropped += st->Counter("events_dropped");
  }
  const uint64_t timed_events = published - events_before_timing;
  const std::vector<Comparison> cs = {
      {"store+load with KV events on", Median(on), Median(off), "events off (same run)",
       "GB/s", false, 0.97},
  };
  PrintComparisons(cs);
  std::printf("events:   %lu published (%lu in the timed reps, %.0f per second of their store+load+evict), %lu dropped; "
              "the subscriber got %lu batches (%.1f MiB), %lu gap(s)\n",
              published, timed_events, timed_on_seconds > 0 ? static_cast<double>(timed_events) / timed_on_seconds : 0,
              dropped, subscriber->batches(), static_cast<double>(subscriber->bytes()) / (1 << 20), subscriber->gaps());
  std::printf("verified: %lu mismatched loaded blocks\n", mismatches);
  const uint64_t gaps = subscriber->gaps();
  subscriber.reset();
  for (Node& n : nodes) {
    n.client.reset();
    if (n.daemon.stop) n.daemon.stop();
  }
  std::filesystem::remove_all(dir);
  if (!o.json.empty() && !WriteJson(o.json,
                                    {{"workload", "host-events"}, {"blocks", std::to_string(o.blocks)},
                                     {"block_tokens", std::to_string(o.block_tokens)},
                                     {"reps", std::to_string(o.reps)}},
                                    cs)) {
    std::fprintf(stderr, "kvtier-bench: cannot write %s\n", o.json.c_str());
    return 1;
  }
  return mismatches == 0 && gaps == 0 && dropped == 0 ? 0 : 1;
}

}  // namespace kvtier::bench
