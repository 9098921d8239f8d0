#include "tools/bench_abuse.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <memory>
#include <optional>
#include <thread>

#include "kvtier/client.h"
#include "kvtier/shm_kv_cache.h"
#include "tools/bench_engine.h"
#include "tools/bench_report.h"

namespace kvtier::bench {
namespace {

constexpr uint32_t kPromptBlocks = 4096;  // limits.max_keys_per_request
constexpr uint32_t kLookupKeys = 128;

std::string Tok(char c) { return std::string(24, c); }

template <typename T>
Status StatusOf(const Result<T>& r) {
  return r ? Status::Ok() : r.error();
}

// Blocks of `layers` layers of K and V, `heads` KV heads x `head_dim`, bf16,
// 16 tokens.
Layout BenchLayout(const char* model_id, uint32_t layers, uint32_t heads, uint32_t head_dim) {
  return Layout::Create({.model_id = model_id,
                         .num_layers = layers,
                         .kv_kind = KvKind::kSeparateKv,
                         .num_kv_heads = heads,
                         .head_dim = head_dim,
                         .dtype = DType::kBf16,
                         .block_tokens = 16,
                         .tp_rank = 0,
                         .tp_size = 1,
                         .scale_bytes_per_layer = 0})
      .value();
}

// 4 KiB blocks.
Layout SmallLayout() { return BenchLayout("kvtier-bench/abuse", 1, 1, 64); }

struct Latencies {
  double p50_us = 0;
  double p99_us = 0;
  uint64_t lookups = 0;
};

Latencies Percentiles(std::vector<double> us) {
  Latencies l;
  l.lookups = us.size();
  if (us.empty()) return l;
  std::sort(us.begin(), us.end());
  l.p50_us = us[us.size() / 2];
  l.p99_us = us[std::min(us.size() - 1, us.size() * 99 / 100)];
  return l;
}

// What the abuser's loop did.
struct AbuserCalls {
  uint64_t served = 0;
  uint64_t refused = 0;  // kResourceExhausted: the rate limit
  uint64_t failed = 0;
};

// 256 KiB blocks.
Layout LargeLayout() { return BenchLayout("kvtier-bench/abuse-sessions", 4, 8, 128); }

constexpr uint32_t kTurnBlocks = 16;
constexpr uint64_t kWarmUpTurns = 8;

// One session's cache of 2 x kTurnBlocks blocks: stores from the first
// half, loads into the second.
struct Turns {
  std::unique_ptr<Client> client;
  std::optional<ShmKvCache> cache;
  CacheId id = 0;
};

std::optional<Turns> OpenTurns(const std::string& socket, char token, const Layout& layout) {
  Turns t;
  Result<std::unique_ptr<Client>> c =
      Client::Connect({.socket_path = socket, .token = Tok(token), .client_name = "kvtier-bench abuse --sessions"});
  Result<ShmKvCache> cache = ShmKvCache::Create(layout, 2 * kTurnBlocks);
  if (!c || !cache) {
    std::fprintf(stderr, "kvtier-bench: %s\n", (!c ? c.error() : cache.error()).ToString().c_str());
    return std::nullopt;
  }
  t.client = std::move(*c);
  t.cache.emplace(std::move(*cache));
  std::optional<CacheId> id = Register(*t.client, *t.cache);
  if (!id) return std::nullopt;
  t.id = *id;
  return t;
}

// Stores kTurnBlocks blocks of prompt `seed` and loads them back: false
// (after printing why) when either fails or falls short.
bool StoreAndLoad(Turns& t, uint64_t seed) {
  Result<std::vector<BlockKey>> keys = t.client->ComputeKeys(t.id, Tokens(seed, kTurnBlocks * 16));
  Result<OpResult> stored = keys ? t.client->Store(t.id, *keys, Iota(0, kTurnBlocks)) : Err(keys.error());
  Result<OpResult> loaded = stored ? t.client->Load(t.id, *keys, Iota(kTurnBlocks, kTurnBlocks)) : stored;
  if (!loaded) {
    std::fprintf(stderr, "kvtier-bench: %s\n", loaded.error().ToString().c_str());
    return false;
  }
  return true;
}

// Tenant A's engine: a process of its own, in a session of its own (as an
// engine's service is: the scheduler shares the cores between it, B and
// kvtierd, not between their threads), with `sessions` sessions of stores
// and loads, each on a thread. It writes a byte to `ready` once every
// session has had kWarmUpTurns turns, runs until `stop` reads end of file, and exits 0 unless
// a call failed.
[[noreturn]] void RunTenantA(const std::string& socket, const Layout& layout, uint32_t sessions, int ready,
                             int stop) {
  ::setsid();
  std::vector<Turns> a;
  for (uint32_t i = 0; i < sessions; ++i) {
    std::optional<Turns> t = OpenTurns(socket, 'a', layout);
    if (!t) ::_exit(1);
    a.push_back(std::move(*t));
  }
  std::atomic<bool> stopping{false};
  std::atomic<uint32_t> warm{0};
  std::vector<std::thread> threads;
  for (uint32_t i = 0; i < sessions; ++i) {
    threads.emplace_back([&, i] {
      for (uint64_t turn = 0; !stopping.load(std::memory_order_relaxed); ++turn) {
        // A failure ends the process: B's wait for `ready` ends with it.
        if (!StoreAndLoad(a[i], 1'000'000 * (i + 1) + turn)) ::_exit(1);
        // Ready once every session has had its warm-up turns: B measures
        // A's steady state, not its sessions' first faults into fresh pages.
        const char byte = 1;
        if (turn + 1 == kWarmUpTurns && warm.fetch_add(1) + 1 == sessions && ::write(ready, &byte, 1) != 1) {
          ::_exit(1);
        }
      }
    });
  }
  char c;
  while (::read(stop, &c, 1) != 0) {
  }
  stopping = true;
  for (std::thread& t : threads) t.join();
  ::_exit(0);
}

// B's load latencies while A runs `sessions` sessions of stores and loads
// (RunTenantA).
std::optional<Latencies> SessionsPhase(const AbuseOptions& o, const std::string& socket, const Layout& layout,
                                       Turns& b, const std::vector<BlockKey>& b_keys, uint32_t sessions) {
  int ready[2], stop[2];
  if (::pipe2(ready, O_CLOEXEC) != 0 || ::pipe2(stop, O_CLOEXEC) != 0) {
    std::perror("kvtier-bench: pipe");
    return std::nullopt;
  }
  std::fflush(nullptr);
  const pid_t a = ::fork();
  if (a < 0) std::perror("kvtier-bench: fork");
  if (a == 0) {
    ::close(ready[0]);
    ::close(stop[1]);
    RunTenantA(socket, layout, sessions, ready[1], stop[0]);
  }
  ::close(ready[1]);
  ::close(stop[0]);
  char byte;
  const bool started = a > 0 && ::read(ready[0], &byte, 1) == 1;
  ::close(ready[0]);
  std::vector<double> us;
  bool ok = started;
  const Clock::time_point end = Clock::now() + std::chrono::seconds(o.seconds);
  while (ok && Clock::now() < end) {
    const Clock::time_point t0 = Clock::now();
    Result<OpResult> r = b.client->Load(b.id, b_keys, Iota(kTurnBlocks, kTurnBlocks));
    us.push_back(Seconds(Clock::now() - t0) * 1e6);
    if (!r || r->blocks != kTurnBlocks) {
      std::fprintf(stderr, "kvtier-bench: B's load %s\n", r ? "missed blocks it stored" : r.error().ToString().c_str());
      ok = false;
    }
  }
  ::close(stop[1]);
  int status = 0;
  if (a > 0 && ::waitpid(a, &status, 0) != a) status = -1;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "kvtier-bench: tenant A's process (%u sessions) failed\n", sessions);
    return std::nullopt;
  }
  if (!ok) return std::nullopt;
  return Percentiles(std::move(us));
}

int AbuseSessions(const AbuseOptions& o, const StartAbuseDaemonFn& start_daemon) {
  const Layout layout = LargeLayout();
  // Room for every session's blocks and B's. A's quota keeps B's blocks in
  // host: A stores new blocks on every turn, and its oldest go.
  const uint64_t host_bytes = uint64_t{o.sessions + 2} * 4 * kTurnBlocks * layout.block_bytes() + (64ull << 20);
  const uint64_t a_quota = host_bytes - (32ull << 20);
  const std::string socket = start_daemon(
      host_bytes, {"tenants=[{name: b, token: " + Tok('b') + "}, {name: a, token: " + Tok('a') +
                       ", quotas: {host: " + std::to_string(a_quota) + "}}]",
                   "limits.max_sessions_per_tenant=" + std::to_string(std::max(256u, o.sessions + 1))});
  std::optional<Turns> b = OpenTurns(socket, 'b', layout);
  if (!b) return 1;
  Result<std::vector<BlockKey>> b_keys = b->client->ComputeKeys(b->id, Tokens(7, kTurnBlocks * 16));
  Result<OpResult> stored = b_keys ? b->client->Store(b->id, *b_keys, Iota(0, kTurnBlocks)) : Err(b_keys.error());
  if (!stored || stored->blocks != kTurnBlocks) {
    std::fprintf(stderr, "kvtier-bench: storing B's blocks failed\n");
    return 1;
  }
  std::printf("workload: B loads %u blocks of %llu KiB on one session; A, a process of its own, stores and loads "
              "the same on 1, then %u sessions; %u s a phase, %u reps\n",
              kTurnBlocks, static_cast<unsigned long long>(layout.block_bytes() >> 10), o.sessions, o.seconds,
              o.reps);
  std::vector<double> one_p50, one_p99, many_p50, many_p99;
  for (uint32_t rep = 0; rep < o.reps; ++rep) {
    std::optional<Latencies> one = SessionsPhase(o, socket, layout, *b, *b_keys, 1);
    std::optional<Latencies> many = one ? SessionsPhase(o, socket, layout, *b, *b_keys, o.sessions) : std::nullopt;
    if (!many) return 1;
    one_p50.push_back(one->p50_us);
    one_p99.push_back(one->p99_us);
    many_p50.push_back(many->p50_us);
    many_p99.push_back(many->p99_us);
  }
  const std::string many_name = "A on " + std::to_string(o.sessions) + " sessions";
  std::vector<Comparison> cs = {{.name = "B's load p50, " + many_name,
                                 .kvtier = Median(many_p50),
                                 .baseline = Median(one_p50),
                                 .baseline_name = "A on one session",
                                 .unit = "us",
                                 .lower_is_better = true},
                                {.name = "B's load p99, " + many_name,
                                 .kvtier = Median(many_p99),
                                 .baseline = Median(one_p99),
                                 .baseline_name = "A on one session",
                                 .unit = "us",
                                 .lower_is_better = true}};
  PrintComparisons(cs);
  if (!o.json.empty() &&
      !WriteJson(o.json,
                 {{"workload", "abuse-sessions"}, {"sessions", std::to_string(o.sessions)},
                  {"seconds", std::to_string(o.seconds)}, {"reps", std::to_string(o.reps)}},
                 cs)) {
    std::fprintf(stderr, "kvtier-bench: cannot write %s\n", o.json.c_str());
    return 1;
  }
  return 0;
}

}  // namespace

int Abuse(const AbuseOptions& o, const StartAbuseDaemonFn& start_daemon) {
  if (o.sessions > 0) return AbuseSessions(o, start_daemon);
  const Layout layout = SmallLayout();
  const uint32_t prompts = std::max<uint32_t>(1, (o.blocks + kPromptBlocks - 1) / kPromptBlocks);
  const uint64_t host_bytes = uint64_t{prompts} * kPromptBlocks * layout.block_bytes() * 5 / 4 + (64ull << 20);
  const std::string uid = std::to_string(::getuid());
  const std::string socket = start_daemon(
      host_bytes, {"tenants=[{name: victim, token: " + Tok('v') + "}, {name: abuser, token: " + Tok('a') +
                       "}, {name: ops, token: " + Tok('o') + ", admin: true}]",
                   "policy.watermarks.host={high: 1.0, low: 0.99}"});
  auto connect = [&](char token) -> std::unique_ptr<Client> {
    Result<std::unique_ptr<Client>> c =
        Client::Connect({.socket_path = socket, .token = Tok(token), .client_name = "kvtier-bench abuse"});
    if (!c) {
      std::fprintf(stderr, "kvtier-bench: %s\n", c.error().ToString().c_str());
      return nullptr;
    }
    return std::move(*c);
  };
  std::unique_ptr<Client> victim = connect('v');
  std::unique_ptr<Client> abuser = connect('a');
  std::unique_ptr<Client> ops = connect('o');
  if (!victim || !abuser || !ops) return 1;

  Result<ShmKvCache> cache = ShmKvCache::Create(layout, kPromptBlocks);
  if (!cache) {
    std::fprintf(stderr, "kvtier-bench: %s\n", cache.error().ToString().c_str());
    return 1;
  }
  std::optional<CacheId> id = Register(*victim, *cache);
  if (!id) return 1;
  std::vector<BlockKey> first;
  for (uint32_t p = 0; p < prompts; ++p) {
    Result<std::vector<BlockKey>> keys = victim->ComputeKeys(*id, Tokens(1000 + p, kPromptBlocks * 16));
    Result<OpResult> stored = keys ? victim->Store(*id, *keys, Iota(0, kPromptBlocks)) : Err(keys.error());
    if (!stored || stored->blocks != kPromptBlocks) {
      std::fprintf(stderr, "kvtier-bench: storing the victim's blocks failed: %s\n",
                   stored ? "some were refused" : stored.error().ToString().c_str());
      return 1;
    }
    if (p == 0) first.assign(keys->begin(), keys->begin() + kLookupKeys);
  }
  std::printf("workload: victim holds %u 4 KiB blocks; its %u-key lookups, %u s a phase, %u reps\n",
              prompts * kPromptBlocks, kLookupKeys, o.seconds, o.reps);

  // One phase: the victim's lookups while `abuse` (if any) loops on its own
  // thread.
  auto phase = [&](const std::function<Status()>& abuse, AbuserCalls* calls) -> std::optional<Latencies> {
    std::atomic<bool> stop{false};
    std::thread abuser_thread;
    if (abuse) {
      abuser_thread = std::thread([&] {
        while (!stop.load(std::memory_order_relaxed)) {
          const Status st = abuse();
          if (st.ok()) {
            ++calls->served;
          } else if (st.code() == StatusCode::kResourceExhausted) {
            ++calls->refused;
          } else {
            ++calls->failed;
          }
        }
      });
    }
    std::vector<double> us;
    const Clock::time_point end = Clock::now() + std::chrono::seconds(o.seconds);
    bool ok = true;
    while (Clock::now() < end) {
      const Clock::time_point t0 = Clock::now();
      Result<LookupResult> r = victim->Lookup(*id, first);
      us.push_back(Seconds(Clock::now() - t0) * 1e6);
      if (!r || r->hits != kLookupKeys) {
        std::fprintf(stderr, "kvtier-bench: the victim's lookup %s\n",
                     r ? "missed blocks it stored" : r.error().ToString().c_str());
        ok = false;
        break;
      }
    }
    stop = true;
    if (abuser_thread.joinable()) abuser_thread.join();
    if (!ok) return std::nullopt;
    return Percentiles(std::move(us));
  };

  struct Abuser {
    const char* name;
    std::function<Status()> call;
  };
  const std::vector<Abuser> abusers = {
      {"tenant loops namespaces", [&] { return StatusOf(abuser->ListNamespaces()); }},
      {"admin loops namespaces *", [&] { return StatusOf(ops->ListNamespaces("*")); }},
      {"tenant loops evict", [&] { return StatusOf(abuser->Evict()); }},
  };
  std::vector<double> alone_p50, alone_p99;
  std::vector<std::vector<double>> p50(abusers.size()), p99(abusers.size());
  std::vector<AbuserCalls> calls(abusers.size());
  for (uint32_t rep = 0; rep < o.reps; ++rep) {
    std::optional<Latencies> alone = phase(nullptr, nullptr);
    if (!alone) return 1;
    alone_p50.push_back(alone->p50_us);
    alone_p99.push_back(alone->p99_us);
    for (size_t a = 0; a < abusers.size(); ++a) {
      std::optional<Latencies> l = phase(abusers[a].call, &calls[a]);
      if (!l) return 1;
      p50[a].push_back(l->p50_us);
      p99[a].push_back(l->p99_us);
    }
  }
  std::vector<Comparison> cs;
  for (size_t a = 0; a < abusers.size(); ++a) {
    cs.push_back({.name = std::string("victim lookup p50, ") + abusers[a].name,
                  .kvtier = Median(p50[a]),
                  .baseline = Median(alone_p50),
                  .baseline_name = "nobody else calling",
                  .unit = "us",
                  .lower_is_better = true});
    cs.push_back({.name = std::string("victim lookup p99, ") + abusers[a].name,
                  .kvtier = Median(p99[a]),
                  .baseline = Median(alone_p99),
                  .baseline_name = "nobody else calling",
                  .unit = "us",
                  .lower_is_better = true});
  }
  PrintComparisons(cs);
  for (size_t a = 0; a < abusers.size(); ++a) {
    const double s = static_cast<double>(o.seconds) * o.reps;
    std::printf("%-26s %8.0f calls/s served, %8.0f/s refused (rate limit), %llu failed\n", abusers[a].name,
                static_cast<double>(calls[a].served) / s, static_cast<double>(calls[a].refused) / s,
                static_cast<unsigned long long>(calls[a].failed));
  }
  if (!o.json.empty() &&
      !WriteJson(o.json,
                 {{"workload", "abuse"}, {"blocks", std::to_string(prompts * kPromptBlocks)},
                  {"seconds", std::to_string(o.seconds)}, {"reps", std::to_string(o.reps)}},
                 cs)) {
    std::fprintf(stderr, "kvtier-bench: cannot write %s\n", o.json.c_str());
    return 1;
  }
  return 0;
}

}  // namespace kvtier::bench
