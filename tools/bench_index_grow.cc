// kvtier-bench-index-grow: Google Benchmark micro of the worst single Insert
// while an index grows from empty to a few million entries, for the two
// index tables (tiers/disk_only_index.h, tiers/block_index.h). A table that
// rebuilds in one pass shows it as one Insert of many milliseconds; one that
// migrates a bounded number of slots per call keeps every Insert short.
//
//   kvtier-bench-index-grow [--benchmark_filter=...] [--benchmark_repetitions=N]
//
// Counters per run: max_insert_us (the worst Insert, wall clock),
// max_insert_cpu_us (the worst in the thread's CPU time, page faults
// included: on a shared machine the wall-clock worst is often the scheduler
// taking the core away for a slice, which this leaves out),
// p99999_insert_us and mean_insert_ns; the iteration time is the whole fill.
// Built with the tests (KVTIER_BUILD_TESTS finds Google Benchmark); only
// release builds mean anything.
//
// Thread-compatible: one benchmark thread.
#include <benchmark/benchmark.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "common/block_pattern.h"
#include "common/key128.h"
#include "tiers/block_index.h"
#include "tiers/disk_only_index.h"

namespace kvtier {
namespace {

using Clock = std::chrono::steady_clock;

int64_t ThreadCpuNs() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

std::vector<StoredKey> RandomKeys(size_t n) {
  std::vector<StoredKey> keys(n);
  uint64_t state = 0x6b76746965720002;
  for (StoredKey& key : keys) {
    for (size_t i = 0; i < key.bytes.size(); i += 8) {
      const uint64_t v = SplitMix64(state);
      for (size_t b = 0; b < 8; ++b) key.bytes[i + b] = static_cast<uint8_t>(v >> (8 * b));
    }
  }
  return keys;
}

// Times every `insert(key)` of a fill from empty; sets the counters above.
template <typename MakeIndex, typename Insert>
void FillAndTimeEachInsert(benchmark::State& state, MakeIndex&& make_index, Insert&& insert) {
  const std::vector<StoredKey> keys = RandomKeys(static_cast<size_t>(state.range(0)));
  std::vector<int64_t> ns(keys.size());
  int64_t worst = 0, worst_cpu = 0, total = 0;
  std::vector<int64_t> sorted;
  for (auto _ : state) {
    auto index = make_index();
    for (size_t i = 0; i < keys.size(); ++i) {
      const int64_t cpu0 = ThreadCpuNs();
      const auto t0 = Clock::now();
      insert(*index, keys[i]);
      ns[i] = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
      worst_cpu = std::max(worst_cpu, ThreadCpuNs() - cpu0);
    }
    benchmark::DoNotOptimize(index.get());
    state.PauseTiming();
    sorted = ns;
    std::sort(sorted.begin(), sorted.end());
    worst = std::max(worst, sorted.back());
    for (int64_t v : ns) total += v;
    index.reset();  // not timed: the old table's free is not an Insert
    state.ResumeTiming();
  }
  const double inserts = static_cast<double>(keys.size()) * static_cast<double>(state.iterations());
  state.counters["max_insert_us"] = static_cast<double>(worst) / 1e3;
  state.counters["max_insert_cpu_us"] = static_cast<double>(worst_cpu) / 1e3;
  state.counters["p99999_insert_us"] =
      static_cast<double>(sorted[std::min(sorted.size() - 1, sorted.size() * 99999 / 100000)]) /
      1e3;
  state.counters["mean_insert_ns"] = static_cast<double>(total) / inserts;
}

void BM_DiskOnlyIndexGrow(benchmark::State& state) {
  FillAndTimeEachInsert(
      state, [] { return std::make_unique<DiskOnlyIndex>(); },
      [](DiskOnlyIndex& index, const StoredKey& key) {
        DiskOnlyBlock b;
        b.key = key;
        index.Insert(b);
      });
}
BENCHMARK(BM_DiskOnlyIndexGrow)->Arg(4 << 20)->Unit(benchmark::kMillisecond)->Iterations(1);

void BM_BlockIndexGrow(benchmark::State& state) {
  FillAndTimeEachInsert(
      state, [] { return std::make_unique<BlockIndex>(); },
      [](BlockIndex& index, const StoredKey& key) { index.Insert(key, Tier::kHost, nullptr); });
}
BENCHMARK(BM_BlockIndexGrow)->Arg(2 << 20)->Unit(benchmark::kMillisecond)->Iterations(1);

}  // namespace
}  // namespace kvtier

BENCHMARK_MAIN();
