#include "daemon/load_rates.h"

#include <algorithm>
#include <vector>

namespace kvtier {

const char* LoadSourceName(LoadSource source) {
  switch (source) {
    case LoadSource::kHbm: return "hbm";
    case LoadSource::kHost: return "host";
    case LoadSource::kDisk: return "disk";
    case LoadSource::kRemote: return "remote";
  }
  return "?";
}

void LoadRates::Observe(LoadSource source, uint64_t bytes, double seconds) {
  if (bytes == 0 || seconds <= 0) return;
  Tier& t = tiers_[static_cast<size_t>(source)];
  const auto x = static_cast<double>(bytes);
  const double w = !t.timed || t.exploring ? 1 : kWeight;
  t.x = (1 - w) * t.x + w * x;
  t.y = (1 - w) * t.y + w * seconds;
  t.xx = (1 - w) * t.xx + w * x * x;
  t.xy = (1 - w) * t.xy + w * x * seconds;
  t.timed = true;
  t.exploring = false;
}

LoadRates::Cost LoadRates::CostOf(const Tier& t) {
  if (!t.timed) return {};
  const Cost per_byte{.latency_s = 0, .seconds_per_byte = t.y / t.x};
  const double var = t.xx - t.x * t.x;
  if (var <= kMinSizeSpread * kMinSizeSpread * t.x * t.x) return per_byte;
  const double slope = (t.xy - t.x * t.y) / var;
  const double latency = t.y - slope * t.x;
  // A line that falls with size, or starts below zero, says nothing a
  // time per byte would not: timings that noisy are taken per byte.
  if (slope <= 0 || latency < 0) return per_byte;
  return {.latency_s = latency, .seconds_per_byte = slope};
}

LoadRates::Cost LoadRates::cost(LoadSource source) const { return CostOf(tiers_[static_cast<size_t>(source)]); }

bool LoadRates::Slower(const Tier& tier, uint32_t hits, uint64_t block_bytes, double compute_seconds) {
  return kMargin * CostOf(tier).Of(hits * block_bytes) > hits * compute_seconds;
}

bool LoadRates::Explore(Tier& tier, Clock::time_point now) {
  if (!tier.cut) {  // slow for the first time: cut from now, explored later
    tier.cut_since = now;
    return false;
  }
  if (now - tier.cut_since < tier.explore_after) return false;
  tier.exploring = true;
  tier.cut_since = now;
  tier.explore_after = std::min(tier.explore_after * 2, kLongestExploreAfter);
  return true;
}

LoadRates::Choice LoadRates::Choose(std::span<const LoadSource> tiers, uint64_t block_bytes, uint32_t block_tokens,
                                    double prefill_tokens_per_s, Clock::time_point now) {
  Choice choice;
  if (prefill_tokens_per_s <= 0 || block_tokens == 0) {
    choice.load = static_cast<uint32_t>(tiers.size());
    return choice;
  }
  const double compute = block_tokens / prefill_tokens_per_s;
  // A tier slower than computing its hits here is left to compute, unless
  // it is explored (then its hits cost nothing this once, to be timed).
  std::array<uint32_t, kNumLoadSources> hits{};
  std::array<Cost, kNumLoadSources> cost{};
  for (LoadSource s : tiers) ++hits[static_cast<size_t>(s)];
  for (size_t i = 0; i < kNumLoadSources; ++i) {
    if (hits[i] == 0) continue;
    Tier& t = tiers_[i];
    if (!Slower(t, hits[i], block_bytes, compute)) {
      t.cut = false;  // worth loading (again): explored soon if it turns slow
      t.explore_after = kFirstExploreAfter;
      cost[i] = CostOf(t);
    } else if (!Explore(t, now)) {
      cost[i] = CostOf(t);
    }
  }
  // The saving of loading the first i + 1 hits: each hit's compute less
  // its time per byte, less the latency of the slowest tier among them,
  // all loads weighed by the margin.
  double per_byte = 0, latency = 0, best = 0;
  for (size_t i = 0; i < tiers.size(); ++i) {
    const Cost& c = cost[static_cast<size_t>(tiers[i])];
    per_byte += compute - kMargin * c.seconds_per_byte * static_cast<double>(block_bytes);
    latency = std::max(latency, c.latency_s);
    if (per_byte - kMargin * latency >= best) {
      best = per_byte - kMargin * latency;
      choice.load = static_cast<uint32_t>(i + 1);
    }
  }
  for (size_t i = choice.load; i < tiers.size(); ++i) ++choice.recomputed[static_cast<size_t>(tiers[i])];
  for (size_t i = 0; i < kNumLoadSources; ++i) {
    if (choice.recomputed[i] != 0) tiers_[i].cut = true;
  }
  return choice;
}

bool LoadRates::WorthLoading(LoadSource source, uint32_t hits, uint64_t block_bytes, uint32_t block_tokens,
                             double prefill_tokens_per_s, Clock::time_point now) {
  const std::vector<LoadSource> all(std::max<uint32_t>(hits, 1), source);
  return Choose(all, block_bytes, block_tokens, prefill_tokens_per_s, now).load == all.size();
}

}  // namespace kvtier
