// kvtier-bench: whole-system benchmarks, each figure printed next to a
// baseline measured in the same run (the machines are shared and noisy, so
// absolute numbers mean little; ratios do).
//
//   kvtier-bench host   [--blocks 64] [--reps 7] [--socket PATH]
//       store then load of 2 MiB blocks through kvtierd into a shared-memory
//       KV cache, next to a single-thread memcpy of the same bytes
//   kvtier-bench lookup [--keys 128] [--reps 20000] [--socket PATH]
//       round-trip latency of one 128-key prompt lookup
//
// Without --socket it starts its own kvtierd (next to this binary) on a
// temporary socket, and stops it afterwards.
#include <signal.h>
#include <sys/socket.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "common/block_pattern.h"
#include "ipc/seqpacket.h"
#include "kvtier/client.h"

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

void PrintMachine() {
  std::string cpu = "unknown";
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) {
      cpu = line.substr(line.find(':') + 2);
      break;
    }
  }
  utsname u{};
  ::uname(&u);
  std::printf("machine:  %s, %u cpus, Linux %s\n", cpu.c_str(), std::thread::hardware_concurrency(), u.release);
}

// A kvtierd of our own, when no --socket is given.
class OwnDaemon {
 public:
  explicit OwnDaemon(const std::string& host_bytes) {
    char tmpl[] = "/tmp/kvtier-bench-XXXXXX";
    dir_ = ::mkdtemp(tmpl);
    socket_ = dir_ + "/kvtierd.sock";
    const std::string exe = std::filesystem::read_symlink("/proc/self/exe").parent_path() / "kvtierd";
    pid_ = ::fork();
    if (pid_ == 0) {
      const std::string log = dir_ + "/kvtierd.log";
      std::freopen(log.c_str(), "w", stderr);
      std::vector<std::string> args = {exe, "--foreground", "--set", "socket.path=" + socket_,
                                       "--set", "state_dir=" + dir_ + "/state", "--set", "tiers.disk.enabled=false",
                                       "--set", "metrics.enabled=false", "--set", "log.level=warn",
                                       "--set", "tiers.host.bytes=" + host_bytes};
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    for (int i = 0; i < 2000 && !kvtier::ipc::Connect(socket_); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  ~OwnDaemon() {
    ::kill(pid_, SIGTERM);
    ::waitpid(pid_, nullptr, 0);
    std::filesystem::remove_all(dir_);
  }
  const std::string& socket() const { return socket_; }

 private:
  std::string dir_, socket_;
  pid_t pid_ = -1;
};

kvtier::Layout Llama8BLayout() {
  // Llama-3.1-8B: 32 layers, 8 KV heads x 128, bf16, 16-token blocks = 2 MiB.
  return kvtier::Layout::Create({.model_id = "meta-llama/Llama-3.1-8B", .num_layers = 32,
                                 .kv_kind = kvtier::KvKind::kSeparateKv, .num_kv_heads = 8, .head_dim = 128,
                                 .dtype = kvtier::DType::kBf16, .block_tokens = 16, .tp_rank = 0, .tp_size = 1,
                                 .scale_bytes_per_layer = 0})
      .value();
}

std::vector<uint32_t> Iota(uint32_t first, uint32_t n) {
  std::vector<uint32_t> v(n);
  for (uint32_t i = 0; i < n; ++i) v[i] = first + i;
  return v;
}

std::vector<uint32_t> Tokens(uint64_t seed, uint32_t n) {
  std::vector<uint32_t> t(n);
  for (auto& x : t) x = static_cast<uint32_t>(kvtier::SplitMix64(seed) % 128000);
  return t;
}

int Host(kvtier::Client& client, uint32_t blocks, uint32_t reps) {
  const kvtier::Layout layout = Llama8BLayout();
  const uint64_t block_bytes = layout.block_bytes();
  auto cache = kvtier::ShmKvCache::Create(layout, 2 * blocks);
  if (!cache) return 1;
  const kvtier::CacheId id = client.RegisterKvCache(*cache).value();
  const double bytes = 2.0 * blocks * static_cast<double>(block_bytes);  // stored + loaded
  std::printf("config:   %u blocks of %.1f MiB per op, store then load, %u reps (+1 warm-up)\n", blocks,
              static_cast<double>(block_bytes) / (1 << 20), reps);

  std::vector<double> kv_gbps, memcpy_gbps;
  uint64_t mismatches = 0;
  for (uint32_t rep = 0; rep <= reps; ++rep) {
    const std::vector<kvtier::BlockKey> keys = client.ComputeKeys(id, Tokens(rep + 1, blocks * 16)).value();
    for (uint32_t i = 0; i < blocks; ++i) kvtier::FillFromKey(keys[i], cache->block(i));
    const auto t0 = Clock::now();
    auto stored = client.Store(id, keys, Iota(0, blocks));
    auto loaded = client.Load(id, keys, Iota(blocks, blocks));
    const auto t1 = Clock::now();
    if (!stored || !loaded || stored->blocks != blocks || loaded->blocks != blocks) {
      std::fprintf(stderr, "kvtier-bench: store/load failed: %s\n",
                   (!stored ? stored.error() : !loaded ? loaded.error() : kvtier::Status()).ToString().c_str());
      return 1;
    }
    for (uint32_t i = 0; i < blocks; ++i) mismatches += !kvtier::MatchesKey(keys[i], cache->block(blocks + i));
    // Baseline: the same bytes copied by one thread, out and back.
    const auto m0 = Clock::now();
    std::memcpy(cache->block(blocks).data(), cache->block(0).data(), blocks * block_bytes);
    std::memcpy(cache->block(0).data(), cache->block(blocks).data(), blocks * block_bytes);
    const auto m1 = Clock::now();
    (void)client.Evict();  // keep the host tier from filling across reps
    if (rep == 0) continue;  // warm-up: first touches of the arenas
    kv_gbps.push_back(bytes / Seconds(t1 - t0) / 1e9);
    memcpy_gbps.push_back(bytes / Seconds(m1 - m0) / 1e9);
  }
  const double kv = Median(kv_gbps), base = Median(memcpy_gbps);
  std::printf("\n%-44s %10s %10s %8s\n", "comparison", "kvtier", "baseline", "ratio");
  std::printf("%-44s %7.2f GB/s %7.2f GB/s %7.2fx   (baseline: single-thread memcpy)\n",
              "store+load 2 MiB blocks via kvtierd", kv, base, kv / base);
  std::printf("verified: %lu of %lu loaded blocks byte-exact\n", uint64_t{blocks} * reps + blocks - mismatches,
              uint64_t{blocks} * (reps + 1));
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

int Lookup(kvtier::Client& client, uint32_t nkeys, uint32_t reps) {
  const kvtier::Layout layout = Llama8BLayout();
  auto cache = kvtier::ShmKvCache::Create(layout, nkeys);
  if (!cache) return 1;
  const kvtier::CacheId id = client.RegisterKvCache(*cache).value();
  const std::vector<kvtier::BlockKey> keys = client.ComputeKeys(id, Tokens(7, nkeys * 16)).value();
  // Half the prompt cached, so the daemon walks hits and a miss.
  (void)client.Store(id, std::span(keys).first(nkeys / 2), Iota(0, nkeys / 2));
  std::printf("config:   %u-key prompt (%u cached), %u lookups\n", nkeys, nkeys / 2, reps);
  std::vector<double> us;
  us.reserve(reps);
  for (uint32_t i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    auto r = client.Lookup(id, keys);
    const auto t1 = Clock::now();
    if (!r || r->hits != nkeys / 2) return 1;
    us.push_back(Seconds(t1 - t0) * 1e6);
  }
  std::vector<double> sorted = us;
  std::sort(sorted.begin(), sorted.end());
  const double raw = RawRoundTripMicros(reps);
  std::printf("\n%-44s %10s %10s %8s\n", "comparison", "kvtier", "baseline", "ratio");
  std::printf("%-44s %7.1f us %7.1f us %7.2fx   (baseline: 64-byte SEQPACKET echo, another process)\n",
              ("lookup of " + std::to_string(nkeys) + " keys, round trip (median)").c_str(), Median(us), raw,
              raw / Median(us));
  std::printf("lookup p99 %.1f us\n", sorted[sorted.size() * 99 / 100]);
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
  CLI::App* lookup = app.add_subcommand("lookup", "128-key prompt lookup latency");
  uint32_t nkeys = 128, lookup_reps = 20000;
  lookup->add_option("--keys", nkeys, "keys per lookup")->check(CLI::Range(2, 16384));
  lookup->add_option("--reps", lookup_reps, "lookups")->check(CLI::Range(1, 10000000));
  CLI11_PARSE(app, argc, argv);

  PrintMachine();
  std::unique_ptr<OwnDaemon> own;
  if (socket.empty()) {
    const uint64_t host_bytes = std::max<uint64_t>(256ull << 20, uint64_t{blocks} * 4 * (2 << 20));
    own = std::make_unique<OwnDaemon>(std::to_string(host_bytes));
    socket = own->socket();
  }
  std::printf("daemon:   %s\n", own ? "started by kvtier-bench" : socket.c_str());
  auto client = kvtier::Client::Connect({.socket_path = socket, .client_name = "kvtier-bench"});
  if (!client) {
    std::fprintf(stderr, "kvtier-bench: %s\n", client.error().ToString().c_str());
    return 1;
  }
  if (host->parsed()) return Host(**client, blocks, host_reps);
  return Lookup(**client, nkeys, lookup_reps);
}
