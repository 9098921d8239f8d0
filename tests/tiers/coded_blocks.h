// What the tests of coded blocks in BlockCache share (coded_host_test,
// disk/compressed_disk_test): bf16 K and V layouts, the codecs as those
// tests register them (fp8 in groups of a head, 64), blocks of values as K
// and V look, and random keys. Test-only; thread-compatible.
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <string>

#include "common/key128.h"
#include "common/layout.h"
#include "kernels/fp8_e4m3.h"

namespace kvtier::tiers_test {

// bf16 K and V of `num_layers` layers, 16 tokens, 2 heads of 64: 8 KiB a layer.
inline LayoutSpec Bf16KvSpec(std::string model_id, uint32_t num_layers) {
  return LayoutSpec{.model_id = std::move(model_id),
                    .num_layers = num_layers,
                    .kv_kind = KvKind::kSeparateKv,
                    .num_kv_heads = 2,
                    .head_dim = 64,
                    .dtype = DType::kBf16,
                    .block_tokens = 16};
}

inline CodecParams Bf16Codec(CodecKind kind) {
  return {.kind = kind, .dtype = DType::kBf16, .group_elems = kind == CodecKind::kFp8 ? 64u : 0u};
}

// bf16 values of N(0, 1), one in 64 of them 20 times larger, as K and V look.
inline void FillKvLike(std::mt19937_64& rng, std::span<uint8_t> bytes) {
  std::normal_distribution<float> normal;
  for (size_t i = 0; i + 1 < bytes.size(); i += 2) {
    const float x = normal(rng) * (rng() % 64 == 0 ? 20.0f : 1.0f);
    const uint16_t b = fp8::FloatToBf16(x);
    std::memcpy(&bytes[i], &b, 2);
  }
}

inline StoredKey RandomKey(std::mt19937_64& rng) {
  StoredKey k;
  for (auto& b : k.bytes) b = static_cast<uint8_t>(rng());
  return k;
}

}  // namespace kvtier::tiers_test
