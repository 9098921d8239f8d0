#include "tiers/codec_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <random>
#include <set>
#include <thread>
#include <vector>

namespace kvtier {
namespace {

using namespace std::chrono_literals;

TEST(CodecPoolTest, RefusesZeroThreadsOrQueue) {
  EXPECT_EQ(CodecPool::Create({.threads = 0, .max_queued = 4}).error().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(CodecPool::Create({.threads = 1, .max_queued = 0}).error().code(), StatusCode::kInvalidArgument);
}

TEST(CodecPoolTest, AFullQueueRefusesEncodesButAlwaysTakesDecodes) {
  auto pool = CodecPool::Create({.threads = 1, .max_queued = 3}).value();
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  std::atomic<int> ran{0};
  std::promise<void> started;
  // The one thread blocks in the first job; three more fill the queue.
  ASSERT_TRUE(pool->TryRun([&, gate](BlockCodec&) {
    started.set_value();
    gate.wait();
    ++ran;
  }));
  started.get_future().wait();
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(pool->TryRun([&](BlockCodec&) { ++ran; }));
  EXPECT_FALSE(pool->TryRun([&](BlockCodec&) { ADD_FAILURE() << "a refused job ran"; }));
  EXPECT_EQ(pool->counters().refused, 1u);
  EXPECT_EQ(pool->counters().queued, 3u);
  pool->Run([&](BlockCodec&) { ++ran; });  // past the bound
  EXPECT_EQ(pool->counters().queued, 4u);
  release.set_value();
  pool.reset();  // runs what is queued, then joins
  EXPECT_EQ(ran.load(), 5);
}

TEST(CodecPoolTest, EachThreadCodesWithItsOwnCodecAndEveryBlockRoundTrips) {
  auto pool = CodecPool::Create({.threads = 3, .max_queued = 1000}).value();
  EXPECT_EQ(pool->threads(), 3u);
  constexpr int kBlocks = 60;
  std::vector<std::vector<uint8_t>> raw(kBlocks, std::vector<uint8_t>(64 * 1024));
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal;
  for (auto& block : raw) {
    for (size_t i = 0; i < block.size(); i += 2) {
      float f = normal(rng);
      uint32_t bits = 0;
      std::memcpy(&bits, &f, 4);
      block[i] = static_cast<uint8_t>(bits >> 16);  // bf16: the top half
      block[i + 1] = static_cast<uint8_t>(bits >> 24);
    }
  }
  const CodecParams p{CodecKind::kLossless, DType::kBf16, 0};
  std::vector<std::vector<uint8_t>> back(kBlocks);
  std::atomic<int> exact{0};
  std::mutex threads_mu;
  std::set<std::thread::id> threads;
  for (int i = 0; i < kBlocks; ++i) {
    ASSERT_TRUE(pool->TryRun([&, i](BlockCodec& codec) {
      std::vector<uint8_t> stored(BlockCodec::MaxEncodedBytes(p, raw[i].size()));
      const std::optional<size_t> n = codec.Encode(p, raw[i], stored);
      ASSERT_TRUE(n.has_value());
      std::vector<uint8_t> out(raw[i].size());
      ASSERT_TRUE(codec.Decode(p, std::span(stored.data(), *n), out).ok());
      if (out == raw[i]) ++exact;
      std::lock_guard lock(threads_mu);
      threads.insert(std::this_thread::get_id());
    }));
  }
  pool.reset();
  EXPECT_EQ(exact.load(), kBlocks);
  EXPECT_GE(threads.size(), 1u);
}

}  // namespace
}  // namespace kvtier
