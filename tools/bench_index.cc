#include "tools/bench_index.h"

#include <algorithm>
#include <cstdio>
#include <unordered_map>
#include <vector>

#include "common/block_pattern.h"
#include "common/key128.h"
#include "tiers/block_index.h"
#include "tools/bench_report.h"

namespace kvtier::bench {
namespace {

StoredKey RandomKey(uint64_t& state) {
  StoredKey key;
  for (size_t i = 0; i < key.bytes.size(); i += 8) {
    const uint64_t v = SplitMix64(state);
    for (size_t b = 0; b < 8; ++b) key.bytes[i + b] = static_cast<uint8_t>(v >> (8 * b));
  }
  return key;
}

// Walks the probes a prompt at a time, each prompt's keys in order until the
// first miss (as a prefix lookup does). Returns finds per second; `found`
// gets how many keys were found.
template <typename Find, typename Prepare = void (*)(std::span<const StoredKey>)>
double FindsPerSecond(const std::vector<StoredKey>& probes, uint32_t prompt_keys, Find&& find,
                      uint64_t& found, Prepare prepare = [](std::span<const StoredKey>) {}) {
  uint64_t hits = 0;
  const auto t0 = Clock::now();
  for (size_t p = 0; p < probes.size(); p += prompt_keys) {
    const size_t end = std::min(probes.size(), p + prompt_keys);
    prepare(std::span<const StoredKey>(probes.data() + p, end - p));
    for (size_t i = p; i < end && find(probes[i]); ++i) ++hits;
  }
  const double s = Seconds(Clock::now() - t0);
  found = hits;
  return s > 0 ? static_cast<double>(hits) / s : 0;
}

}  // namespace

IndexFindRates MeasureIndexFind(const IndexFindOptions& options) {
  std::vector<StoredKey> keys;
  keys.reserve(options.index_keys);
  uint64_t state = 0x6b76746965720001;
  for (uint64_t i = 0; i < options.index_keys; ++i) keys.push_back(RandomKey(state));

  BlockIndex index;
  std::unordered_map<StoredKey, uint64_t, Key128Hash> map;
  for (uint64_t i = 0; i < keys.size(); ++i) {
    index.Insert(keys[i], Tier::kHost, nullptr);
    map.emplace(keys[i], i);
  }
  // Prompts of keys drawn at random from the index: each find a likely
  // cache miss once the index outgrows the CPU caches, as in a daemon that
  // serves many prompts.
  std::vector<StoredKey> probes;
  probes.reserve(options.finds_per_round);
  for (uint64_t i = 0; i < options.finds_per_round; ++i)
    probes.push_back(keys[SplitMix64(state) % keys.size()]);

  std::vector<double> index_rates, map_rates;
  for (uint32_t round = 0; round < options.rounds; ++round) {
    uint64_t index_found = 0, map_found = 0;
    // As BlockCache::Lookup does: prefetch a prompt's table lines, then find.
    index_rates.push_back(FindsPerSecond(
        probes, options.prompt_keys, [&](const StoredKey& k) { return index.Find(k) != nullptr; },
        index_found, [&](std::span<const StoredKey> prompt) { index.Prefetch(prompt); }));
    map_rates.push_back(FindsPerSecond(
        probes, options.prompt_keys, [&](const StoredKey& k) { return map.find(k) != map.end(); },
        map_found));
    if (index_found != probes.size() || map_found != probes.size()) {
      std::fprintf(stderr, "kvtier-bench: index found %lu, map %lu of %zu probes\n", index_found,
                   map_found, probes.size());
      return {};
    }
    std::printf("  index round %u/%u: BlockIndex::Find %.1f M/s, unordered_map::find %.1f M/s\n",
                round + 1, options.rounds, index_rates.back() / 1e6, map_rates.back() / 1e6);
    std::fflush(stdout);
  }
  return {.index_finds_per_s = Median(index_rates),
          .map_finds_per_s = Median(map_rates),
          .entry_bytes = sizeof(BlockEntry)};
}

}  // namespace kvtier::bench
