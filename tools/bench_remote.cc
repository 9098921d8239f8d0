#include "tools/bench_remote.h"

#include <hiredis/hiredis.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <future>
#include <memory>
#include <span>
#include <thread>

#include "tiers/remote/redis_cluster.h"
#include "tools/bench_report.h"
#include "tools/redis_cluster_process.h"

namespace kvtier::bench {
namespace {

constexpr uint32_t kBatch = 16;
constexpr uint32_t kThreads = 2;
constexpr uint32_t kLookupKeys = 128;
constexpr uint32_t kBlockTokens = 16;
// Each node's host tier, filled before the timed runs (a cache is full most
// of its life: a load's host slots are taken from older blocks, not fresh
// pages).
constexpr uint64_t kNodeHostBytes = uint64_t{256} << 20;

// Llama-3.1-8B's per-layer shape (64 KiB a layer per 16-token block), with as
// many layers as make `block_bytes`: 4 for 256 KiB, 32 for 2 MiB.
Layout BlockLayout(size_t block_bytes) {
  return Layout::Create({.model_id = "kvtier-bench/remote-" + std::to_string(block_bytes >> 10) + "k",
                         .num_layers = static_cast<uint32_t>(block_bytes / (64 << 10)),
                         .kv_kind = KvKind::kSeparateKv,
                         .num_kv_heads = 8,
                         .head_dim = 128,
                         .dtype = DType::kBf16,
                         .block_tokens = kBlockTokens,
                         .tp_rank = 0,
                         .tp_size = 1,
                         .scale_bytes_per_layer = 0})
      .value();
}

// Runs `fn(thread, first, count)` over [0, n) in batches of kBatch, on
// kThreads threads (batch b on thread b % kThreads); seconds taken; false on
// failure.
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

// The thread Parallel gives block `i` to.
uint32_t ThreadOf(uint32_t i) { return (i / kBatch) % kThreads; }

// An engine of a node: a client with a shared-memory KV cache of its own.
struct Engine {
  std::unique_ptr<Client> client;
  std::unique_ptr<ShmKvCache> cache;
  CacheId id = 0;
};

Result<Engine> Connect(const std::string& socket, const Layout& layout, uint32_t blocks) {
  Engine e;
  KVTIER_ASSIGN_OR_RETURN(e.client, Client::Connect({.socket_path = socket, .client_name = "kvtier-bench-remote"}));
  KVTIER_ASSIGN_OR_RETURN(ShmKvCache cache, ShmKvCache::Create(layout, blocks));
  e.cache = std::make_unique<ShmKvCache>(std::move(cache));
  KVTIER_ASSIGN_OR_RETURN(e.id, e.client->RegisterKvCache(*e.cache));
  return e;
}

Result<uint64_t> Counter(Client& client, std::string_view name) {
  KVTIER_ASSIGN_OR_RETURN(DaemonStats s, client.Stats());
  return s.Counter(name);
}

// Until node `client`'s counter `name` reaches `target` (polled; 60 s at most).
bool WaitCounter(Client& client, std::string_view name, uint64_t target) {
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  while (Clock::now() < deadline) {
    Result<uint64_t> v = Counter(client, name);
    if (!v) return false;
    if (*v >= target) return true;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return false;
}

struct Rates {
  std::vector<double> store, load;  // bytes per second
};

// One side's engines, and the keys of the prompt both sides compute.
struct Side {
  std::vector<Engine> engines;
  std::vector<BlockKey> keys;
};

// The keys of prompt `seed`, as long as the engines' caches.
Status Rekey(Side& side, uint64_t seed) {
  Engine& e = side.engines.front();
  const auto blocks = static_cast<uint32_t>(e.cache->num_blocks());
  KVTIER_ASSIGN_OR_RETURN(side.keys, e.client->ComputeKeys(e.id, Tokens(seed, blocks * kBlockTokens)));
  return Status::Ok();
}

// kThreads engines of `blocks` blocks each, with prompt `seed`'s keys.
// Engines are made once and kept, as an engine keeps its KV cache: the
// daemon's mapping of it is then warm, as in steady state.
Result<Side> Engines(const std::string& socket, const Layout& layout, uint32_t blocks, uint64_t seed) {
  Side side;
  for (uint32_t t = 0; t < kThreads; ++t) {
    KVTIER_ASSIGN_OR_RETURN(Engine e, Connect(socket, layout, blocks));
    side.engines.push_back(std::move(e));
  }
  KVTIER_RETURN_IF_ERROR(Rekey(side, seed));
  return side;
}

// Fills node `socket`'s host tier with blocks of `layout` (stored, and put
// to the cluster, before anything is timed).
bool Fill(const std::string& socket, const Layout& layout, uint64_t seed) {
  const auto n = static_cast<uint32_t>(kNodeHostBytes / layout.block_bytes());
  Result<Side> side = Engines(socket, layout, n, seed);
  if (!side) return false;
  Engine& e = side->engines.front();
  Result<uint64_t> before = Counter(*e.client, "remote_writes");
  for (uint32_t first = 0; first < n && before; first += kBatch) {
    const uint32_t count = std::min(kBatch, n - first);
    if (!e.client->Store(e.id, std::span(side->keys).subspan(first, count), Iota(first, count))) return false;
  }
  return before && WaitCounter(*e.client, "remote_writes", *before + n);
}

// A stores the prompt (until the cluster has every block), B loads it.
bool RunKvtier(Side& a, Side& b, size_t block_bytes, Rates* rates) {
  const auto n = static_cast<uint32_t>(a.keys.size());
  const double bytes = static_cast<double>(n) * static_cast<double>(block_bytes);
  for (uint32_t i = 0; i < n; ++i) FillFromKey(a.keys[i], a.engines[ThreadOf(i)].cache->block(i));
  Result<uint64_t> before = Counter(*a.engines[0].client, "remote_writes");
  if (!before) return false;
  const auto start = Clock::now();
  double s = 0;
  bool ok = Parallel(n, [&](uint32_t t, uint32_t first, uint32_t count) {
    Engine& e = a.engines[t];
    Result<OpResult> r = e.client->Store(e.id, std::span(a.keys).subspan(first, count), Iota(first, count));
    return r && r->blocks == count;
  }, &s);
  ok = ok && WaitCounter(*a.engines[0].client, "remote_writes", *before + n);
  rates->store.push_back(bytes / Seconds(Clock::now() - start));
  for (uint32_t i = 0; i < n; ++i) {
    std::span<uint8_t> block = b.engines[ThreadOf(i)].cache->block(i);
    std::fill(block.begin(), block.end(), 0);
  }
  ok = ok && Parallel(n, [&](uint32_t t, uint32_t first, uint32_t count) {
    Engine& e = b.engines[t];
    Result<OpResult> r = e.client->Load(e.id, std::span(b.keys).subspan(first, count), Iota(first, count));
    return r && r->blocks == count;
  }, &s);
  rates->load.push_back(bytes / s);
  for (uint32_t i = 0; i < n && ok; ++i) ok = MatchesKey(b.keys[i], b.engines[ThreadOf(i)].cache->block(i));
  return ok;
}

// The plain client's values: as many, of the same size.
struct PlainData {
  std::vector<std::string> keys;
  std::vector<std::string> values;
};

PlainData MakePlain(uint32_t n, size_t bytes, uint32_t salt) {
  PlainData d;
  for (uint32_t i = 0; i < n; ++i) {
    d.keys.push_back("plain:" + std::to_string(salt) + ":" + std::to_string(i));
    std::string v(bytes, '\0');
    for (size_t b = 0; b < bytes; b += 64) v[b] = static_cast<char>(i + b / 64 + salt);
    d.values.push_back(std::move(v));
  }
  return d;
}

// `out`: the engine's blocks, as many and as large as the values, touched
// before (as kvtierd's engines' blocks are).
bool RunPlain(std::vector<std::unique_ptr<RedisCluster>>& clients, const PlainData& d,
              std::vector<std::vector<uint8_t>>* out, Rates* rates) {
  const auto n = static_cast<uint32_t>(d.keys.size());
  const double bytes = static_cast<double>(n) * static_cast<double>(d.values[0].size());
  double s = 0;
  bool ok = Parallel(n, [&](uint32_t t, uint32_t first, uint32_t count) {
    std::vector<RedisCommand> batch;
    for (uint32_t i = first; i < first + count; ++i) batch.push_back({{"SET", d.keys[i], d.values[i]}});
    bool good = true;
    for (const Result<RedisReply>& r : clients[t]->Run(batch)) good = good && r && (*r)->type == REDIS_REPLY_STATUS;
    return good;
  }, &s);
  rates->store.push_back(bytes / s);
  ok = ok && Parallel(n, [&](uint32_t t, uint32_t first, uint32_t count) {
    std::vector<RedisCommand> batch;
    for (uint32_t i = first; i < first + count; ++i) batch.push_back({{"GET", d.keys[i]}});
    std::vector<Result<RedisReply>> replies = clients[t]->Run(batch);
    bool good = true;
    for (uint32_t i = 0; i < count; ++i) {
      const Result<RedisReply>& r = replies[i];
      good = good && r && (*r)->type == REDIS_REPLY_STRING && (*r)->len == d.values[first + i].size();
      if (good) std::memcpy((*out)[first + i].data(), (*r)->str, (*r)->len);  // into the engine's block
    }
    return good;
  }, &s);
  rates->load.push_back(bytes / s);
  for (uint32_t i = 0; i < n && ok; ++i) {
    ok = std::memcmp((*out)[i].data(), d.values[i].data(), d.values[i].size()) == 0;
  }
  return ok;
}

// Starts node A, then node B with A's tenant secrets (salts/), in `dir`.
bool StartNodes(const StartDaemonFn& start_daemon, const std::vector<NodeAddress>& seeds,
                const std::filesystem::path& dir, StartedDaemon* a, StartedDaemon* b) {
  std::string list = "[";
  for (const NodeAddress& s : seeds) list += (list.size() > 1 ? "," : "") + s.ToString();
  list += "]";
  auto sets = [&](const std::string& node) {
    return std::vector<std::string>{"state_dir=" + (dir / node).string(), "tiers.remote.enabled=true",
                                    "tiers.remote.seeds=" + list, "tiers.remote.key_prefix=kvtier-bench/",
                                    "tiers.remote.timeout_ms=10000"};
  };
  std::error_code ec;
  std::filesystem::create_directories(dir / "a", ec);
  *a = start_daemon(kNodeHostBytes, sets("a"));
  if (!Client::Connect({.socket_path = a->socket, .client_name = "kvtier-bench-remote"})) return false;
  std::filesystem::create_directories(dir / "b", ec);
  std::filesystem::copy(dir / "a" / "salts", dir / "b" / "salts", std::filesystem::copy_options::recursive, ec);
  if (ec) {
    std::fprintf(stderr, "remote: copying node A's salts: %s\n", ec.message().c_str());
    return false;
  }
  *b = start_daemon(kNodeHostBytes, sets("b"));
  return true;
}

}  // namespace

int Remote(const RemoteBenchOptions& options, const StartDaemonFn& start_daemon) {
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
  char tmpl[] = "/tmp/kvtier-bench-remote-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) return 1;
  const std::filesystem::path dir = tmpl;
  // Stops the nodes and removes their state, however the run ends.
  struct Nodes {
    std::filesystem::path dir;
    StartedDaemon a, b;
    ~Nodes() {
      if (b.stop) b.stop();
      if (a.stop) a.stop();
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  } nodes{.dir = dir, .a = {}, .b = {}};
  StartedDaemon& a = nodes.a;
  StartedDaemon& b = nodes.b;
  if (!StartNodes(start_daemon, seeds, dir, &a, &b)) {
    std::fprintf(stderr, "remote: node A did not start (KVTIER_KEEP_TEST_DIRS=1 keeps its log)\n");
    return 1;
  }
  std::printf("cluster:  %s (%zu seed nodes)\n", own ? "3 masters started by kvtier-bench, loopback" : "given",
              seeds.size());
  std::printf("kvtier:   two kvtierd nodes (write-through, %llu MiB host each, full), %u engine threads a node, "
              "batches of %u; plain: RedisCluster::Run (hiredis, pipelined per node), %u threads, batches of %u\n",
              static_cast<unsigned long long>(kNodeHostBytes >> 20), kThreads, kBatch, kThreads, kBatch);

  std::vector<std::unique_ptr<RedisCluster>> plain;
  for (uint32_t t = 0; t < kThreads + 1; ++t) {  // the last one for lookups
    Result<std::unique_ptr<RedisCluster>> c =
        RedisCluster::Connect(RedisClusterOptions{.seeds = seeds, .io_timeout = std::chrono::milliseconds(10000)});
    if (!c) {
      std::fprintf(stderr, "connecting: %s\n", c.error().ToString().c_str());
      return 1;
    }
    plain.push_back(std::move(*c));
  }

  std::vector<Comparison> cs;
  bool ok = true;
  uint64_t seed = 1;
  for (const size_t block_bytes : {size_t{256} << 10, size_t{2} << 20}) {
    const Layout layout = BlockLayout(block_bytes);
    const auto n = static_cast<uint32_t>(std::max<uint64_t>(kBatch, options.bytes_per_rep / block_bytes));
    Rates kv, base;
    ok = Fill(a.socket, layout, 1000000 + seed) && Fill(b.socket, layout, 2000000 + seed);
    Result<Side> side_a = Engines(a.socket, layout, n, seed);
    Result<Side> side_b = Engines(b.socket, layout, n, seed);
    if (!side_a || !side_b) {
      std::fprintf(stderr, "remote: %s\n", (side_a ? side_b.error() : side_a.error()).ToString().c_str());
      return 1;
    }
    std::vector<std::vector<uint8_t>> out(n, std::vector<uint8_t>(block_bytes));  // the plain client's engine
    for (uint32_t rep = 0; rep <= options.reps && ok; ++rep, ++seed) {
      if (rep > 0 && (!Rekey(*side_a, seed).ok() || !Rekey(*side_b, seed).ok())) return 1;
      if (side_a->keys != side_b->keys) {
        std::fprintf(stderr, "remote: the nodes compute different keys (their tenant secrets differ)\n");
        return 1;
      }
      const PlainData d = MakePlain(n, block_bytes, static_cast<uint32_t>(seed));
      ok = RunKvtier(*side_a, *side_b, block_bytes, &kv) && RunPlain(plain, d, &out, &base);
      std::printf("  %zu KiB rep %u: store %.0f / %.0f MB/s, load %.0f / %.0f MB/s (kvtierd / plain)%s\n",
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
    cs.push_back({.name = "remote store " + size + " via kvtierd", .kvtier = Median(kv.store) / 1e6,
                  .baseline = Median(base.store) / 1e6, .baseline_name = "plain SET", .unit = "MB/s", .target = 0.8});
    cs.push_back({.name = "remote load " + size + " via kvtierd", .kvtier = Median(kv.load) / 1e6,
                  .baseline = Median(base.load) / 1e6, .baseline_name = "plain GET", .unit = "MB/s", .target = 0.8});
  }

  // A 128-block prompt stored through A, that B misses locally: how long B's
  // lookup takes, and in how many round trips to the cluster.
  if (ok) {
    const Layout layout = BlockLayout(size_t{256} << 10);
    Result<Side> side_a = Engines(a.socket, layout, kLookupKeys, seed);
    Result<Side> side_b = Engines(b.socket, layout, kLookupKeys, seed);
    ok = side_a && side_b;
    Rates ignored;
    const PlainData d = MakePlain(kLookupKeys, 1024, 200);
    std::vector<std::vector<uint8_t>> out(kLookupKeys, std::vector<uint8_t>(1024));
    ok = ok && RunPlain(plain, d, &out, &ignored);
    ok = ok && RunKvtier(*side_a, *side_b, layout.block_bytes(), &ignored);
    // B's load above promoted the prompt: drop it from B's host so that the
    // lookups ask the cluster (the remote tier keeps it).
    Engine& e = side_b->engines.front();
    ok = ok && e.client->Evict().has_value();
    std::vector<RedisCommand> exists;
    for (const std::string& k : d.keys) exists.push_back({{"EXISTS", k}});
    std::vector<double> kv_us, plain_us;
    Result<uint64_t> trips_before = Counter(*e.client, "remote_round_trips");
    const uint64_t plain_before = plain.back()->counters().round_trips;
    constexpr int kLookups = 50;
    for (int i = 0; i < kLookups && ok && trips_before; ++i) {
      auto start = Clock::now();
      Result<LookupResult> hit = e.client->Lookup(e.id, side_b->keys);
      kv_us.push_back(Seconds(Clock::now() - start) * 1e6);
      ok = hit && hit->hits == kLookupKeys && hit->tiers.back() == BlockTier::kRemote;
      start = Clock::now();
      (void)plain.back()->Run(exists);
      plain_us.push_back(Seconds(Clock::now() - start) * 1e6);
    }
    Result<uint64_t> trips_after = Counter(*e.client, "remote_round_trips");
    ok = ok && trips_before && trips_after;
    if (ok) {
      const double kv_trips = static_cast<double>(*trips_after - *trips_before) / kLookups;
      const double plain_trips = static_cast<double>(plain.back()->counters().round_trips - plain_before) / kLookups;
      std::printf("lookup of %u blocks through node B: %.1f round trips to the cluster (kvtierd), %.1f (plain), "
                  "%zu nodes\n",
                  kLookupKeys, kv_trips, plain_trips, plain.back()->slots().num_nodes());
      cs.push_back({.name = "remote lookup 128 blocks via kvtierd", .kvtier = Median(kv_us),
                    .baseline = Median(plain_us), .baseline_name = "pipelined EXISTS", .unit = "us",
                    .lower_is_better = true});
      cs.push_back({.name = "lookup round trips", .kvtier = kv_trips, .baseline = plain_trips,
                    .baseline_name = "pipelined EXISTS", .unit = "trips", .lower_is_better = true,
                    .kvtier_target = static_cast<double>(plain.back()->slots().num_nodes())});
    }
  }
  if (!ok) {
    std::fprintf(stderr, "remote: a call failed or a byte differed (KVTIER_KEEP_TEST_DIRS=1 keeps the nodes' logs)\n");
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
