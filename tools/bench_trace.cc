#include "tools/bench_trace.h"

#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <span>

#include "kvtier/client.h"
#include "tiers/disk/record.h"
#include "tools/bench_fio.h"
#include "tools/bench_report.h"
#include "tools/policy_sim.h"
#include "tools/trace_replay.h"
#include "tools/trace_sim.h"

namespace kvtier::bench {
namespace {

using trace::SimResult;
using trace::TraceRequest;

constexpr uint64_t kSlotAlignBytes = 4096;  // SlotPool::kSlotAlignBytes: memory tiers' slot stride
constexpr double kLagTargetMs = 10;         // the loop lag's p99 under load, at most
constexpr double kLagMaxTargetMs = 20;      // and its largest
constexpr double kScansPerVictimTarget = 8;  // blocks victim scans look at per victim (issue 48)

struct Capacity {
  uint64_t hbm = 0, host = 0, disk = 0;  // blocks: slots and records the tiers hold
  // The tiers' bytes over the block size: what they would hold if every
  // byte held a block (issue 32's comparison at equal bytes).
  uint64_t hbm_bytes_blocks = 0, host_bytes_blocks = 0, disk_bytes_blocks = 0;
  uint64_t total() const { return hbm + host + disk; }
  uint64_t total_at_bytes() const { return hbm_bytes_blocks + host_bytes_blocks + disk_bytes_blocks; }
  int tiers() const { return (hbm > 0) + (host > 0) + (disk > 0); }
};

std::string Mib(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  return buf;
}

double Pct(uint64_t part, uint64_t whole) {
  return whole == 0 ? 0.0 : 100.0 * static_cast<double>(part) / static_cast<double>(whole);
}

// The sets of a started daemon for these tier sizes.
std::vector<std::string> DaemonSets(const TraceOptions& o, const std::string& segments) {
  std::vector<std::string> sets;
  if (o.hbm_bytes > 0) {
    sets = {"tiers.hbm.enabled=true", "tiers.hbm.bytes=" + std::to_string(o.hbm_bytes)};
  } else {
    sets = {"tiers.hbm.enabled=false"};
  }
  if (o.disk_bytes > 0) {
    // Regions of 1/64 of the tier (1-64 MiB): reclaim frees a region at a
    // time and keeps one free ahead of need, so small tiers need small
    // regions for most of their bytes to hold blocks.
    const uint64_t region = std::clamp<uint64_t>(o.disk_bytes / 64 >> 20, 1, 64) << 20;
    sets.insert(sets.end(), {"tiers.disk.enabled=true", "tiers.disk.paths=[" + segments + "]",
                             "tiers.disk.bytes=" + std::to_string(o.disk_bytes),
                             "tiers.disk.region_bytes=" + std::to_string(region)});
  } else {
    sets.push_back("tiers.disk.enabled=false");
  }
  std::string quotas;
  if (o.host_quota_bytes > 0) quotas += "host: " + std::to_string(o.host_quota_bytes);
  if (o.disk_quota_bytes > 0) {
    quotas +=
        (quotas.empty() ? "" : ", ") + std::string("disk: ") + std::to_string(o.disk_quota_bytes);
  }
  sets.push_back("tenants=[{name: bench, uid: " + std::to_string(::getuid()) +
                 ", admin: true, codecs: [none, lossless, fp8]" +
                 (quotas.empty() ? "" : ", quotas: {" + quotas + "}") + "}]");
  sets.insert(sets.end(), o.sets.begin(), o.sets.end());
  return sets;
}

// Stops a started daemon and removes its segments on every way out.
struct Cleanup {
  std::function<void()> stop;
  std::string segments;
  ~Cleanup() {
    if (stop) stop();
    if (!segments.empty() && ::getenv("KVTIER_KEEP_TEST_DIRS") == nullptr) {
      std::error_code ec;
      std::filesystem::remove_all(segments, ec);
    }
  }
};

// Starts a daemon with the options' tiers (o.socket empty) and sets
// o.socket; false after printing why not.
bool StartDaemon(TraceOptions& o, uint64_t stride, const StartDaemonFn& start_daemon,
                 Cleanup& cleanup) {
  if (o.host_bytes < stride) {
    std::fprintf(
        stderr, "kvtier-bench trace: --host-bytes must hold a block (the host tier is required)\n");
    return false;
  }
  std::string segments;
  if (o.disk_bytes > 0) {
    if (o.disk_bytes < (2 << 20)) {
      std::fprintf(stderr,
                   "kvtier-bench trace: --disk-bytes must be 0 or at least 2 MiB (two regions)\n");
      return false;
    }
    segments = (std::filesystem::absolute(o.dir).lexically_normal() /
                ("segments-" + std::to_string(::getpid())))
                   .string();
    cleanup.segments = segments;
    std::error_code ec;
    std::filesystem::create_directories(segments, ec);
    if (ec) {
      std::fprintf(stderr, "kvtier-bench trace: %s: %s\n", segments.c_str(), ec.message().c_str());
      return false;
    }
  }
  const std::vector<std::string> sets = DaemonSets(o, segments);
  StartedDaemon d = start_daemon(o.host_bytes, sets);
  o.socket = d.socket;
  cleanup.stop = std::move(d.stop);
  std::printf("daemon:   started by kvtier-bench with");
  for (const std::string& s : sets) {
    if (s.rfind("tenants=", 0) != 0) std::printf(" %s", s.c_str());
  }
  if (o.host_quota_bytes > 0)
    std::printf(" (tenant host quota %s)", Mib(o.host_quota_bytes).c_str());
  if (o.disk_quota_bytes > 0)
    std::printf(" (tenant disk quota %s)", Mib(o.disk_quota_bytes).c_str());
  std::printf("\n");
  return true;
}

int64_t Delta(const DaemonStats& before, const DaemonStats& after, std::string_view name) {
  return static_cast<int64_t>(after.Counter(name)) - static_cast<int64_t>(before.Counter(name));
}

void PrintReplay(const ReplayCounts& sum, double wall_s, const DaemonStats& b,
                 const DaemonStats& a) {
  const auto requests = static_cast<double>(sum.requests);
  std::printf(
      "replay:   %" PRIu64 " requests in %.1f s (%.0f requests/s, %.2f ms each on average)\n",
      sum.requests, wall_s, requests / wall_s, requests > 0 ? sum.busy_s * 1000 / requests : 0.0);
  std::printf("hits:     %.2f%% of %" PRIu64
              " block accesses: hbm %.2f%%, host %.2f%%, disk %.2f%%\n",
              Pct(sum.hits, sum.accesses), sum.accesses, Pct(sum.tier_hits[0], sum.accesses),
              Pct(sum.tier_hits[1], sum.accesses), Pct(sum.tier_hits[2], sum.accesses));
  std::printf("          prefill tokens saved: %.2f%% of %" PRIu64 "\n", Pct(sum.hit_tokens, sum.tokens), sum.tokens);
  std::printf("blocks:   %" PRIu64 " loaded (%" PRIu64 " byte-exact, %" PRIu64
              " loads short of their lookup), %" PRIu64 " stored, %" PRIu64
              " already stored, %" PRIu64 " refused\n",
              sum.loaded, sum.loaded - sum.mismatches, sum.short_loads, sum.stored, sum.already,
              sum.rejected);
  if (sum.short_loads > 0) {
    std::printf("          short loads, as the daemon saw them: %" PRId64 " found a key gone (evicted since "
                "the lookup), %" PRId64 " one not servable yet, %" PRId64 " a disk block not read up to host\n",
                Delta(b, a, "loads_short_gone"), Delta(b, a, "loads_short_not_ready"),
                Delta(b, a, "loads_short_disk"));
  }
  auto mib = [&](std::string_view name) {
    return static_cast<double>(Delta(b, a, name)) / (1 << 20);
  };
  std::printf(
      "moved:    engine->cache %.1f MiB, cache->engine %.1f MiB, hbm->host %.1f MiB, host->hbm "
      "%.1f MiB, "
      "host->disk %.1f MiB, disk->host %.1f MiB\n",
      mib("bytes_engine_to_cache"), mib("bytes_cache_to_engine"), mib("bytes_hbm_to_host"),
      mib("bytes_host_to_hbm"), mib("bytes_host_to_disk"), mib("bytes_disk_to_host"));
  std::printf("          promotions %" PRId64 " host->hbm, %" PRId64
              " disk->host; demotions %" PRId64 " hbm->host, %" PRId64
              " host->disk; evictions hbm %" PRId64 ", host %" PRId64 ", disk %" PRId64
              "; prefix fallbacks %" PRId64 "; disk not admitted %" PRId64 "\n",
              Delta(b, a, "promotions"), Delta(b, a, "disk_promotions"), Delta(b, a, "demotions"),
              Delta(b, a, "disk_demotions"), Delta(b, a, "evictions_hbm"),
              Delta(b, a, "evictions_host"), Delta(b, a, "evictions_disk"),
              Delta(b, a, "prefix_fallbacks"), Delta(b, a, "disk_not_admitted"));
  // What the tiers hold once the replay is done: against their capacity,
  // the room the watermarks and the disk's free regions keep.
  std::printf("held:    ");
  for (const TierStats& t : a.tiers) {
    const char* name = BlockTierName(t.tier).data();
    std::printf(" %s %" PRIu64 " blocks (%.0f%% of its bytes)", name, t.blocks,
                Pct(t.used_bytes, t.capacity_bytes));
  }
  std::printf("\n");
  std::printf(
      "disk:     %" PRId64 " regions reclaimed, %" PRId64 " blocks carried forward, %" PRId64
      " hot blocks dropped past the carry budget, %" PRId64 " appends waited for a region; %" PRId64
      " write failures, %" PRId64 " writes given up, %" PRId64 " dirty blocks let go unwritten (write-back behind)\n",
      Delta(b, a, "disk_regions_reclaimed"), Delta(b, a, "disk_reinsertions"),
      Delta(b, a, "disk_reinsertions_dropped"), Delta(b, a, "disk_appends_waited"),
      Delta(b, a, "disk_write_failures"), Delta(b, a, "disk_writes_given_up"), Delta(b, a, "disk_writes_missed"));
  const IoShape io = IoShapeBetween(b, a, /*read=*/false);
  std::printf("          I/O threads: %" PRId64 " writes, %" PRId64 " reads, %" PRId64
              " syncs; mean depth %.1f as each started; idle %.0f%% of their time\n",
              Delta(b, a, "disk_io_writes"), Delta(b, a, "disk_io_reads"), Delta(b, a, "disk_io_syncs"), io.depth,
              io.idle_pct);
  std::printf("          reads: %" PRId64 " failed their checks or I/O, %" PRId64 " waited for host room, %" PRId64
              " found none, %" PRId64 " found their record reclaimed meanwhile\n",
              Delta(b, a, "disk_read_failures"), Delta(b, a, "disk_reads_waited_for_room"),
              Delta(b, a, "disk_reads_without_room"), Delta(b, a, "disk_reads_record_gone"));
  std::printf("loop:     %" PRId64 " turns; over 1 ms %" PRId64 ", 5 ms %" PRId64 ", 10 ms %" PRId64 ", 25 ms %" PRId64
              " (kvtier_loop_turn_duration_seconds)\n",
              Delta(b, a, "loop_turns"), Delta(b, a, "loop_turns_over_1ms"), Delta(b, a, "loop_turns_over_5ms"),
              Delta(b, a, "loop_turns_over_10ms"), Delta(b, a, "loop_turns_over_25ms"));
  // The blocks the scans found: moved out of hbm or host (demoted, written
  // back, back to their disk record) or let go of there.
  const int64_t victims = Delta(b, a, "demotions") + Delta(b, a, "disk_demotions") + Delta(b, a, "disk_returns") +
                          Delta(b, a, "evictions_hbm") + Delta(b, a, "evictions_host");
  const double per_victim =
      static_cast<double>(Delta(b, a, "victim_scan_blocks")) / static_cast<double>(std::max<int64_t>(1, victims));
  std::printf("          victim scans looked at %" PRId64 " blocks, %.2f per block moved or let go (%" PRId64
              "); background scans deferred %" PRId64 " times; posted work past its slice %" PRId64 " times\n",
              Delta(b, a, "victim_scan_blocks"), per_victim, victims, Delta(b, a, "scan_budget_deferrals"),
              Delta(b, a, "loop_posted_deferred"));
  std::printf("target (informational): victim scans look at <= %.0f blocks per block moved or let go: %s\n",
              kScansPerVictimTarget, per_victim <= kScansPerVictimTarget ? "met" : "NOT met");
}

// What the bench watches while the clients replay: the event loop's lag, as
// the round trip of a Stats call (it runs on the loop, behind whatever else
// the loop is doing), and when the disk tier first filled (its first region
// reclaimed), to split the replay's throughput there.
struct Watch {
  std::unique_ptr<Client> client;
  uint64_t reclaimed_before = 0;
  std::vector<double> lag_ms;
  std::optional<double> filled_at_s;
  uint64_t requests_at_fill = 0;
  uint64_t requests_at_end = 0;
  double end_s = 0;
};

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

// One Stats round trip, in ms; nullopt when it failed.
std::optional<double> StatsRoundTrip(Client& c, Result<DaemonStats>* out = nullptr) {
  const auto t0 = Clock::now();
  Result<DaemonStats> st = c.Stats();
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  if (!st) return std::nullopt;
  if (out != nullptr) *out = std::move(st);
  return ms;
}

void PrintWatch(const Watch& w, const std::vector<double>& idle_ms, const ReplayCounts& sum,
                double wall_s, bool has_disk, bool& lag_met) {
  if (has_disk) {
    if (w.filled_at_s && *w.filled_at_s > 0 && *w.filled_at_s < wall_s) {
      const double before = static_cast<double>(w.requests_at_fill) / *w.filled_at_s;
      const double after =
          static_cast<double>(sum.requests - std::min(sum.requests, w.requests_at_fill)) /
          (wall_s - *w.filled_at_s);
      std::printf("pace:     %.0f requests/s before the disk first filled (%" PRIu64
                  " requests in %.1f s), "
                  "%.0f requests/s after it (%.2fx)\n",
                  before, w.requests_at_fill, *w.filled_at_s, after,
                  before > 0 ? after / before : 0.0);
    } else {
      std::printf("pace:     the disk tier did not fill during the replay\n");
    }
  }
  const double p99 = Percentile(w.lag_ms, 0.99), idle99 = Percentile(idle_ms, 0.99);
  std::printf(
      "loop lag: a Stats round trip every 5 ms during the replay (%zu): p50 %.2f ms, p99 %.2f ms, "
      "max "
      "%.2f ms; idle daemon (%zu): p50 %.2f ms, p99 %.2f ms\n",
      w.lag_ms.size(), Percentile(w.lag_ms, 0.5), p99, Percentile(w.lag_ms, 1.0), idle_ms.size(),
      Percentile(idle_ms, 0.5), idle99);
  // The event loop's work per request is bounded whatever the cache holds:
  // under load its lag stays within a few milliseconds.
  lag_met = p99 <= kLagTargetMs && Percentile(w.lag_ms, 1.0) <= kLagMaxTargetMs;
  std::printf("target:   loop lag p99 <= %.0f ms and max <= %.0f ms under load: %s\n", kLagTargetMs,
              kLagMaxTargetMs, lag_met ? "met" : "NOT met");
}

struct Simulated {
  SimResult ceiling, lru, belady;
  SimResult lru_at_bytes;  // LRU holding Capacity::total_at_bytes() blocks
};

void PrintSimulations(const Simulated& sim, const Capacity& cap,
                      std::span<const TraceRequest> requests) {
  std::printf("\nsimulated, prefix hits, one request at a time:\n");
  std::printf("  %-34s %7s   %s\n", "", "blocks", "prefill tokens saved");
  std::printf("  %-34s %7.2f%%   %.2f%%\n", "unbounded (the reuse ceiling)", 100 * sim.ceiling.hit_rate(),
              100 * sim.ceiling.token_hit_rate());
  std::printf("  %-34s %7.2f%%   %.2f%%\n", ("LRU, " + std::to_string(cap.total()) + " blocks").c_str(),
              100 * sim.lru.hit_rate(), 100 * sim.lru.token_hit_rate());
  std::printf("  %-34s %7.2f%%   %.2f%%   (the tiers' bytes / the block size)\n",
              ("LRU, " + std::to_string(cap.total_at_bytes()) + " blocks").c_str(), 100 * sim.lru_at_bytes.hit_rate(),
              100 * sim.lru_at_bytes.token_hit_rate());
  // Where the bytes that hold no block go, as blocks' worth of bytes.
  std::printf("  capacity at equal bytes: %" PRIu64 " blocks; kvtier's slots and records: %" PRIu64
              " (disk record headers and padding %" PRId64 ", memory slot padding %" PRId64 ")\n",
              cap.total_at_bytes(), cap.total(),
              static_cast<int64_t>(cap.disk_bytes_blocks) - static_cast<int64_t>(cap.disk),
              static_cast<int64_t>(cap.hbm_bytes_blocks + cap.host_bytes_blocks) -
                  static_cast<int64_t>(cap.hbm + cap.host));
  std::printf("  %-34s %7.2f%%   %.2f%%   (any-position hits %.2f%%: the bound for every policy)\n",
              ("Belady, " + std::to_string(cap.total()) + " blocks").c_str(), 100 * sim.belady.hit_rate(),
              100 * sim.belady.token_hit_rate(), 100 * sim.belady.any_hit_rate());
  if (cap.tiers() < 2) return;
  for (auto [name, c] :
       {std::pair<const char*, uint64_t>{"hbm", cap.hbm}, {"host", cap.host}, {"disk", cap.disk}}) {
    if (c == 0) continue;
    std::printf("  %-34s %7.2f%% LRU, %.2f%% Belady\n",
                (std::string(name) + " alone, " + std::to_string(c) + " blocks").c_str(),
                100 * trace::SimulateLru(requests, c).hit_rate(),
                100 * trace::SimulateBelady(requests, c).hit_rate());
  }
}

// Where the tiers' bytes went at the end of the replay, in blocks' worth of
// bytes (issue 32): what LRU at equal bytes holds that kvtier's tiers did
// not. Memory tiers: blocks held, slot padding, room kept free (the
// watermarks, and what was never filled). Disk: blocks only there, record
// padding, records of blocks also in memory (held twice), records no block
// needs any more (dead, until their region's reclaim), regions' unwritten
// tails, and free regions (the reclaim's watermarks keep some).
void PrintBytes(const DaemonStats& a, const Capacity& cap, uint64_t block_bytes, uint64_t stride) {
  const auto blocks = [&](double bytes) { return bytes / static_cast<double>(block_bytes); };
  double mem_held = 0, mem_padding = 0, mem_free = 0;
  double disk_held = 0, disk_padding = 0, twice = 0, dead = 0, tails = 0, free_regions = 0;
  for (const TierStats& t : a.tiers) {
    const auto cap_bytes = static_cast<double>(t.capacity_bytes);
    const auto n = static_cast<double>(t.blocks);
    if (t.tier != BlockTier::kDisk) {
      mem_held += n;
      mem_padding += blocks(n * static_cast<double>(stride - block_bytes));
      mem_free += blocks(cap_bytes - n * static_cast<double>(stride));
      continue;
    }
    const auto record = static_cast<double>(RecordBytes(block_bytes));
    const auto filled = static_cast<double>(a.Counter("disk_filled_bytes"));
    const auto live = static_cast<double>(a.Counter("disk_record_bytes"));
    const auto free_bytes =
        static_cast<double>(a.Counter("disk_free_regions")) * static_cast<double>(a.Counter("disk_region_bytes"));
    disk_held = n;
    disk_padding = blocks(n * (record - static_cast<double>(block_bytes)));
    twice = blocks(std::max(0.0, live - n * record));
    dead = blocks(filled - live);
    tails = blocks(cap_bytes - free_bytes - filled);
    free_regions = blocks(free_bytes);
  }
  std::printf("  where the bytes went, in blocks (of %" PRIu64 " at equal bytes):\n", cap.total_at_bytes());
  std::printf("    memory: %.0f held, %.0f slot padding, %.0f free (watermarks, never filled)\n", mem_held, mem_padding,
              mem_free);
  if (cap.disk > 0) {
    std::printf("    disk:   %.0f held, %.0f record padding, %.0f held twice (also in memory), %.0f dead records, "
                "%.0f region tails, %.0f free regions\n",
                disk_held, disk_padding, twice, dead, tails, free_regions);
  }
}

// The share of the LRU-to-Belady gap a policy closed, as "+1.2%" ("-"
// when there is no gap). Hit rates in any one unit.
std::string GapClosed(double policy, double lru, double belady) {
  const double gap = belady - lru;
  if (gap <= 1e-9) return "-";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%+.1f%%", 100 * (policy - lru) / gap);
  return buf;
}

// The policy next to LRU and Belady, one tier of each capacity, hits counted
// after the tuning split (nothing is tuned here; the split keeps the
// figures comparable with a policy tuned on the first part).
void PrintPolicySweep(std::span<const TraceRequest> requests, PolicyKind policy, uint64_t daemon_capacity) {
  const uint64_t from = trace::TuningSplit(requests);
  std::printf("\npolicy sweep: %s through kvtier's index (one tier; hits of requests %" PRIu64 "-%zu, after the tuning split)\n",
              std::string(PolicyName(policy)).c_str(), from, requests.size());
  std::printf("  %8s %9s %9s %9s %10s  %-22s %s\n", "blocks", "lru", std::string(PolicyName(policy)).c_str(),
              "belady", "gap closed", "tokens saved (l/p/b)", "ns/access (lru, policy)");
  std::vector<uint64_t> capacities = {1000, 2000, 5000, 10000, 20000};
  if (daemon_capacity > 0 && std::find(capacities.begin(), capacities.end(), daemon_capacity) == capacities.end()) {
    capacities.push_back(daemon_capacity);
  }
  for (uint64_t c : capacities) {
    const trace::PolicySimResult lru =
        trace::SimulatePolicy(requests, {.capacity_blocks = c, .policy = PolicyKind::kLru, .count_from_request = from});
    const trace::PolicySimResult p =
        trace::SimulatePolicy(requests, {.capacity_blocks = c, .policy = policy, .count_from_request = from});
    const SimResult opt = trace::SimulateBelady(requests, c, from);
    const std::string closed = GapClosed(p.sim.hit_rate(), lru.sim.hit_rate(), opt.hit_rate());
    char tokens[64];
    std::snprintf(tokens, sizeof(tokens), "%.2f/%.2f/%.2f%%", 100 * lru.sim.token_hit_rate(),
                  100 * p.sim.token_hit_rate(), 100 * opt.token_hit_rate());
    std::printf("  %8" PRIu64 " %8.2f%% %8.2f%% %8.2f%% %10s  %-22s %.0f, %.0f\n", c, 100 * lru.sim.hit_rate(),
                100 * p.sim.hit_rate(), 100 * opt.hit_rate(), closed.c_str(), tokens, lru.ns_per_access,
                p.ns_per_access);
  }
  std::printf("  metadata per block: %zu bytes (eviction-order links, policy bits, hint bits and time)\n",
              EvictionOrder::kMetadataBytesPerBlock);
}

// The comparisons, with the targets (informational): all three
// tiers within 1 point of the ceiling; one tier at least LRU's hit rate.
std::vector<Comparison> Compare(double hit, const Simulated& sim, const Capacity& cap,
                                bool watermark_hint, std::string& target_line) {
  const std::string at = std::to_string(cap.total()) + " blocks";
  const double lru = 100 * sim.lru.hit_rate(), ceiling = 100 * sim.ceiling.hit_rate();
  std::vector<Comparison> cs = {
      {"hit rate vs LRU", hit, lru, "LRU, " + at + " (simulated)", "%"},
      {"hit rate vs Belady", hit, 100 * sim.belady.hit_rate(),
       "Belady's optimum, " + at + " (simulated)", "%"},
      {"hit rate vs reuse ceiling", hit, ceiling, "unbounded cache (simulated)", "%"},
      {"hit rate vs LRU at equal bytes", hit, 100 * sim.lru_at_bytes.hit_rate(),
       "LRU, " + std::to_string(cap.total_at_bytes()) + " blocks: the tiers' bytes / the block size (simulated)", "%"},
  };
  char buf[256] = {};
  if (cap.tiers() == 3) {
    cs[2].target = (ceiling - 1) / ceiling;
    std::snprintf(buf, sizeof(buf),
                  "all three tiers: hit rate within 1 point of the reuse ceiling (>= %.2f%%): %s",
                  ceiling - 1, hit >= ceiling - 1 ? "met" : "NOT met");
  } else if (cap.tiers() == 1) {
    cs[0].target = 1.0;
    // Without a disk tier, host above its high watermark drops blocks down
    // to the low one: the default 0.9/0.8 leaves 10-20% of it unused.
    std::snprintf(buf, sizeof(buf), "one tier: hit rate >= LRU's at the same capacity: %s%s",
                  hit >= lru ? "met" : "NOT met",
                  hit < lru && watermark_hint
                      ? " (the host watermarks keep the tier below capacity; try "
                        "--set 'policy.watermarks.host={high: 1.0, low: 0.99}')"
                      : "");
  }
  target_line = buf;
  return cs;
}

JsonFields JsonConfig(const TraceOptions& o, const ReplayCounts& sum, const Capacity& cap,
                      double wall_s, const DaemonStats& b, const DaemonStats& a) {
  JsonFields config = {
      {"workload", "trace"},
      {"trace", o.trace_path},
      {"requests", std::to_string(sum.requests)},
      {"block_accesses", std::to_string(sum.accesses)},
      {"block_bytes", std::to_string(o.block_bytes)},
      {"clients", std::to_string(o.clients)},
      {"speed", o.speed > 0 ? std::to_string(o.speed) : "max"},
      {"hbm_bytes", std::to_string(o.hbm_bytes)},
      {"host_bytes", std::to_string(o.host_bytes)},
      {"disk_bytes", std::to_string(o.disk_bytes)},
      {"host_quota_bytes", std::to_string(o.host_quota_bytes)},
      {"disk_quota_bytes", std::to_string(o.disk_quota_bytes)},
      {"capacity_blocks", std::to_string(cap.total())},
      {"partial_tail", o.partial_tail ? "kept" : "dropped"},
      {"wall_s", std::to_string(wall_s)},
  };
  char saved[32];
  std::snprintf(saved, sizeof(saved), "%.3f", Pct(sum.hit_tokens, sum.tokens));
  config.emplace_back("prefill_tokens_saved_pct", saved);
  const char* tiers[] = {"hbm", "host", "disk"};
  for (int t = 0; t < 3; ++t) {
    char pct[32];
    std::snprintf(pct, sizeof(pct), "%.3f", Pct(sum.tier_hits[t], sum.accesses));
    config.emplace_back(std::string("hit_rate_") + tiers[t] + "_pct", pct);
  }
  for (const char* name : {"bytes_engine_to_cache", "bytes_cache_to_engine", "bytes_hbm_to_host",
                           "bytes_host_to_hbm", "bytes_host_to_disk", "bytes_disk_to_host"}) {
    config.emplace_back(name, std::to_string(Delta(b, a, name)));
  }
  return config;
}

// One replay of `plan` on a daemon of its own with o's tiers and sets:
// what it did and what the daemon counted.
struct OwnRun {
  ReplayCounts counts;
  double wall_s = 0;
  DaemonStats before, after;
  uint64_t disk_blocks = 0;  // held on disk at the end
};

std::optional<OwnRun> RunOnOwnDaemon(TraceOptions o, ReplayPlan plan, const StartDaemonFn& start_daemon,
                                     uint64_t stride, const std::string& what) {
  Cleanup cleanup;
  o.socket.clear();
  if (!StartDaemon(o, stride, start_daemon, cleanup)) return std::nullopt;
  plan.socket = o.socket;
  auto admin = Client::Connect({.socket_path = o.socket, .client_name = "kvtier-bench-trace"});
  Result<DaemonStats> before = admin ? (*admin)->Stats() : Result<DaemonStats>(Err(admin.error()));
  Result<ReplayResult> replay = before ? Replay(plan, o.clients) : Result<ReplayResult>(Err(before.error()));
  Result<DaemonStats> after = replay ? (*admin)->Stats() : Result<DaemonStats>(Err(replay.error()));
  if (!after) {
    std::fprintf(stderr, "kvtier-bench trace: %s: %s\n", what.c_str(), after.error().ToString().c_str());
    return std::nullopt;
  }
  OwnRun run{replay->counts, replay->wall_s, std::move(*before), std::move(*after), 0};
  for (const TierStats& t : run.after.tiers) {
    if (t.tier == BlockTier::kDisk) run.disk_blocks = t.blocks;
  }
  return run;
}

// --sweep: the policy and LRU replayed through daemons of 1k-20k blocks,
// one tier (host, filled to the brim) and all three (hbm 1/8, host 3/8,
// disk 1/2 of the blocks, default watermarks), next to LRU and Belady
// simulated at the same total, all counted after the tuning split.
int SweepPolicy(const TraceOptions& o, ReplayPlan plan, const StartDaemonFn& start_daemon, uint64_t stride) {
  if (!o.socket.empty()) {
    std::fprintf(stderr, "kvtier-bench trace: --sweep starts daemons of its own (no --socket)\n");
    return 1;
  }
  const PolicyKind policy = *ParsePolicy(o.policy.empty() ? "lru" : o.policy);
  plan.count_from_request = trace::TuningSplit(plan.requests);
  std::printf("\nsweep: replays through kvtierd, hits of requests %" PRIu64 "-%zu (after the tuning split)\n",
              plan.count_from_request, plan.requests.size());
  std::printf("  %8s %5s %9s %9s %9s %9s %10s  %-15s %s\n", "blocks", "tiers", "lru", std::string(PolicyName(policy)).c_str(),
              "sim lru", "belady", "gap closed", "tokens saved", "disk MiB written (lru, policy)");
  uint64_t wrong = 0;
  for (uint64_t c : {1000u, 2000u, 5000u, 10000u, 20000u}) {
    const SimResult lru_sim = trace::SimulatePolicy(plan.requests, {.capacity_blocks = c,
                                                                    .policy = PolicyKind::kLru,
                                                                    .count_from_request = plan.count_from_request})
                                  .sim;
    const SimResult opt = trace::SimulateBelady(plan.requests, c, plan.count_from_request);
    for (const bool all : {false, true}) {
      TraceOptions r = o;
      if (all) {
        r.hbm_bytes = c / 8 * stride;
        r.host_bytes = 3 * c / 8 * stride;
        r.disk_bytes = (c / 2 * RecordBytes(o.block_bytes) + (1 << 20) - 1) >> 20 << 20;
      } else {
        r.hbm_bytes = r.disk_bytes = 0;
        r.host_bytes = c * stride;
        r.sets.push_back("policy.watermarks.host={high: 1.0, low: 0.99}");
      }
      std::optional<OwnRun> runs[2];
      for (int i = 0; i < 2; ++i) {
        TraceOptions ri = r;
        ri.sets.push_back(std::string("policy.eviction=") + (i == 0 ? "lru" : std::string(PolicyName(policy))));
        runs[i] = RunOnOwnDaemon(ri, plan, start_daemon, stride, std::to_string(c) + " blocks");
        if (!runs[i]) return 1;
        wrong += runs[i]->counts.mismatches;
      }
      const double lru = Pct(runs[0]->counts.hits, runs[0]->counts.accesses);
      const double p = Pct(runs[1]->counts.hits, runs[1]->counts.accesses);
      const std::string closed = GapClosed(p, lru, 100 * opt.hit_rate());
      char tokens[48];
      std::snprintf(tokens, sizeof(tokens), "%.2f/%.2f%%", Pct(runs[0]->counts.hit_tokens, runs[0]->counts.tokens),
                    Pct(runs[1]->counts.hit_tokens, runs[1]->counts.tokens));
      auto written = [](const OwnRun& run) {
        return static_cast<double>(Delta(run.before, run.after, "bytes_host_to_disk")) / (1 << 20);
      };
      std::printf("  %8" PRIu64 " %5s %8.2f%% %8.2f%% %8.2f%% %8.2f%% %10s  %-15s %.1f, %.1f\n", c, all ? "all" : "host",
                  lru, p, 100 * lru_sim.hit_rate(), 100 * opt.hit_rate(), closed.c_str(), tokens, written(*runs[0]),
                  written(*runs[1]));
      std::fflush(stdout);
    }
  }
  if (wrong > 0) std::printf("WRONG BYTES: %" PRIu64 " loaded blocks\n", wrong);
  return wrong == 0 ? 0 : 1;
}

// --codec: the replay with the codec and without, at equal tier bytes.
int CompareCodecs(const TraceOptions& o, const ReplayPlan& plan, const StartDaemonFn& start_daemon,
                  uint64_t stride) {
  if (!o.socket.empty() || o.disk_bytes == 0) {
    std::fprintf(stderr, "kvtier-bench trace: --codec needs a started daemon (no --socket) with a disk tier\n");
    return 1;
  }
  std::vector<OwnRun> runs;
  for (CodecKind codec : {CodecKind::kNone, o.codec}) {
    std::printf("\nreplay with codec %s:\n", std::string(CodecName(codec)).c_str());
    ReplayPlan coded = plan;
    coded.codec = codec;
    coded.kv_data = true;
    std::optional<OwnRun> run =
        RunOnOwnDaemon(o, coded, start_daemon, stride, "codec " + std::string(CodecName(codec)));
    if (!run) return 1;
    const OwnRun& r = *run;
    const uint64_t raw = r.after.Counter("codec_raw_bytes"), stored = r.after.Counter("codec_stored_bytes");
    std::printf("  hits %.2f%% of %" PRIu64 " block accesses (hbm %.2f%%, host %.2f%%, disk %.2f%%); %" PRIu64
                " blocks held on disk at the end; %.1f s\n",
                Pct(r.counts.hits, r.counts.accesses), r.counts.accesses, Pct(r.counts.tier_hits[0], r.counts.accesses),
                Pct(r.counts.tier_hits[1], r.counts.accesses), Pct(r.counts.tier_hits[2], r.counts.accesses),
                r.disk_blocks, r.wall_s);
    std::printf("  codec: %" PRId64 " blocks encoded (%.2fx), %" PRId64 " not worth it, %" PRId64
                " written raw (pool busy), %" PRId64 " decoded, %" PRId64 " failed to decode\n",
                Delta(r.before, r.after, "codec_encoded"),
                stored > 0 ? static_cast<double>(raw) / static_cast<double>(stored) : 0.0,
                Delta(r.before, r.after, "codec_not_worth_it"), Delta(r.before, r.after, "codec_pool_busy"),
                Delta(r.before, r.after, "codec_decoded"), Delta(r.before, r.after, "codec_decode_failures"));
    std::printf("  loads: %" PRIu64 " blocks, %" PRIu64 " %s\n", r.counts.loaded, r.counts.loaded - r.counts.mismatches,
                codec == CodecKind::kFp8 ? "within fp8's bound" : "byte-exact");
    runs.push_back(std::move(*run));
  }
  const OwnRun& base = runs[0];
  const OwnRun& coded = runs[1];
  const std::string name(CodecName(o.codec));
  const std::vector<Comparison> cs = {
      {"hit rate, " + name, Pct(coded.counts.hits, coded.counts.accesses), Pct(base.counts.hits, base.counts.accesses),
       "codec none, same tier bytes, same run", "%"},
      {"disk hit rate, " + name, Pct(coded.counts.tier_hits[2], coded.counts.accesses),
       Pct(base.counts.tier_hits[2], base.counts.accesses), "codec none, same tier bytes, same run", "%"},
      {"disk blocks held, " + name, static_cast<double>(coded.disk_blocks), static_cast<double>(base.disk_blocks),
       "codec none, same tier bytes, same run", "blocks"},
  };
  PrintComparisons(cs);
  if (!o.json.empty() && !WriteJson(o.json, {{"workload", "trace-codec"}, {"codec", name}, {"trace", o.trace_path}}, cs)) {
    std::fprintf(stderr, "kvtier-bench trace: cannot write %s\n", o.json.c_str());
    return 1;
  }
  const uint64_t wrong = base.counts.mismatches + coded.counts.mismatches;
  if (wrong > 0) std::printf("WRONG BYTES: %" PRIu64 " loaded blocks\n", wrong);
  return wrong == 0 ? 0 : 1;
}

}  // namespace

int Trace(TraceOptions o, const StartDaemonFn& start_daemon) {
  if (o.block_bytes < 4096 || o.block_bytes % 4096 != 0) {
    std::fprintf(stderr, "kvtier-bench trace: --block-bytes must be a multiple of 4 KiB\n");
    return 1;
  }
  auto loaded = trace::LoadTrace(o.trace_path);
  if (!loaded) {
    std::fprintf(stderr, "kvtier-bench trace: %s\n", loaded.error().ToString().c_str());
    return 1;
  }
  ReplayPlan plan{.requests = std::move(*loaded),
                  .block_bytes = o.block_bytes,
                  .socket = {},
                  .speed = o.speed,
                  .salt = static_cast<uint64_t>(Clock::now().time_since_epoch().count()) ^
                          (static_cast<uint64_t>(::getpid()) << 32)};
  if (o.requests > 0 && o.requests < plan.requests.size()) plan.requests.resize(o.requests);
  const uint64_t tails = o.partial_tail ? 0 : trace::DropPartialTails(&plan.requests);
  std::printf("config:   %s: %zu requests, %" PRIu64 " block accesses, %" PRIu64
              " distinct blocks\n",
              o.trace_path.c_str(), plan.requests.size(), trace::CountAccesses(plan.requests),
              trace::CountUniqueBlocks(plan.requests));
  std::printf("          blocks of %" PRIu64
              " KiB (one per 512-token trace block), %u clients, %s\n",
              o.block_bytes >> 10, o.clients,
              o.speed > 0 ? ("at " + std::to_string(o.speed) + "x the trace's pace").c_str()
                          : "as fast as possible");
  if (o.partial_tail) {
    std::printf("          partial tail blocks looked up and stored too (--partial-tail)\n");
  } else {
    std::printf("          full blocks only, as vLLM and SGLang: %" PRIu64
                " partial tail blocks neither looked up nor stored (--partial-tail keeps them)\n",
                tails);
  }

  // The daemon: started with these tiers, or a running one.
  const uint64_t stride = (o.block_bytes + kSlotAlignBytes - 1) / kSlotAlignBytes * kSlotAlignBytes;
  if (!o.policy.empty()) {
    if (Result<PolicyKind> k = ParsePolicy(o.policy); !k) {
      std::fprintf(stderr, "kvtier-bench trace: --policy: %s\n", k.error().message().c_str());
      return 1;
    }
  }
  if (o.sweep) return SweepPolicy(o, plan, start_daemon, stride);
  if (!o.policy.empty()) o.sets.push_back("policy.eviction=" + o.policy);
  if (o.codec != CodecKind::kNone) return CompareCodecs(o, plan, start_daemon, stride);
  Cleanup cleanup;
  const bool started = o.socket.empty();
  if (started && !StartDaemon(o, stride, start_daemon, cleanup)) return 1;
  if (!started)
    std::printf("daemon:   %s (its own tier sizes; the --*-bytes flags are ignored)\n",
                o.socket.c_str());
  plan.socket = o.socket;
  auto admin = Client::Connect({.socket_path = o.socket, .client_name = "kvtier-bench-trace"});
  auto before = admin ? (*admin)->Stats() : Result<DaemonStats>(Err(admin.error()));
  if (!before) {
    const std::string log = std::filesystem::path(o.socket).parent_path().string() + "/kvtierd.log";
    std::fprintf(stderr, "kvtier-bench trace: %s%s\n", before.error().ToString().c_str(),
                 started ? (" (see " + log + ")").c_str() : "");
    return 1;
  }
  // Capacities in blocks: memory tiers hold one 4 KiB-aligned slot per block,
  // the disk one record (the block, 4 KiB-aligned: record.h); and
  // what the same bytes would hold at the block's own size.
  Capacity cap;
  for (const TierStats& t : before->tiers) {
    const bool disk = t.tier == BlockTier::kDisk;
    uint64_t& blocks = t.tier == BlockTier::kHbm ? cap.hbm : disk ? cap.disk : cap.host;
    uint64_t& bytes = t.tier == BlockTier::kHbm ? o.hbm_bytes : disk ? o.disk_bytes : o.host_bytes;
    blocks = t.capacity_bytes / (disk ? RecordBytes(o.block_bytes) : stride);
    (t.tier == BlockTier::kHbm ? cap.hbm_bytes_blocks : disk ? cap.disk_bytes_blocks : cap.host_bytes_blocks) =
        t.capacity_bytes / o.block_bytes;
    if (!started) bytes = t.capacity_bytes;
  }
  std::printf("tiers:    hbm %s (%" PRIu64 " blocks), host %s (%" PRIu64
              " blocks), disk %s (%" PRIu64 " blocks): %" PRIu64 " blocks in all\n",
              Mib(o.hbm_bytes).c_str(), cap.hbm, Mib(o.host_bytes).c_str(), cap.host,
              Mib(o.disk_bytes).c_str(), cap.disk, cap.total());
  if (!started)
    std::printf("          (what other tenants hold there takes capacity from this replay)\n");

  const Simulated sim{trace::SimulateUnbounded(plan.requests), trace::SimulateLru(plan.requests, cap.total()),
                      trace::SimulateBelady(plan.requests, cap.total()),
                      trace::SimulateLru(plan.requests, cap.total_at_bytes())};
  // The idle loop's lag first: the baseline of the figure under load.
  std::vector<double> idle_ms;
  for (int i = 0; i < 200; ++i) {
    if (const std::optional<double> ms = StatsRoundTrip(**admin); ms) idle_ms.push_back(*ms);
  }
  Watch watch;
  watch.reclaimed_before = before->Counter("disk_regions_reclaimed");
  auto tick = [&](uint64_t requests_started, double elapsed_s) {
    if (!watch.client) {
      auto c = Client::Connect({.socket_path = o.socket, .client_name = "kvtier-bench-watch"});
      if (!c) return;
      watch.client = std::move(*c);
    }
    Result<DaemonStats> st = Err(Internal("unset"));
    const std::optional<double> ms = StatsRoundTrip(*watch.client, &st);
    if (!ms) return;
    watch.lag_ms.push_back(*ms);
    if (!watch.filled_at_s && st->Counter("disk_regions_reclaimed") > watch.reclaimed_before) {
      watch.filled_at_s = elapsed_s;
      watch.requests_at_fill = requests_started;
    }
  };
  std::optional<BackgroundFio> fio;
  if (o.contend) {
    fio.emplace(o.dir);
    if (!fio->running()) {
      std::fprintf(stderr, "kvtier-bench trace: --contend: fio did not start\n");
      return 1;
    }
    std::printf("contend:  fio writes 1 MiB O_DIRECT blocks to %s/contend.fio while the clients replay\n",
                o.dir.c_str());
  }
  auto replay = Replay(plan, o.clients, tick);
  if (fio) {
    const double mbps = fio->Stop();
    std::printf("contend:  fio wrote %.0f MB/s beside the replay\n", mbps);
  }
  if (!replay) {
    std::fprintf(stderr, "kvtier-bench trace: %s%s\n", replay.error().ToString().c_str(),
                 replay.error().code() == StatusCode::kUnavailable && started
                     ? (" (did the daemon die? KVTIER_KEEP_TEST_DIRS=1 keeps its log, " +
                        std::filesystem::path(o.socket).parent_path().string() + "/kvtierd.log)")
                           .c_str()
                     : "");
    return 1;
  }
  auto after = (*admin)->Stats();
  if (!after) {
    std::fprintf(stderr, "kvtier-bench trace: stats: %s\n", after.error().ToString().c_str());
    return 1;
  }
  const ReplayCounts& sum = replay->counts;
  PrintReplay(sum, replay->wall_s, *before, *after);
  const int64_t daemon_hits = Delta(*before, *after, "hits_hbm") +
                              Delta(*before, *after, "hits_host") +
                              Delta(*before, *after, "hits_disk");
  if (started && daemon_hits != static_cast<int64_t>(sum.hits)) {
    std::printf("          (the daemon counted %" PRId64 " hits, the clients %" PRIu64 ")\n",
                daemon_hits, sum.hits);
  }
  bool lag_met = true;
  PrintWatch(watch, idle_ms, sum, replay->wall_s, cap.disk > 0, lag_met);
  PrintSimulations(sim, cap, plan.requests);
  PrintBytes(*after, cap, o.block_bytes, stride);
  if (!o.policy.empty()) PrintPolicySweep(plan.requests, *ParsePolicy(o.policy), cap.total());
  std::string target_line;
  const double hit = Pct(sum.hits, sum.accesses);
  const std::vector<Comparison> cs = Compare(hit, sim, cap,
                                             started && cap.disk == 0 && o.sets.empty() &&
                                                 o.host_quota_bytes == 0 && o.disk_quota_bytes == 0,
                                             target_line);
  std::printf("\n%-28s %9s %9s %8s  %s\n", "comparison", "kvtier", "baseline", "ratio",
              "baseline is");
  for (const Comparison& c : cs) {
    std::printf("%-28s %8.2f%% %8.2f%% %7.3fx  %s\n", c.name.c_str(), c.kvtier, c.baseline,
                c.ratio(), c.baseline_name.c_str());
  }
  if (!target_line.empty()) std::printf("target (informational): %s\n", target_line.c_str());
  if (o.clients > 1)
    std::printf("(the replay runs %u requests at a time; the simulations one)\n", o.clients);
  if (!o.json.empty() &&
      !WriteJson(o.json, JsonConfig(o, sum, cap, replay->wall_s, *before, *after), cs)) {
    std::fprintf(stderr, "kvtier-bench trace: cannot write %s\n", o.json.c_str());
    return 1;
  }
  if (sum.mismatches > 0) std::printf("WRONG BYTES: %" PRIu64 " loaded blocks\n", sum.mismatches);
  return sum.mismatches == 0 && lag_met ? 0 : 1;
}

}  // namespace kvtier::bench
