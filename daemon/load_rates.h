// Load or recompute (docs/policy.md, "Load or recompute"): how fast one
// cache's loads have been from each tier, as kvtierd timed them, and how many
// of a lookup's hits are worth loading for an engine that computes prefill
// at a given rate.
//
// A hit is worth loading while loading it is expected to take less than
// computing its tokens again, by a margin (kMargin). A load from a tier is
// expected to take that tier's latency (paid once a load) plus its time per
// byte for each block: a small load's timing is mostly latency (a round
// trip, a copy thread's wake-up, a queue), and taken for a time per byte it
// would make a large hit look as slow a block as a small one. Both come
// from the tier's timed loads: a least-squares line through them (seconds
// against bytes, each timing weighing kWeight), once their sizes differ;
// until then every second of a timing counts per byte. Each hit costs
// block_tokens / prefill_rate to compute. The prefix loaded is the one with
// the largest saving (a hit deep in the chain may be worth it only with the
// cheap ones before it), the latency of its slowest tier paid once.
//
// A tier taken less gives no new timings, so that a tier that recovers would
// never be taken again: a tier whose hits were cut is explored after a
// while (kFirstExploreAfter, doubling while it stays slow, up to
// kLongestExploreAfter): one lookup's hits from it are reported whole, and
// the next load from it replaces its rate instead of averaging with it.
//
// Rates are kept per tenant and layout (a cache's loads and the lookups
// about them come from different sessions: vLLM's worker and scheduler).
// Loop thread only.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <span>

namespace kvtier {

// Where a load's blocks came from: its slowest tier.
enum class LoadSource : uint8_t { kHbm = 0, kHost = 1, kDisk = 2, kRemote = 3 };
inline constexpr size_t kNumLoadSources = 4;
const char* LoadSourceName(LoadSource source);

class LoadRates {
 public:
  using Clock = std::chrono::steady_clock;

  // Loading a hit must be expected to take less than 1 / kMargin of
  // computing it: timings of loads from one tier vary by about that much
  // from one load to the next on a shared machine (docs/policy.md).
  static constexpr double kMargin = 1.25;
  // Each new timing's weight in a tier's line.
  static constexpr double kWeight = 0.3;
  // Timings' sizes must spread by this much (their standard deviation over
  // their mean) before a line through them splits latency from time per byte.
  static constexpr double kMinSizeSpread = 0.1;
  static constexpr std::chrono::milliseconds kFirstExploreAfter{1000};
  static constexpr std::chrono::milliseconds kLongestExploreAfter{60'000};

  // A load of `bytes` from `source` took `seconds` (from its request to its
  // copies' end). Loads of no byte are not timings.
  void Observe(LoadSource source, uint64_t bytes, double seconds);

  struct Choice {
    uint32_t load = 0;  // leading hits worth loading
    // Hits past `load` left to compute, by their tier.
    std::array<uint32_t, kNumLoadSources> recomputed = {};
  };
  // Of hits from `tiers` (in chain order), how many to load for an engine
  // that computes `prefill_tokens_per_s` tokens a second (0: unknown, all
  // of them), each hit `block_tokens` tokens of `block_bytes`.
  Choice Choose(std::span<const LoadSource> tiers, uint64_t block_bytes, uint32_t block_tokens,
                double prefill_tokens_per_s, Clock::time_point now);

  // Whether `hits` hits from `source` are worth loading now, as Choose sees
  // them (a remote tier not worth asking is not asked).
  bool WorthLoading(LoadSource source, uint32_t hits, uint64_t block_bytes, uint32_t block_tokens,
                    double prefill_tokens_per_s, Clock::time_point now);

  // A tier's expected load time: latency_s + bytes * seconds_per_byte.
  struct Cost {
    double latency_s = 0;
    double seconds_per_byte = 0;  // 0 with latency 0: no timing yet
    double Of(uint64_t bytes) const { return latency_s + seconds_per_byte * static_cast<double>(bytes); }
  };
  Cost cost(LoadSource source) const;

 private:
  struct Tier {
    // Moving averages of the timings' bytes x, seconds y, x * x and x * y.
    double x = 0, y = 0, xx = 0, xy = 0;
    bool timed = false;
    bool exploring = false;  // the next timing replaces the others
    bool cut = false;        // the last choice left its hits to compute
    Clock::time_point cut_since{};
    std::chrono::milliseconds explore_after = kFirstExploreAfter;
  };
  static Cost CostOf(const Tier& tier);
  // Whether `hits` hits from `tier` cost more to load than to compute.
  static bool Slower(const Tier& tier, uint32_t hits, uint64_t block_bytes, double compute_seconds);
  // A tier about to be cut: true (and exploring) when its hits are to be
  // loaded once anyway, to time it again.
  static bool Explore(Tier& tier, Clock::time_point now);

  std::array<Tier, kNumLoadSources> tiers_{};
};

}  // namespace kvtier
