// LoadRates (daemon/load_rates.h): which hits are worth loading for an
// engine of a given prefill rate, from the tiers' timed loads; a tier left
// to compute is explored again after a while, doubling while it stays slow,
// and taken again at once once a timing finds it fast.
#include "daemon/load_rates.h"

#include <gtest/gtest.h>

#include <vector>

namespace kvtier {
namespace {

using std::chrono::milliseconds;
using Clock = LoadRates::Clock;

constexpr uint64_t kBlockBytes = 1 << 20;
constexpr uint32_t kBlockTokens = 16;
// 16 tokens in 1 ms: a block computes in 1 ms.
constexpr double kPrefill = 16000;

// `source` timed at `ms_per_block` a block.
void Time(LoadRates& rates, LoadSource source, double ms_per_block) {
  rates.Observe(source, 4 * kBlockBytes, 4 * ms_per_block / 1000);
}

std::vector<LoadSource> Hits(std::initializer_list<std::pair<LoadSource, int>> runs) {
  std::vector<LoadSource> out;
  for (const auto& [source, n] : runs) out.insert(out.end(), static_cast<size_t>(n), source);
  return out;
}

TEST(LoadRatesTest, EveryHitWithoutAPrefillRateOrATiming) {
  LoadRates rates;
  const Clock::time_point now = Clock::now();
  const std::vector<LoadSource> hits = Hits({{LoadSource::kHost, 3}, {LoadSource::kDisk, 5}});
  EXPECT_EQ(rates.Choose(hits, kBlockBytes, kBlockTokens, 0, now).load, 8u);
  EXPECT_EQ(rates.Choose(hits, kBlockBytes, kBlockTokens, kPrefill, now).load, 8u) << "no tier timed yet";
  Time(rates, LoadSource::kHost, 0.1);
  EXPECT_EQ(rates.Choose(hits, kBlockBytes, kBlockTokens, kPrefill, now).load, 8u) << "the disk is not timed yet";
  EXPECT_NEAR(rates.cost(LoadSource::kHost).seconds_per_byte * kBlockBytes, 0.1e-3, 1e-12);
  EXPECT_EQ(rates.cost(LoadSource::kHost).latency_s, 0) << "timings of one size count per byte";
  EXPECT_EQ(rates.cost(LoadSource::kDisk).seconds_per_byte, 0);
}

TEST(LoadRatesTest, HitsOfATierSlowerThanComputeAreLeftAndCountedByTier) {
  LoadRates rates;
  const Clock::time_point now = Clock::now();
  Time(rates, LoadSource::kHost, 0.1);
  Time(rates, LoadSource::kDisk, 3);  // 3 ms a block against 1 ms to compute it
  const LoadRates::Choice c =
      rates.Choose(Hits({{LoadSource::kHost, 4}, {LoadSource::kDisk, 6}}), kBlockBytes, kBlockTokens, kPrefill, now);
  EXPECT_EQ(c.load, 4u);
  EXPECT_EQ(c.recomputed[static_cast<size_t>(LoadSource::kDisk)], 6u);
  EXPECT_EQ(c.recomputed[static_cast<size_t>(LoadSource::kHost)], 0u);
  // A slower engine (a block in 4 ms) is better off loading the disk too.
  EXPECT_EQ(rates.Choose(Hits({{LoadSource::kHost, 4}, {LoadSource::kDisk, 6}}), kBlockBytes, kBlockTokens,
                         kPrefill / 4, now)
                .load,
            10u);
}

TEST(LoadRatesTest, TheMarginKeepsHitsThatAreBarelyFasterToLoad) {
  LoadRates rates;
  const Clock::time_point now = Clock::now();
  // 0.9 ms against 1 ms: faster, but not by LoadRates::kMargin.
  Time(rates, LoadSource::kDisk, 0.9);
  EXPECT_EQ(rates.Choose(Hits({{LoadSource::kDisk, 5}}), kBlockBytes, kBlockTokens, kPrefill, now).load, 0u);
  LoadRates fast;
  Time(fast, LoadSource::kDisk, 0.7);
  EXPECT_EQ(fast.Choose(Hits({{LoadSource::kDisk, 5}}), kBlockBytes, kBlockTokens, kPrefill, now).load, 5u);
}

TEST(LoadRatesTest, TheLoadedPrefixIsTheOneThatSavesMost) {
  LoadRates rates;
  const Clock::time_point now = Clock::now();
  Time(rates, LoadSource::kHost, 0);  // no time: each host hit saves 1 ms
  Time(rates, LoadSource::kDisk, 2);  // each disk hit costs 2.5 - 1 = 1.5 ms more than it saves
  // One slow hit between many cheap ones is worth loading with them...
  EXPECT_EQ(rates.Choose(Hits({{LoadSource::kHost, 2}, {LoadSource::kDisk, 1}, {LoadSource::kHost, 6}}),
                         kBlockBytes, kBlockTokens, kPrefill, now)
                .load,
            9u);
  // ... but not where the cheap ones after it save less than it costs.
  EXPECT_EQ(rates.Choose(Hits({{LoadSource::kHost, 2}, {LoadSource::kDisk, 2}, {LoadSource::kHost, 1}}),
                         kBlockBytes, kBlockTokens, kPrefill, now)
                .load,
            2u);
}

TEST(LoadRatesTest, ASlowTierIsExploredAgainDoublingWhileSlowAndTakenAgainOnceFast) {
  LoadRates rates;
  Clock::time_point now = Clock::now();
  const std::vector<LoadSource> remote = Hits({{LoadSource::kRemote, 4}});
  Time(rates, LoadSource::kRemote, 10);
  EXPECT_EQ(rates.Choose(remote, kBlockBytes, kBlockTokens, kPrefill, now).load, 0u);
  now += LoadRates::kFirstExploreAfter - milliseconds(1);
  EXPECT_EQ(rates.Choose(remote, kBlockBytes, kBlockTokens, kPrefill, now).load, 0u) << "too soon";
  now += milliseconds(1);
  EXPECT_EQ(rates.Choose(remote, kBlockBytes, kBlockTokens, kPrefill, now).load, 4u) << "explored";
  // Explored and still slow (the exploring timing replaces the rate, 30 ms
  // weighed in as a whole): cut again, explored after twice as long.
  Time(rates, LoadSource::kRemote, 30);
  EXPECT_NEAR(rates.cost(LoadSource::kRemote).seconds_per_byte * kBlockBytes, 30e-3, 1e-12);
  EXPECT_EQ(rates.Choose(remote, kBlockBytes, kBlockTokens, kPrefill, now).load, 0u);
  now += 2 * LoadRates::kFirstExploreAfter - milliseconds(1);
  EXPECT_EQ(rates.Choose(remote, kBlockBytes, kBlockTokens, kPrefill, now).load, 0u) << "too soon";
  now += milliseconds(1);
  EXPECT_EQ(rates.Choose(remote, kBlockBytes, kBlockTokens, kPrefill, now).load, 4u) << "explored";
  // Fast now: one timing is enough, and every later lookup takes it.
  Time(rates, LoadSource::kRemote, 0.1);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(rates.Choose(remote, kBlockBytes, kBlockTokens, kPrefill, now).load, 4u);
  // A timing while in use is weighed in: one slow load among fast ones
  // moves the rate by kWeight of the difference.
  Time(rates, LoadSource::kRemote, 1.1);
  EXPECT_NEAR(rates.cost(LoadSource::kRemote).seconds_per_byte * kBlockBytes * 1000, 0.1 * 0.7 + 1.1 * 0.3, 1e-6);
}

// A load's latency (its round trip, a copy thread waking, a queue) is paid
// once a load, not once a block: small loads that took long are no reason to
// leave a large hit from the same tier to compute (a serving run's first
// host loads, 3 and 6 blocks of 128 KiB in 10 ms each, cut the host tier
// for the 2k-token probe that would have loaded in a fraction of its
// compute).
TEST(LoadRatesTest, ALoadsLatencyIsPaidOnceALoadNotOnceABlock) {
  LoadRates rates;
  const Clock::time_point now = Clock::now();
  // 4.9 ms a load, 0.1 ms a block: 1 block in 5 ms, 8 in 5.7 ms.
  rates.Observe(LoadSource::kHost, kBlockBytes, 5.0e-3);
  rates.Observe(LoadSource::kHost, 8 * kBlockBytes, 5.7e-3);
  const LoadRates::Cost cost = rates.cost(LoadSource::kHost);
  EXPECT_NEAR(cost.latency_s, 4.9e-3, 1e-9);
  EXPECT_NEAR(cost.seconds_per_byte * kBlockBytes, 0.1e-3, 1e-9);
  // 2 hits: 1.25 x 5.1 ms to load against 2 ms to compute.
  const LoadRates::Choice two = rates.Choose(Hits({{LoadSource::kHost, 2}}), kBlockBytes, kBlockTokens, kPrefill, now);
  EXPECT_EQ(two.load, 0u);
  EXPECT_EQ(two.recomputed[static_cast<size_t>(LoadSource::kHost)], 2u);
  // 64 hits: 1.25 x 11.3 ms against 64 ms. Counted per byte (the two
  // timings' seconds over their bytes, 1.7 ms a block), all would be left.
  EXPECT_EQ(rates.Choose(Hits({{LoadSource::kHost, 64}}), kBlockBytes, kBlockTokens, kPrefill, now).load, 64u);
  // The latency of the slowest tier in the prefix is the one paid: 6 host
  // hits then disk hits, from a disk of 20 ms a load, are worth loading
  // only once their compute makes up for 1.25 x 20 ms, and then the whole
  // prefix is.
  rates.Observe(LoadSource::kDisk, kBlockBytes, 20.1e-3);
  rates.Observe(LoadSource::kDisk, 8 * kBlockBytes, 20.8e-3);
  EXPECT_EQ(rates.Choose(Hits({{LoadSource::kHost, 6}, {LoadSource::kDisk, 2}}), kBlockBytes, kBlockTokens,
                         kPrefill, now)
                .load,
            0u);
  EXPECT_EQ(rates.Choose(Hits({{LoadSource::kHost, 6}, {LoadSource::kDisk, 26}}), kBlockBytes, kBlockTokens,
                         kPrefill, now)
                .load,
            32u);
  // Asked whether the remote tier is worth a lookup's tail, its latency
  // counts once over the whole tail.
  rates.Observe(LoadSource::kRemote, kBlockBytes, 3.1e-3);
  rates.Observe(LoadSource::kRemote, 8 * kBlockBytes, 3.8e-3);
  EXPECT_FALSE(rates.WorthLoading(LoadSource::kRemote, 1, kBlockBytes, kBlockTokens, kPrefill, now));
  EXPECT_TRUE(rates.WorthLoading(LoadSource::kRemote, 16, kBlockBytes, kBlockTokens, kPrefill, now));
}

// Timings whose line makes no sense (a larger load faster in all: noise)
// count per byte, as do timings of loads of about one size.
TEST(LoadRatesTest, TimingsWithoutALineCountPerByte) {
  LoadRates rates;
  rates.Observe(LoadSource::kDisk, kBlockBytes, 8e-3);
  rates.Observe(LoadSource::kDisk, 8 * kBlockBytes, 2e-3);
  const LoadRates::Cost falling = rates.cost(LoadSource::kDisk);
  EXPECT_EQ(falling.latency_s, 0);
  // 0.7 x 8 + 0.3 x 2 ms over 0.7 x 1 + 0.3 x 8 blocks.
  EXPECT_NEAR(falling.seconds_per_byte * kBlockBytes, 6.2e-3 / 3.1, 1e-12);
  LoadRates same;
  same.Observe(LoadSource::kHost, 100 * kBlockBytes, 10e-3);
  same.Observe(LoadSource::kHost, 105 * kBlockBytes, 12e-3);  // 5% apart: under kMinSizeSpread
  EXPECT_EQ(same.cost(LoadSource::kHost).latency_s, 0);
}

TEST(LoadRatesTest, TheLongestWaitBeforeExploringIsBounded) {
  LoadRates rates;
  Clock::time_point now = Clock::now();
  const std::vector<LoadSource> disk = Hits({{LoadSource::kDisk, 1}});
  Time(rates, LoadSource::kDisk, 10);
  EXPECT_EQ(rates.Choose(disk, kBlockBytes, kBlockTokens, kPrefill, now).load, 0u);
  int explored = 0;
  for (int second = 0; second < 600; ++second) {
    now += std::chrono::seconds(1);
    if (rates.Choose(disk, kBlockBytes, kBlockTokens, kPrefill, now).load == 1) {
      ++explored;
      Time(rates, LoadSource::kDisk, 10);  // still slow
    }
  }
  // 1, 2, 4, 8, 16, 32, then every 60 s: 6 + about 9 in ten minutes.
  EXPECT_GE(explored, 13);
  EXPECT_LE(explored, 16);
}

}  // namespace
}  // namespace kvtier
