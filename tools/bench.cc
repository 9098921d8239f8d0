// kvtier-bench: whole-system benchmarks, each figure printed next to a
// baseline measured in the same run (the machines are shared and noisy, so
// absolute numbers mean little; ratios do).
//
//   kvtier-bench host   [--blocks 64] [--reps 7] [--socket PATH]
//   kvtier-bench compress [--block-kib 2048] [--blocks 32] [--reps 5]
//       the block codecs on one core (tools/bench_compress.h)
//   kvtier-bench register [--gib 1,4,16] [--reps 3]
//       registering a CPU engine's KV cache, next to memcpy (tools/bench_register.h)
//   kvtier-bench host --events [--blocks 64] [--block-tokens 16] [--reps 7]
//       the same, events off vs on (tools/bench_events.h)
//       store then load of 2 MiB blocks through kvtierd into a shared-memory
//       KV cache, next to a memcpy of the same bytes on one thread and on as
//       many as kvtierd copies with, and a streaming-store copy on as many
//       (the copy kvtierd makes); stores next to loads
//   kvtier-bench redis  [--blocks 64] [--reps 7] [--socket PATH]
//       the same store then load through kvtierd and through a Redis the
//       bench starts on a unix socket (pipelined SET/GET; tools/bench_redis.h)
//   kvtier-bench disk   [--blocks 256] [--queue-depth 32] [--io-threads 2] [--reps 5] [--set K=V]
//       demotion (host -> disk) and promotion (disk -> host, disk -> engine)
//       of 2 MiB blocks through kvtierd, next to fio (same bytes, block
//       size, queues and depth, writes ending in an fsync) and a
//       file-per-block store; a fresh daemon and segment per repetition
//   kvtier-bench lookup [--keys 128] [--reps 20000] [--index-keys N] [--socket PATH]
//       round-trip latency of one 128-key prompt lookup, next to a SEQPACKET
//       echo and to Redis' pipelined EXISTS; the daemon's index on one core
//       in process (tools/bench_index.h)
//   kvtier-bench gpu    [--device 0] [--blocks 256] [--layout vllm-nhd] ...
//       the CUDA gather/scatter kernels (H2D, D2H, D2D) next to one
//       contiguous cudaMemcpy of the same bytes (tools/bench_gpu.h); no daemon
//
// Without --socket the daemon workloads start their own kvtierd (next to this
// binary) on a temporary socket, and stop it afterwards.
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/block_pattern.h"
#include "ipc/seqpacket.h"
#include "kernels/copy_reference.h"
#include "kvtier/client.h"
#include "tiers/disk/record.h"
#include "tools/bench_abuse.h"
#include "tools/bench_compress.h"
#include "tools/bench_disk.h"
#include "tools/bench_engine.h"
#include "tools/bench_events.h"
#include "tools/bench_gpu.h"
#include "tools/bench_index.h"
#include "tools/bench_redis.h"
#include "tools/bench_register.h"
#include "tools/bench_remote.h"
#include "tools/bench_report.h"
#include "tools/bench_trace.h"

namespace {

using kvtier::bench::Clock;
using kvtier::bench::Comparison;
using kvtier::bench::Median;
using kvtier::bench::PrintComparisons;
using kvtier::bench::Seconds;
using kvtier::bench::WriteJson;

// A kvtierd of our own, when no --socket is given.
class OwnDaemon {
 public:
  // own_session: kvtierd runs in a session of its own, as a service does
  // (with the kernel's autogroups, the scheduler shares the cores between
  // it and the bench's processes rather than between their threads).
  explicit OwnDaemon(const std::string& host_bytes, std::vector<std::string> extra_sets = {},
                     bool own_session = false)
      : own_session_(own_session) {
    char tmpl[] = "/tmp/kvtier-bench-XXXXXX";
    dir_ = ::mkdtemp(tmpl);
    socket_ = dir_ + "/kvtierd.sock";
    const std::string exe = std::filesystem::read_symlink("/proc/self/exe").parent_path() / "kvtierd";
    args_ = {exe, "--foreground", "--set", "socket.path=" + socket_,
             "--set", "state_dir=" + dir_ + "/state", "--set", "tiers.disk.enabled=false",
             "--set", "metrics.enabled=false", "--set", "log.level=warn",
             "--set", "tiers.host.bytes=" + host_bytes};
    for (const std::string& e : extra_sets) {
      args_.push_back("--set");
      args_.push_back(e);
    }
    Spawn();
    for (int i = 0; i < 2000 && !kvtier::ipc::Connect(socket_); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  ~OwnDaemon() {
    Stop();
    if (::getenv("KVTIER_KEEP_TEST_DIRS") == nullptr) std::filesystem::remove_all(dir_);
  }
  const std::string& socket() const { return socket_; }
  const std::string& dir() const { return dir_; }
  pid_t pid() const { return pid_; }

  void Stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  // Starts it again (after Stop) with the same arguments; returns at once.
  void Spawn() {
    pid_ = ::fork();
    if (pid_ == 0) {
      if (own_session_) ::setsid();
      const std::string log = dir_ + "/kvtierd.log";
      std::freopen(log.c_str(), "a", stderr);
      std::vector<char*> argv;
      for (auto& a : args_) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
  }
  // Resident memory of the daemon, from /proc.
  uint64_t RssBytes() const {
    std::ifstream in("/proc/" + std::to_string(pid_) + "/status");
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
    }
    return 0;
  }

 private:
  std::string dir_, socket_;
  std::vector<std::string> args_;
  bool own_session_ = false;
  pid_t pid_ = -1;
};

using kvtier::bench::Iota;
using kvtier::bench::Llama8BLayout;
using kvtier::bench::Register;
using kvtier::bench::Tokens;

// The copy threads a kvtierd runs, from its Stats ("host: 2 copy
// thread(s)"); `fallback` where it does not say.
uint32_t CopyThreadsOf(kvtier::Client& client, uint32_t fallback) {
  const kvtier::Result<kvtier::DaemonStats> s = client.Stats();
  if (!s) return fallback;
  const std::string& b = s->backend;
  const size_t at = b.find(" copy thread");
  if (at == std::string::npos) return fallback;
  size_t digits = at;
  while (digits > 0 && std::isdigit(static_cast<unsigned char>(b[digits - 1])) != 0) --digits;
  return digits == at ? fallback : static_cast<uint32_t>(std::stoul(b.substr(digits, at - digits)));
}

// `copy` of `bytes` from `src` to `dst` on `threads` threads, each a
// contiguous slice (as kvtierd's copy threads split a batch).
void ParallelCopy(uint8_t* dst, const uint8_t* src, uint64_t bytes, uint32_t threads,
                  void (*copy)(uint8_t*, const uint8_t*, uint64_t)) {
  std::vector<std::thread> workers;
  const uint64_t slice = (bytes + threads - 1) / threads;
  for (uint32_t t = 0; t < threads; ++t) {
    const uint64_t begin = std::min(bytes, uint64_t{t} * slice);
    const uint64_t n = std::min(bytes, begin + slice) - begin;
    workers.emplace_back([=] { copy(dst + begin, src + begin, n); });
  }
  for (std::thread& w : workers) w.join();
}

int Host(kvtier::Client& client, uint32_t blocks, uint32_t reps, const std::string& daemon, const std::string& json) {
  const kvtier::Layout layout = Llama8BLayout();
  const uint64_t block_bytes = layout.block_bytes();
  auto cache = kvtier::ShmKvCache::Create(layout, 2 * blocks);
  if (!cache) return 1;
  const std::optional<kvtier::CacheId> registered = Register(client, *cache);
  if (!registered) return 1;
  const kvtier::CacheId id = *registered;
  const uint32_t threads = CopyThreadsOf(client, std::max(1u, std::thread::hardware_concurrency()));
  const double one_way = blocks * static_cast<double>(block_bytes);
  const double bytes = 2.0 * one_way;  // stored + loaded
  std::printf("config:   %u blocks of %.1f MiB per op, store then load, %u reps (+1 warm-up); kvtierd copies "
              "with %u thread(s)\n",
              blocks, static_cast<double>(block_bytes) / (1 << 20), reps, threads);
  std::fflush(stdout);

  std::vector<double> kv_gbps, store_gbps, load_gbps, memcpy_gbps, memcpy_n_gbps, stream_n_gbps;
  uint64_t mismatches = 0;
  uint8_t* const out = cache->block(0).data();
  uint8_t* const back = cache->block(blocks).data();
  const uint64_t span = blocks * block_bytes;
  for (uint32_t rep = 0; rep <= reps; ++rep) {
    const std::vector<kvtier::BlockKey> keys = client.ComputeKeys(id, Tokens(rep + 1, blocks * 16)).value();
    for (uint32_t i = 0; i < blocks; ++i) kvtier::FillFromKey(keys[i], cache->block(i));
    const auto t0 = Clock::now();
    auto stored = client.Store(id, keys, Iota(0, blocks));
    const auto t1 = Clock::now();
    auto loaded = client.Load(id, keys, Iota(blocks, blocks));
    const auto t2 = Clock::now();
    if (!stored || !loaded || stored->blocks != blocks || loaded->blocks != blocks) {
      std::fprintf(stderr, "kvtier-bench: store/load failed: %s\n",
                   (!stored ? stored.error() : !loaded ? loaded.error() : kvtier::Status()).ToString().c_str());
      return 1;
    }
    for (uint32_t i = 0; i < blocks; ++i) mismatches += !kvtier::MatchesKey(keys[i], cache->block(blocks + i));
    // Baselines: the same bytes copied out and back by one thread, then by
    // as many threads as kvtierd copies with; with memcpy, then with the
    // streaming stores kvtierd copies with (the machine's limit).
    constexpr auto kMemcpy = [](uint8_t* d, const uint8_t* s, uint64_t n) { std::memcpy(d, s, n); };
    const auto m0 = Clock::now();
    std::memcpy(back, out, span);
    std::memcpy(out, back, span);
    const auto m1 = Clock::now();
    ParallelCopy(back, out, span, threads, kMemcpy);
    ParallelCopy(out, back, span, threads, kMemcpy);
    const auto m2 = Clock::now();
    ParallelCopy(back, out, span, threads, kvtier::CopyStreaming);
    ParallelCopy(out, back, span, threads, kvtier::CopyStreaming);
    const auto m3 = Clock::now();
    (void)client.Evict();  // keep the host tier from filling across reps
    if (rep == 0) continue;  // warm-up: first touches of the arenas
    kv_gbps.push_back(bytes / Seconds(t2 - t0) / 1e9);
    store_gbps.push_back(one_way / Seconds(t1 - t0) / 1e9);
    load_gbps.push_back(one_way / Seconds(t2 - t1) / 1e9);
    memcpy_gbps.push_back(bytes / Seconds(m1 - m0) / 1e9);
    memcpy_n_gbps.push_back(bytes / Seconds(m2 - m1) / 1e9);
    stream_n_gbps.push_back(bytes / Seconds(m3 - m2) / 1e9);
    std::printf("rep %u/%u: %.2f GB/s (store %.2f, load %.2f; memcpy %.2f, on %u threads %.2f, streaming on %u "
                "threads %.2f GB/s)\n",
                rep, reps, kv_gbps.back(), store_gbps.back(), load_gbps.back(), memcpy_gbps.back(), threads,
                memcpy_n_gbps.back(), threads, stream_n_gbps.back());
    std::fflush(stdout);
  }
  const std::string on_threads =
      "memcpy on " + std::to_string(threads) + " thread(s) (kvtierd's copy threads), out and back";
  const std::vector<Comparison> cs = {
      {"store+load 2 MiB blocks via kvtierd", Median(kv_gbps), Median(memcpy_gbps), "single-thread memcpy, out and back",
       "GB/s"},
      {"store+load 2 MiB blocks via kvtierd", Median(kv_gbps), Median(memcpy_n_gbps), on_threads, "GB/s"},
      {"store+load 2 MiB blocks via kvtierd", Median(kv_gbps), Median(stream_n_gbps),
       "streaming-store copy on " + std::to_string(threads) + " thread(s), out and back", "GB/s"},
      {"store 2 MiB blocks via kvtierd", Median(store_gbps), Median(load_gbps), "load of the same blocks, same run",
       "GB/s"}};
  PrintComparisons(cs);
  std::printf("verified: %lu of %lu loaded blocks byte-exact\n", uint64_t{blocks} * reps + blocks - mismatches,
              uint64_t{blocks} * (reps + 1));
  if (!json.empty() &&
      !WriteJson(json, {{"workload", "host"}, {"blocks", std::to_string(blocks)},
                        {"block_bytes", std::to_string(block_bytes)}, {"reps", std::to_string(reps)},
                        {"copy_threads", std::to_string(threads)}, {"daemon", daemon}},
                 cs)) {
    std::fprintf(stderr, "kvtier-bench: cannot write %s\n", json.c_str());
    return 1;
  }
  return mismatches == 0 ? 0 : 1;
}

// Baseline for a lookup: the round trip of a small message over a
// SOCK_SEQPACKET socket pair to an echoing process, the floor for any
// request/reply over a unix socket on this machine.
double RawRoundTripMicros(uint32_t reps) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) return 0;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(sv[0]);
    char buf[256];
    for (ssize_t n; (n = ::read(sv[1], buf, sizeof(buf))) > 0;) {
      if (::write(sv[1], buf, static_cast<size_t>(n)) != n) break;
    }
    ::_exit(0);
  }
  ::close(sv[1]);
  std::vector<double> us;
  char buf[256] = {};
  for (uint32_t i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    if (::write(sv[0], buf, 64) != 64 || ::read(sv[0], buf, sizeof(buf)) != 64) break;
    us.push_back(Seconds(Clock::now() - t0) * 1e6);
  }
  ::close(sv[0]);
  ::waitpid(pid, nullptr, 0);
  return Median(us);
}

// Warm restart: index `blocks` small (4 KiB) blocks on disk, restart the
// daemon, and time from its start to the first hit served; and the daemon's
// memory per indexed block, next to the same daemon with an empty index.
int Restart(uint32_t blocks, const std::string& dir, const std::string& json) {
  const kvtier::Layout layout = kvtier::Layout::Create({.model_id = "kvtier/bench-4k", .num_layers = 1,
                                                        .kv_kind = kvtier::KvKind::kSeparateKv, .num_kv_heads = 1,
                                                        .head_dim = 64, .dtype = kvtier::DType::kBf16,
                                                        .block_tokens = 16, .tp_rank = 0, .tp_size = 1,
                                                        .scale_bytes_per_layer = 0})
                                    .value();
  const uint64_t disk_bytes = (uint64_t{blocks} * kvtier::RecordBytes(layout.block_bytes()) * 11 / 10 / (64 << 20) + 2) * (64 << 20);
  // The host tier faulted on use, as in both daemons it holds nearly nothing:
  // the memory measured is the index's.
  const std::vector<std::string> sets = {
      "tiers.host.prefault=false", "tiers.disk.enabled=true", "tiers.disk.paths=[" + dir + "/segments]",
      "tiers.disk.bytes=" + std::to_string(disk_bytes), "tiers.disk.region_bytes=64MiB",
      std::string("tiers.disk.io_engine=") + (getenv("KVTIER_BENCH_ENGINE") ? getenv("KVTIER_BENCH_ENGINE") : "auto"),
      "tenants=[{name: bench, uid: " + std::to_string(::getuid()) + ", admin: true}]"};
  std::printf("config:   %u blocks of %lu bytes indexed on disk (%.1f GiB of segments) in %s\n", blocks,
              layout.block_bytes(), static_cast<double>(disk_bytes) / (1 << 30), dir.c_str());
  // The baseline: the same daemon with nothing indexed.
  uint64_t empty_rss = 0;
  {
    OwnDaemon empty("64MiB", sets);
    auto c = kvtier::Client::Connect({.socket_path = empty.socket(), .client_name = "kvtier-bench"});
    if (!c) return 1;
    empty_rss = empty.RssBytes();
  }
  std::filesystem::remove_all(dir + "/segments");
  OwnDaemon d("64MiB", sets);
  auto c = kvtier::Client::Connect({.socket_path = d.socket(), .client_name = "kvtier-bench",
                                    .reconnect_interval = std::chrono::milliseconds(1)});
  if (!c) return 1;
  constexpr uint32_t kBatch = 4096;
  auto cache = kvtier::ShmKvCache::Create(layout, kBatch + 1);
  if (!cache) return 1;
  const std::optional<kvtier::CacheId> registered = Register(**c, *cache);
  if (!registered) return 1;
  const kvtier::CacheId id = *registered;
  kvtier::BlockKey probe;
  const auto s0 = Clock::now();
  for (uint32_t i = 0; i < blocks; i += kBatch) {
    const uint32_t n = std::min(kBatch, blocks - i);
    const std::vector<kvtier::BlockKey> keys = (*c)->ComputeKeys(id, Tokens(uint64_t{i} + 1, n * 16)).value();
    for (uint32_t j = 0; j < n; ++j) kvtier::FillFromKey(keys[j], cache->block(j));
    auto r = (*c)->Store(id, keys, Iota(0, n));
    if (!r) {
      std::fprintf(stderr, "kvtier-bench: store: %s\n", r.error().ToString().c_str());
      return 1;
    }
    // At the disk's pace: the next batch only once this one is on disk.
    (void)(*c)->Flush();
    while (true) {
      auto st = (*c)->Stats();
      if (!st) return 1;
      if (st->tiers.at(1).blocks == 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    probe = keys.back();
    if ((i / kBatch) % 32 == 0) {
      std::printf("  %u of %u blocks on disk (%.0f s)\n", i + n, blocks, Seconds(Clock::now() - s0));
      std::fflush(stdout);
    }
  }
  // Wait until the index holds every block (flushes keep running).
  for (uint64_t on_disk = 0;;) {
    (void)(*c)->Flush();
    auto st = (*c)->Stats();
    if (!st) return 1;
    on_disk = st->tiers.size() > 2 ? st->tiers[2].blocks : 0;
    if (on_disk + st->Counter("evictions_host") >= blocks && st->tiers[1].blocks == 0) break;
    if (Seconds(Clock::now() - s0) > 3600) return 1;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const uint64_t indexed = (*c)->Stats().value().tiers[2].blocks;
  std::printf("  %lu blocks indexed in %.1f s\n", indexed, Seconds(Clock::now() - s0));

  d.Stop();
  const auto t0 = Clock::now();
  d.Spawn();
  double first_hit_s = 0;
  while (true) {
    auto r = (*c)->Load(id, std::span(&probe, 1), std::vector<uint32_t>{kBatch});
    if (r && r->blocks == 1) {
      first_hit_s = Seconds(Clock::now() - t0);
      break;
    }
    if (Seconds(Clock::now() - t0) > 600) return 1;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const bool exact = kvtier::MatchesKey(probe, cache->block(kBatch));
  const uint64_t warm_rss = d.RssBytes();
  const double per_block = indexed ? static_cast<double>(warm_rss - std::min(warm_rss, empty_rss)) / indexed : 0;
  std::printf("\nwarm restart with %lu indexed blocks: first hit served %.2f s after start (%s)\n", indexed,
              first_hit_s, exact ? "byte-exact" : "WRONG BYTES");
  std::printf("daemon memory: %.1f MiB warm, %.1f MiB with an empty index: %.0f bytes per indexed block "
              "(goal: 64)\n",
              static_cast<double>(warm_rss) / (1 << 20), static_cast<double>(empty_rss) / (1 << 20), per_block);
  if (!json.empty()) {
    const std::vector<Comparison> cs = {
        {"memory per indexed block", per_block, 64, "goal", "B", /*lower_is_better=*/true},
        {"first hit after restart", first_hit_s * 1000, 0, "(no baseline)", "ms", /*lower_is_better=*/true}};
    if (!WriteJson(json, {{"workload", "restart"}, {"blocks", std::to_string(indexed)}}, cs)) return 1;
  }
  return exact ? 0 : 1;
}

// `reps` round trips of one lookup of `keys` (after up to 100 untimed
// ones), in microseconds; empty when a lookup fails or finds other than
// `hits` leading keys.
std::vector<double> LookupMicros(kvtier::Client& client, kvtier::CacheId id, std::span<const kvtier::BlockKey> keys,
                                 uint32_t hits, uint32_t reps) {
  const uint32_t warm_up = std::min(reps, 100u);
  std::vector<double> us;
  us.reserve(reps + warm_up);
  for (uint32_t i = 0; i < reps + warm_up; ++i) {
    const auto t0 = Clock::now();
    auto r = client.Lookup(id, keys);
    const auto t1 = Clock::now();
    if (!r || r->hits != hits) {
      std::fprintf(stderr, "kvtier-bench: lookup: %s\n",
                   r ? ("found " + std::to_string(r->hits) + " of " + std::to_string(hits)).c_str()
                     : r.error().ToString().c_str());
      return {};
    }
    us.push_back(Seconds(t1 - t0) * 1e6);
  }
  us.erase(us.begin(), us.begin() + warm_up);
  return us;
}

double P99(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() * 99 / 100];
}

// A prompt lookup three ways: its round trip through kvtierd next to a raw
// SEQPACKET echo (half the prompt cached) and next to Redis' pipelined EXISTS
// (all of it cached, on both sides), and the daemon's index on one core in
// this process next to std::unordered_map.
int Lookup(kvtier::Client& client, uint32_t nkeys, uint32_t reps, uint64_t index_keys, const std::string& daemon,
           const std::string& json) {
  const kvtier::Layout layout = Llama8BLayout();
  auto cache = kvtier::ShmKvCache::Create(layout, nkeys);
  if (!cache) return 1;
  const std::optional<kvtier::CacheId> registered = Register(client, *cache);
  if (!registered) return 1;
  const kvtier::CacheId id = *registered;
  const std::vector<kvtier::BlockKey> keys = client.ComputeKeys(id, Tokens(7, nkeys * 16)).value();
  std::printf("config:   %u-key prompt, %u lookups per measurement; in-process index of %lu keys\n", nkeys, reps,
              index_keys);
  std::fflush(stdout);
  // Half the prompt cached, so the daemon walks hits and a miss.
  (void)client.Store(id, std::span(keys).first(nkeys / 2), Iota(0, nkeys / 2));
  const std::vector<double> half = LookupMicros(client, id, keys, nkeys / 2, reps);
  if (half.empty()) return 1;
  std::printf("kvtier lookup, %u of %u keys cached: median %.1f us, p99 %.1f us\n", nkeys / 2, nkeys, Median(half),
              P99(half));
  std::fflush(stdout);
  const double raw = RawRoundTripMicros(reps);
  std::printf("64-byte SEQPACKET echo to another process: median %.1f us\n", raw);

  // The whole prompt cached, for the comparison with Redis, where every key
  // is SET (a pipeline of EXISTS cannot stop at the first miss).
  auto stored = client.Store(id, keys, Iota(0, nkeys));
  if (!stored || stored->blocks + stored->already != nkeys) {
    std::fprintf(stderr, "kvtier-bench: store of the prompt: %s\n",
                 stored ? "not every block stored" : stored.error().ToString().c_str());
    return 1;
  }
  const std::vector<double> full = LookupMicros(client, id, keys, nkeys, reps);
  if (full.empty()) return 1;
  std::printf("kvtier lookup, all %u keys cached: median %.1f us, p99 %.1f us\n", nkeys, Median(full), P99(full));
  std::fflush(stdout);
  auto redis = kvtier::bench::RedisLookupMicros(keys, reps);
  if (redis) {
    std::printf("Redis %s, %u pipelined EXISTS: median %.1f us, p99 %.1f us; one EXISTS of %u keys (a count, "
                "not which): median %.1f us\n",
                redis->version.c_str(), nkeys, Median(redis->pipelined_us), P99(redis->pipelined_us), nkeys,
                Median(redis->count_us));
  } else {
    std::fprintf(stderr, "kvtier-bench: Redis baseline skipped: %s\n", redis.error().ToString().c_str());
  }
  std::fflush(stdout);

  std::printf("in-process index: %lu keys, %u-key prompts drawn at random, one core\n", index_keys, nkeys);
  const kvtier::bench::IndexFindRates rates =
      kvtier::bench::MeasureIndexFind({.index_keys = index_keys, .prompt_keys = nkeys});
  if (rates.index_finds_per_s == 0) return 1;

  const std::string n = std::to_string(nkeys);
  std::vector<Comparison> cs = {{"lookup " + n + " keys (" + std::to_string(nkeys / 2) + " cached), round trip",
                                 Median(half), raw, "64-byte SEQPACKET echo, another process", "us",
                                 /*lower_is_better=*/true}};
  if (redis) {
    cs.push_back({"lookup " + n + " keys (all cached) vs Redis", Median(full), Median(redis->pipelined_us),
                  "Redis " + redis->version + ": " + n + " pipelined EXISTS, unix socket", "us",
                  /*lower_is_better=*/true, /*target=*/5});
  }
  cs.push_back({"index finds, one core, " + std::to_string(index_keys) + " keys", rates.index_finds_per_s / 1e6,
                rates.map_finds_per_s / 1e6, "std::unordered_map<StoredKey, uint64_t>::find, same keys", "M/s",
                /*lower_is_better=*/false, /*target=*/0, /*kvtier_target=*/10});
  PrintComparisons(cs);
  std::printf("index finds: BlockIndex::Find after Prefetch of each prompt's keys, as BlockCache::Lookup does "
              "(entries of %lu bytes), every key present; no LRU touch, no reply, no socket\n",
              rates.entry_bytes);
  if (!json.empty() &&
      !WriteJson(json, {{"workload", "lookup"}, {"keys", n}, {"reps", std::to_string(reps)},
                        {"index_keys", std::to_string(index_keys)}, {"daemon", daemon},
                        {"redis_version", redis ? redis->version : "(not run)"}},
                 cs)) {
    std::fprintf(stderr, "kvtier-bench: cannot write %s\n", json.c_str());
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvtier-bench: kvtier next to its baselines", "kvtier-bench"};
  std::string socket;
  app.add_option("-s,--socket", socket, "use a running kvtierd (default: start one)");
  app.require_subcommand(1);
  app.fallthrough();
  CLI::App* host = app.add_subcommand("host", "store then load 2 MiB blocks vs memcpy");
  uint32_t blocks = 64, host_reps = 7;
  host->add_option("--blocks", blocks, "blocks per op")->check(CLI::Range(1, 4096));
  host->add_option("--reps", host_reps, "repetitions")->check(CLI::Range(1, 1000));
  bool host_events = false;
  uint32_t host_block_tokens = 16;
  host->add_flag("--events", host_events,
                 "events off vs on: two kvtierd of their own, the same ops with block metadata (KV events)");
  host->add_option("--block-tokens", host_block_tokens, "tokens per block with --events (16: 2 MiB blocks)")
      ->check(CLI::Range(1, 4096));
  CLI::App* redis = app.add_subcommand("redis", "store then load 2 MiB blocks: kvtierd vs a Redis it starts");
  redis->add_option("--blocks", blocks, "blocks per op")->check(CLI::Range(1, 4096));
  redis->add_option("--reps", host_reps, "repetitions (median reported; +1 warm-up)")->check(CLI::Range(1, 1000));
  CLI::App* remote = app.add_subcommand("remote", "remote tier (Redis Cluster) store/load/lookup vs a plain pipelined client");
  kvtier::bench::RemoteBenchOptions remote_options;
  remote->add_option("--seeds", remote_options.seeds, "host:port of a cluster to use (default: start one)");
  remote->add_option("--reps", remote_options.reps, "repetitions (median reported; +1 warm-up)")->check(CLI::Range(1, 100));
  CLI::App* disk = app.add_subcommand("disk", "disk tier write/read vs fio and a file-per-block store");
  kvtier::bench::DiskConfig disk_config{.dir = "./var/kvtier-bench"};
  uint32_t disk_reps = 5;
  std::vector<std::string> disk_sets;
  std::string json;
  disk->add_option("--blocks", disk_config.blocks, "2 MiB blocks to write and read")
      ->check(CLI::Range(32, 100000));
  disk->add_option("--queue-depth", disk_config.queue_depth,
                   "io_uring queue depth per I/O thread (kvtier and fio)")
      ->check(CLI::Range(1, 4096));
  disk->add_option("--io-threads", disk_config.io_threads,
                   "kvtierd I/O threads (rings); fio runs as many jobs")
      ->check(CLI::Range(1, 64));
  disk->add_option("--reps", disk_reps,
                   "repetitions, each with a fresh daemon and segment (median reported)")
      ->check(CLI::Range(1, 100));
  disk->add_option("--dir", disk_config.dir,
                   "directory on the file system to measure (started daemon only)");
  disk->add_option("--set", disk_sets, "extra kvtierd --set key=value (started daemon only)");
  app.add_option("--json", json, "also write the comparisons as JSON to this file");
  CLI::App* restart = app.add_subcommand("restart", "warm restart time and memory per indexed block");
  uint32_t restart_blocks = 1000000;
  std::string restart_dir = "./var/kvtier-bench-restart";
  restart->add_option("--blocks", restart_blocks, "4 KiB blocks to index")->check(CLI::Range(1000, 100000000));
  restart->add_option("--dir", restart_dir, "directory for the segments");
  CLI::App* lookup = app.add_subcommand("lookup", "128-key prompt lookup latency");
  uint32_t nkeys = 128, lookup_reps = 20000;
  lookup->add_option("--keys", nkeys, "keys per lookup")->check(CLI::Range(2, 16384));
  lookup->add_option("--reps", lookup_reps, "lookups")->check(CLI::Range(1, 10000000));
  uint64_t index_keys = uint64_t{1} << 20;
  lookup->add_option("--index-keys", index_keys, "keys in the in-process index")->check(CLI::Range(1, 1 << 28));
  CLI::App* gpu = app.add_subcommand("gpu", "paged gather/scatter H2D, D2H, D2D vs contiguous cudaMemcpy");
  kvtier::bench::GpuOptions gpu_options;
  gpu->add_option("--device", gpu_options.device, "CUDA device index")->check(CLI::NonNegativeNumber);
  gpu->add_option("--block-bytes", gpu_options.block_bytes,
                  "bytes per block, a multiple of 128 KiB (one token of the 32-layer model)")
      ->check(CLI::Range(uint64_t{128} << 10, uint64_t{1} << 30));
  gpu->add_option("--blocks", gpu_options.blocks, "blocks copied per measurement")->check(CLI::Range(1, 65536));
  gpu->add_option("--cache-blocks", gpu_options.cache_blocks,
                  "blocks in the engine cache, the copied ones scattered over it (default: 2x --blocks)")
      ->check(CLI::Range(1, 1 << 20));
  gpu->add_option("--reps", gpu_options.reps, "timed repetitions (median reported; +1 warm-up)")
      ->check(CLI::Range(1, 1000));
  gpu->add_option("--layout", gpu_options.layout, "engine cache layout")
      ->check(CLI::IsMember({"vllm-nhd", "vllm-hnd", "sglang-layer-first", "sglang-page-first", "contiguous"}));
  CLI::App* compress = app.add_subcommand("compress", "the block codecs on one core: ratio and GB/s vs memcpy");
  kvtier::bench::CompressOptions compress_options;
  compress->add_option("--block-kib", compress_options.block_kib, "block size in KiB")->check(CLI::Range(4, 65536));
  compress->add_option("--blocks", compress_options.blocks, "blocks per rep")->check(CLI::Range(1, 4096));
  compress->add_option("--reps", compress_options.reps, "repetitions (median)")->check(CLI::Range(1, 1000));
  CLI::App* reg =
      app.add_subcommand("register", "registering a CPU engine's KV cache, next to memcpy");
  kvtier::bench::RegisterOptions register_options;
  reg->add_option("--gib", register_options.gib, "cache sizes in GiB")
      ->delimiter(',')
      ->check(CLI::Range(1, 4096));
  reg->add_option("--reps", register_options.reps, "repetitions (median)")
      ->check(CLI::Range(1, 100));
  CLI::App* trace = app.add_subcommand("trace", "replay a Mooncake trace: hit rates vs LRU, Belady and the ceiling");
  kvtier::bench::TraceOptions trace_options;
  trace->add_option("--trace", trace_options.trace_path, "JSONL request trace (../shared/traces/)")->required();
  trace->add_option("--hbm-bytes", trace_options.hbm_bytes, "hbm tier size, 0 = off")
      ->transform(CLI::AsSizeValue(false));
  trace->add_option("--host-bytes", trace_options.host_bytes, "host tier size (> 0)")
      ->transform(CLI::AsSizeValue(false));
  trace->add_option("--disk-bytes", trace_options.disk_bytes, "disk tier size, 0 = off")
      ->transform(CLI::AsSizeValue(false));
  trace->add_option("--block-bytes", trace_options.block_bytes, "bytes per 512-token block, a multiple of 4 KiB")
      ->transform(CLI::AsSizeValue(false));
  trace->add_option("--host-quota", trace_options.host_quota_bytes, "the replaying tenant's host quota, 0 = none")
      ->transform(CLI::AsSizeValue(false));
  trace->add_option("--disk-quota", trace_options.disk_quota_bytes, "the replaying tenant's disk quota, 0 = none")
      ->transform(CLI::AsSizeValue(false));
  trace->add_option("--clients", trace_options.clients, "client processes")->check(CLI::Range(1, 64));
  trace->add_option("--requests", trace_options.requests, "replay the first N requests only (0 = all)");
  trace->add_option("--speed", trace_options.speed, "x the trace's pace (0 = as fast as possible)")
      ->check(CLI::NonNegativeNumber);
  trace->add_option("--dir", trace_options.dir, "directory for the disk tier's segments (started daemon only)");
  trace->add_option("--set", trace_options.sets, "extra kvtierd --set key=value (started daemon only)");
  trace->add_option("--policy", trace_options.policy,
                    "eviction policy of the started daemon, and a simulated sweep of it next to LRU and Belady")
      ->check(CLI::IsMember({"lru", "s3fifo", "classes"}));
  trace->add_flag("--sweep", trace_options.sweep,
                  "replay --policy and lru through daemons of 1k-20k blocks, one tier and all three");
  trace->add_flag("--contend", trace_options.contend,
                  "fio writes to --dir's file system while the clients replay (a contended disk)");
  trace->add_flag("--partial-tail", trace_options.partial_tail,
                  "also look up and store each request's partial last block (engines store full blocks only)");
  trace
      ->add_option_function<std::string>(
          "--codec",
          [&](const std::string& name) {
            kvtier::Result<kvtier::CodecKind> k = kvtier::ParseCodec(name);
            if (!k) throw CLI::ValidationError("--codec", k.error().message());
            trace_options.codec = *k;
          },
          "lossless or fp8: replay with it and without (none), same tier bytes, KV-like blocks")
      ->check(CLI::IsMember({"none", "lossless", "fp8"}));
  CLI::App* abuse = app.add_subcommand("abuse", "one tenant's lookup latency while another loops namespaces/evict");
  kvtier::bench::AbuseOptions abuse_options;
  abuse->add_option("--blocks", abuse_options.blocks, "4 KiB blocks the victim stores")
      ->check(CLI::Range(4096, 100000000));
  abuse->add_option("--seconds", abuse_options.seconds, "seconds per phase")->check(CLI::Range(1, 3600));
  abuse->add_option("--reps", abuse_options.reps, "repetitions (medians reported)")->check(CLI::Range(1, 100));
  abuse->add_option("--sessions", abuse_options.sessions,
                    "instead: one tenant's loads beside another's stores and loads on this many sessions, "
                    "next to the same beside its one")
      ->check(CLI::Range(2, 1024));
  CLI11_PARSE(app, argc, argv);

  if (gpu->parsed()) {
    gpu_options.json = json;
    return kvtier::bench::Gpu(gpu_options);
  }
  kvtier::bench::PrintMachine();
  if (compress->parsed()) {
    compress_options.json = json;
    return kvtier::bench::Compress(compress_options);
  }
  if (reg->parsed()) {
    register_options.json = json;
    return kvtier::bench::RegisterCost(register_options);
  }
  if (trace->parsed()) {
    trace_options.socket = socket;
    trace_options.json = json;
    std::unique_ptr<OwnDaemon> daemon;
    return kvtier::bench::Trace(trace_options, [&](uint64_t host_bytes, std::vector<std::string> sets) {
      daemon = std::make_unique<OwnDaemon>(std::to_string(host_bytes), std::move(sets));
      return kvtier::bench::StartedDaemon{daemon->socket(), [&] { daemon->Stop(); }};
    });
  }
  if (abuse->parsed()) {
    abuse_options.json = json;
    std::unique_ptr<OwnDaemon> daemon;
    return kvtier::bench::Abuse(abuse_options, [&](uint64_t host_bytes, std::vector<std::string> sets) {
      if (!socket.empty()) return socket;  // a running kvtierd, configured with the three tenants
      daemon = std::make_unique<OwnDaemon>(std::to_string(host_bytes), std::move(sets), /*own_session=*/true);
      return daemon->socket();
    });
  }
  if (host->parsed() && host_events) {
    if (!socket.empty()) {
      std::fprintf(stderr, "kvtier-bench: host --events starts its own two kvtierd; --socket is not used\n");
      return 2;
    }
    std::vector<std::unique_ptr<OwnDaemon>> nodes;
    return kvtier::bench::HostEvents(
        {.blocks = blocks, .block_tokens = host_block_tokens, .reps = host_reps, .json = json},
        [&](uint64_t host_bytes, std::vector<std::string> sets) {
          nodes.push_back(std::make_unique<OwnDaemon>(std::to_string(host_bytes), std::move(sets)));
          OwnDaemon* node = nodes.back().get();
          return kvtier::bench::StartedDaemon{node->socket(), [node] { node->Stop(); }};
        });
  }
  if (remote->parsed()) {
    remote_options.json = json;
    std::vector<std::unique_ptr<OwnDaemon>> nodes;
    return kvtier::bench::Remote(remote_options, [&](uint64_t host_bytes, std::vector<std::string> sets) {
      nodes.push_back(std::make_unique<OwnDaemon>(std::to_string(host_bytes), std::move(sets)));
      OwnDaemon* node = nodes.back().get();
      return kvtier::bench::StartedDaemon{node->socket(), [node] { node->Stop(); }};
    });
  }
  if (restart->parsed()) {
    std::filesystem::create_directories(restart_dir);
    return Restart(restart_blocks, std::filesystem::absolute(restart_dir).string(), json);
  }
  if (disk->parsed()) {
    std::unique_ptr<OwnDaemon> daemon;
    if (socket.empty()) {
      std::filesystem::create_directories(disk_config.dir);
      disk_config.dir = std::filesystem::absolute(disk_config.dir).lexically_normal().string();
      disk_config.segment_file = disk_config.dir + "/segments/segment-0.kvt";  // server_setup.cc's name
    }
    std::printf("daemon:   %s\n",
                socket.empty() ? "started by kvtier-bench, one per rep" : socket.c_str());
    auto connect = [&](uint32_t) -> std::unique_ptr<kvtier::Client> {
      std::string path = socket;
      if (path.empty()) {
        daemon.reset();  // the previous repetition's, and its segment
        const std::string segments = disk_config.dir + "/segments";
        std::filesystem::remove_all(segments);
        const uint64_t data = uint64_t{disk_config.blocks} * (2 << 20);
        std::vector<std::string> sets = {
            "tiers.disk.enabled=true",
            "tiers.disk.paths=[" + segments + "]",
            "tiers.disk.bytes=" + std::to_string(data * 2),
            "tiers.disk.region_bytes=64MiB",
            "tiers.disk.queue_depth=" + std::to_string(disk_config.queue_depth),
            "tiers.disk.io_threads=" + std::to_string(disk_config.io_threads),
            "policy.watermarks.host={high: 1.0, low: 0.99}",
            "tenants=[{name: bench, uid: " + std::to_string(::getuid()) + ", admin: true}]"};
        sets.insert(sets.end(), disk_sets.begin(), disk_sets.end());
        daemon =
            std::make_unique<OwnDaemon>(std::to_string(data + (256ull << 20)), std::move(sets));
        path = daemon->socket();
      }
      auto c = kvtier::Client::Connect({.socket_path = path, .client_name = "kvtier-bench"});
      if (!c) {
        std::fprintf(stderr, "kvtier-bench: %s\n", c.error().ToString().c_str());
        return nullptr;
      }
      return std::move(*c);
    };
    const int rc = kvtier::bench::Disk(connect, disk_config, disk_reps, json);
    if (daemon) {
      daemon.reset();
      std::filesystem::remove_all(disk_config.dir + "/segments");
    }
    return rc;
  }
  std::unique_ptr<OwnDaemon> own;
  if (socket.empty()) {
    const uint64_t host_bytes = std::max<uint64_t>({256ull << 20, uint64_t{blocks} * 4 * (2 << 20),
                                                    uint64_t{nkeys} * (2 << 20) + (256ull << 20)});
    own = std::make_unique<OwnDaemon>(std::to_string(host_bytes));
    socket = own->socket();
  }
  const std::string daemon = own ? "started by kvtier-bench" : socket;
  std::printf("daemon:   %s\n", daemon.c_str());
  auto client = kvtier::Client::Connect({.socket_path = socket, .client_name = "kvtier-bench"});
  if (!client) {
    std::fprintf(stderr, "kvtier-bench: %s\n", client.error().ToString().c_str());
    return 1;
  }
  if (host->parsed()) return Host(**client, blocks, host_reps, daemon, json);
  if (redis->parsed())
    return kvtier::bench::RedisWorkload(**client, Llama8BLayout(), blocks, host_reps, daemon, json);
  return Lookup(**client, nkeys, lookup_reps, index_keys, daemon, json);
}
