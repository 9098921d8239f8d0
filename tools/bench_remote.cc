#include "tools/bench_remote.h"

#include <hiredis/hiredis.h>

#include <cstdio>
#include <future>
#include <memory>
#include <span>
#include <thread>

#include "tiers/remote/remote_tier.h"
#include "tiers/remote/remote_value.h"
#include "tools/bench_report.h"
#include "tools/redis_cluster_process.h"

namespace kvtier::bench {
namespace {

constexpr uint32_t kBatch = 16;
constexpr uint32_t kThreads = 2;
constexpr uint32_t kLookupKeys = 128;

struct Data {
  LayoutFingerprint ns;
  std::vector<StoredKey> keys;
  std::vector<std::string> redis_keys;  // the same keys, for the plain client
  std::vector<std::vector<uint8_t>> blocks;
};

Data MakeData(uint32_t n, size_t bytes, uint8_t salt) {
  Data d;
  d.ns.bytes.fill(0x42);
  for (uint32_t i = 0; i < n; ++i) {
    StoredKey k;
    for (size_t b = 0; b < k.bytes.size(); ++b) k.bytes[b] = static_cast<uint8_t>(i * 7 + b * 13 + salt);
    k.bytes[0] = static_cast<uint8_t>(i);
    k.bytes[1] = static_cast<uint8_t>(i >> 8);
    d.keys.push_back(k);
    d.redis_keys.push_back(RemoteKey("plain:", k));
    std::vector<uint8_t> block(bytes);
    for (size_t b = 0; b < bytes; b += 64) block[b] = static_cast<uint8_t>(i + b / 64 + salt);
    d.blocks.push_back(std::move(block));
  }
  return d;
}

// Runs `fn(first, count)` over [0, n) in batches of kBatch, on kThreads
// threads (batch b on thread b % kThreads); seconds taken; false on failure.
template <typename Fn>
bool Parallel(uint32_t n, Fn fn, double* seconds) {
  const auto start = Clock::now();
  std::vector<std::future<bool>> threads;
  for (uint32_t t = 0; t < kThreads; ++t) {
    threads.push_back(std::async(std::launch::async, [&, t] {
      bool ok = true;
      for (uint32_t first = t * kBatch; first < n; first += kThreads * kBatch) {
        ok = fn(t, first, std::min(kBatch, n - first)) && ok;
      }
      return ok;
    }));
  }
  bool ok = true;
  for (auto& f : threads) ok = f.get() && ok;
  *seconds = Seconds(Clock::now() - start);
  return ok;
}

Result<uint32_t> Wait(const std::function<void(RemoteTier::Done)>& call) {
  std::promise<Result<uint32_t>> promise;
  call([&](Result<uint32_t> r) { promise.set_value(std::move(r)); });
  return promise.get_future().get();
}

struct Rates {
  std::vector<double> store, load;  // bytes per second
};

bool RunKvtier(RemoteTier& tier, const Data& d, std::vector<std::vector<uint8_t>>* out, Rates* rates) {
  const auto n = static_cast<uint32_t>(d.keys.size());
  const double bytes = static_cast<double>(n) * static_cast<double>(d.blocks[0].size());
  double s = 0;
  bool ok = Parallel(n, [&](uint32_t, uint32_t first, uint32_t count) {
    std::vector<StoredKey> keys(d.keys.begin() + first, d.keys.begin() + first + count);
    std::vector<std::span<const uint8_t>> payloads;
    for (uint32_t i = first; i < first + count; ++i) payloads.emplace_back(d.blocks[i]);
    Result<uint32_t> r = Wait([&](RemoteTier::Done done) { tier.Put(d.ns, keys, payloads, std::move(done)); });
    return r && *r == count;
  }, &s);
  rates->store.push_back(bytes / s);
  ok = ok && Parallel(n, [&](uint32_t, uint32_t first, uint32_t count) {
    std::vector<StoredKey> keys(d.keys.begin() + first, d.keys.begin() + first + count);
    std::vector<std::span<uint8_t>> spans;
    for (uint32_t i = first; i < first + count; ++i) spans.emplace_back((*out)[i]);
    Result<uint32_t> r = Wait([&](RemoteTier::Done done) { tier.Get(d.ns, keys, spans, std::move(done)); });
    return r && *r == count;
  }, &s);
  rates->load.push_back(bytes / s);
  return ok;
}

bool RunPlain(std::vector<std::unique_ptr<RedisCluster>>& clients, const Data& d,
              std::vector<std::vector<uint8_t>>* out, Rates* rates) {
  const auto n = static_cast<uint32_t>(d.keys.size());
  const double bytes = static_cast<double>(n) * static_cast<double>(d.blocks[0].size());
  double s = 0;
  bool ok = Parallel(n, [&](uint32_t t, uint32_t first, uint32_t count) {
    std::vector<RedisCommand> batch;
    for (uint32_t i = first; i < first + count; ++i) {
      batch.push_back({{"SET", d.redis_keys[i],
                        std::string_view(reinterpret_cast<const char*>(d.blocks[i].data()), d.blocks[i].size())}});
    }
    bool good = true;
    for (const Result<RedisReply>& r : clients[t]->Run(batch)) good = good && r && (*r)->type == REDIS_REPLY_STATUS;
    return good;
  }, &s);
  rates->store.push_back(bytes / s);
  ok = ok && Parallel(n, [&](uint32_t t, uint32_t first, uint32_t count) {
    std::vector<RedisCommand> batch;
    for (uint32_t i = first; i < first + count; ++i) batch.push_back({{"GET", d.redis_keys[i]}});
    std::vector<Result<RedisReply>> replies = clients[t]->Run(batch);
    bool good = true;
    for (uint32_t i = 0; i < count; ++i) {
      const Result<RedisReply>& r = replies[i];
      good = good && r && (*r)->type == REDIS_REPLY_STRING && (*r)->len == (*out)[first + i].size();
      if (good) std::memcpy((*out)[first + i].data(), (*r)->str, (*r)->len);  // into the engine's block
    }
    return good;
  }, &s);
  rates->load.push_back(bytes / s);
  return ok;
}

}  // namespace

int Remote(const RemoteBenchOptions& options) {
  std::unique_ptr<testing::RedisClusterProcess> own;
  std::vector<NodeAddress> seeds;
  for (const std::string& s : options.seeds) {
    Result<NodeAddress> a = ParseNodeAddress(s);
    if (!a) {
      std::fprintf(stderr, "--seeds: %s\n", a.error().ToString().c_str());
      return 1;
    }
    seeds.push_back(*a);
  }
  if (seeds.empty()) {
    Result<std::unique_ptr<testing::RedisClusterProcess>> c = testing::RedisClusterProcess::Start(
        {.masters = 3, .replicas = 0, .maxmemory = "2gb", .maxmemory_policy = "noeviction"});
    if (!c) {
      std::fprintf(stderr, "starting a Redis Cluster: %s\n", c.error().ToString().c_str());
      return 1;
    }
    own = std::move(*c);
    seeds = own->seeds();
  }
  std::printf("cluster:  %s (%zu seed nodes)\n", own ? "3 masters started by kvtier-bench, loopback" : "given",
              seeds.size());
  std::printf("kvtier:   RemoteTier, %u I/O threads, batches of %u; plain: RedisCluster::Run (hiredis, pipelined "
              "per node), %u threads, batches of %u\n",
              kThreads, kBatch, kThreads, kBatch);

  RemoteTierOptions tier_options;
  tier_options.cluster.seeds = seeds;
  tier_options.cluster.io_timeout = std::chrono::milliseconds(10000);
  tier_options.key_prefix = "bench:";
  tier_options.io_threads = kThreads;
  tier_options.post = [](std::function<void()> f) { f(); };
  Result<std::unique_ptr<RemoteTier>> tier = RemoteTier::Start(tier_options);
  std::vector<std::unique_ptr<RedisCluster>> plain;
  for (uint32_t t = 0; t < kThreads + 1 && tier; ++t) {  // the last one for lookups
    Result<std::unique_ptr<RedisCluster>> c =
        RedisCluster::Connect(RedisClusterOptions{.seeds = seeds, .io_timeout = std::chrono::milliseconds(10000)});
    if (!c) {
      std::fprintf(stderr, "connecting: %s\n", c.error().ToString().c_str());
      return 1;
    }
    plain.push_back(std::move(*c));
  }
  if (!tier) {
    std::fprintf(stderr, "RemoteTier: %s\n", tier.error().ToString().c_str());
    return 1;
  }

  std::vector<Comparison> cs;
  bool ok = true;
  for (const size_t block_bytes : {size_t{256} << 10, size_t{2} << 20}) {
    const auto n = static_cast<uint32_t>(std::max<uint64_t>(kBatch, options.bytes_per_rep / block_bytes));
    Rates kv, base;
    for (uint32_t rep = 0; rep <= options.reps && ok; ++rep) {
      const Data d = MakeData(n, block_bytes, static_cast<uint8_t>(rep));
      std::vector<std::vector<uint8_t>> out_kv(n, std::vector<uint8_t>(block_bytes));
      std::vector<std::vector<uint8_t>> out_plain = out_kv;
      ok = RunKvtier(**tier, d, &out_kv, &kv) && RunPlain(plain, d, &out_plain, &base);
      for (uint32_t i = 0; i < n && ok; ++i) ok = out_kv[i] == d.blocks[i] && out_plain[i] == d.blocks[i];
      std::printf("  %zu KiB rep %u: store %.0f / %.0f MB/s, load %.0f / %.0f MB/s (kvtier / plain)%s\n",
                  block_bytes >> 10, rep, kv.store.empty() ? 0 : kv.store.back() / 1e6,
                  base.store.empty() ? 0 : base.store.back() / 1e6, kv.load.empty() ? 0 : kv.load.back() / 1e6,
                  base.load.empty() ? 0 : base.load.back() / 1e6, rep == 0 ? " (warm-up)" : "");
      if (rep == 0) {  // warm-up: not counted
        kv = {};
        base = {};
      }
    }
    if (!ok) break;
    const std::string size = std::to_string(block_bytes >> 10) + " KiB";
    cs.push_back({.name = "remote store " + size, .kvtier = Median(kv.store) / 1e6, .baseline = Median(base.store) / 1e6,
                  .baseline_name = "plain SET", .unit = "MB/s", .target = 0.8});
    cs.push_back({.name = "remote load " + size, .kvtier = Median(kv.load) / 1e6, .baseline = Median(base.load) / 1e6,
                  .baseline_name = "plain GET", .unit = "MB/s", .target = 0.8});
  }

  // A 128-block prompt that missed locally: how long the remote lookup
  // takes, and in how many round trips.
  if (ok) {
    const Data d = MakeData(kLookupKeys, 1024, 200);
    std::vector<std::vector<uint8_t>> out(kLookupKeys, std::vector<uint8_t>(1024));
    Rates ignored;
    ok = RunKvtier(**tier, d, &out, &ignored);
    std::vector<double> kv_us, plain_us;
    const uint64_t trips_before = (*tier)->counters().round_trips;
    const uint64_t plain_before = plain.back()->counters().round_trips;
    std::vector<RedisCommand> exists;
    for (const std::string& k : d.redis_keys) exists.push_back({{"EXISTS", k}});
    constexpr int kLookups = 50;
    for (int i = 0; i < kLookups && ok; ++i) {
      auto start = Clock::now();
      Result<uint32_t> hits = Wait([&](RemoteTier::Done done) { (*tier)->Exists(d.keys, std::move(done)); });
      kv_us.push_back(Seconds(Clock::now() - start) * 1e6);
      ok = hits && *hits == kLookupKeys;
      start = Clock::now();
      (void)plain.back()->Run(exists);
      plain_us.push_back(Seconds(Clock::now() - start) * 1e6);
    }
    const double kv_trips = static_cast<double>((*tier)->counters().round_trips - trips_before) / kLookups;
    const double plain_trips = static_cast<double>(plain.back()->counters().round_trips - plain_before) / kLookups;
    std::printf("lookup of %u blocks: %.1f round trips (kvtier), %.1f (plain), %zu nodes\n", kLookupKeys, kv_trips,
                plain_trips, plain.back()->slots().num_nodes());
    cs.push_back({.name = "remote lookup 128 blocks", .kvtier = Median(kv_us), .baseline = Median(plain_us),
                  .baseline_name = "pipelined EXISTS", .unit = "us", .lower_is_better = true});
    cs.push_back({.name = "lookup round trips", .kvtier = kv_trips, .baseline = plain_trips,
                  .baseline_name = "pipelined EXISTS", .unit = "trips", .lower_is_better = true,
                  .kvtier_target = static_cast<double>(plain.back()->slots().num_nodes())});
  }
  if (!ok) {
    std::fprintf(stderr, "remote: a batch failed or a byte differed\n");
    return 1;
  }
  PrintComparisons(cs);
  if (!options.json.empty() &&
      !WriteJson(options.json, {{"workload", "remote"}, {"reps", std::to_string(options.reps)}}, cs)) {
    return 1;
  }
  return 0;
}

}  // namespace kvtier::bench
