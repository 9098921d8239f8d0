#include "daemon/load_rates.h"

#include <algorithm>

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
  const double spb = seconds / static_cast<double>(bytes);
  t.seconds_per_byte = t.seconds_per_byte == 0 || t.exploring ? spb : (1 - kWeight) * t.seconds_per_byte + kWeight * spb;
  t.exploring = false;
}

bool LoadRates::Slower(const Tier& tier, uint64_t block_bytes, double compute_seconds) {
  return kMargin * tier.seconds_per_byte * static_cast<double>(block_bytes) > compute_seconds;
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
  // Per tier present: the cost of loading one of its hits in this choice
  // (0 while exploring it, or while it is worth loading anyway).
  std::array<bool, kNumLoadSources> present{};
  std::array<double, kNumLoadSources> cost{};
  for (LoadSource s : tiers) present[static_cast<size_t>(s)] = true;
  for (size_t i = 0; i < kNumLoadSources; ++i) {
    if (!present[i]) continue;
    Tier& t = tiers_[i];
    if (!Slower(t, block_bytes, compute)) {
      t.cut = false;  // worth loading (again): explored soon if it turns slow
      t.explore_after = kFirstExploreAfter;
      cost[i] = t.seconds_per_byte * static_cast<double>(block_bytes);
    } else if (!Explore(t, now)) {
      cost[i] = t.seconds_per_byte * static_cast<double>(block_bytes);
    }
  }
  // The prefix of the largest saving.
  double saving = 0, best = 0;
  for (size_t i = 0; i < tiers.size(); ++i) {
    saving += compute - kMargin * cost[static_cast<size_t>(tiers[i])];
    if (saving >= best) {
      best = saving;
      choice.load = static_cast<uint32_t>(i + 1);
    }
  }
  for (size_t i = choice.load; i < tiers.size(); ++i) ++choice.recomputed[static_cast<size_t>(tiers[i])];
  for (size_t i = 0; i < kNumLoadSources; ++i) {
    if (choice.recomputed[i] != 0) tiers_[i].cut = true;
  }
  return choice;
}

bool LoadRates::WorthLoading(LoadSource source, uint64_t block_bytes, uint32_t block_tokens,
                             double prefill_tokens_per_s, Clock::time_point now) {
  const LoadSource one[] = {source};
  return Choose(one, block_bytes, block_tokens, prefill_tokens_per_s, now).load == 1;
}

double LoadRates::bytes_per_second(LoadSource source) const {
  const double spb = tiers_[static_cast<size_t>(source)].seconds_per_byte;
  return spb == 0 ? 0 : 1 / spb;
}

}  // namespace kvtier
