// Block contents derived from their key, so that any process can check that
// the bytes it loaded are the bytes some other process stored for that key:
// used by tests, the quickstart demo and kvtier-bench, with the synthetic
// prompts they hash. Thread-safe (pure).
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "common/key128.h"

namespace kvtier {

inline uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// `n` token ids below 128000 (a typical vocabulary) from a seed: synthetic
// prompts for tests, the demo and benchmarks.
inline std::vector<uint32_t> PseudoTokens(uint64_t seed, size_t n) {
  std::vector<uint32_t> tokens(n);
  for (auto& t : tokens) t = static_cast<uint32_t>(SplitMix64(seed) % 128000);
  return tokens;
}

inline void FillFromKey(const BlockKey& key, std::span<uint8_t> out) {
  uint64_t state = key.Low64();
  size_t i = 0;
  for (; i + 8 <= out.size(); i += 8) {
    const uint64_t v = SplitMix64(state);
    std::memcpy(out.data() + i, &v, 8);
  }
  for (; i < out.size(); ++i) out[i] = static_cast<uint8_t>(SplitMix64(state));
}

inline bool MatchesKey(const BlockKey& key, std::span<const uint8_t> bytes) {
  uint64_t state = key.Low64();
  size_t i = 0;
  for (; i + 8 <= bytes.size(); i += 8) {
    const uint64_t v = SplitMix64(state);
    if (std::memcmp(bytes.data() + i, &v, 8) != 0) return false;
  }
  for (; i < bytes.size(); ++i) {
    if (bytes[i] != static_cast<uint8_t>(SplitMix64(state))) return false;
  }
  return true;
}

// KV-like contents derived from a key: bf16 values of about N(0, 1) (a
// sum of four uniforms), so that codecs compress them as they would real K
// and V. `out.size()` must be even.
inline void FillKvFromKey(const BlockKey& key, std::span<uint8_t> out) {
  uint64_t state = key.Low64() ^ 0x4b56u;
  for (size_t i = 0; i + 2 <= out.size(); i += 2) {
    const uint64_t r = SplitMix64(state);
    const float sum = static_cast<float>((r & 0xffff) + ((r >> 16) & 0xffff) + ((r >> 32) & 0xffff) + (r >> 48));
    const float x = (sum / 65536.0f - 2.0f) * 1.7320508f;  // mean 0, variance 1
    uint32_t bits = 0;
    std::memcpy(&bits, &x, 4);
    const auto bf16 = static_cast<uint16_t>(bits >> 16);  // truncated: any bf16 will do
    std::memcpy(out.data() + i, &bf16, 2);
  }
}

inline bool MatchesKvKey(const BlockKey& key, std::span<const uint8_t> bytes) {
  std::vector<uint8_t> want(bytes.size());
  FillKvFromKey(key, want);
  return std::memcmp(want.data(), bytes.data(), bytes.size()) == 0;
}

}  // namespace kvtier
