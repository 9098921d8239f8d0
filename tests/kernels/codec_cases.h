// What the fp8 codec kernels' tests share (the CPU emulation and the GPU
// run): an engine cache of finite 2-byte values as K and V look, whatever
// the layout's alignment. Test-only; thread-compatible.
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "common/kv_cache_layout.h"
#include "kernels/copy_plan.h"
#include "kernels/copy_reference.h"
#include "kernels/fp8_e4m3.h"
#include "tests/kernels/layout_cases.h"

namespace kvtier::codec_cases {

inline bool TwoByteFloats(DType d) { return d == DType::kBf16 || d == DType::kFp16; }

// The named layouts whose elements fp8 encodes (fp16, bf16).
inline std::vector<layout_cases::NamedCase> Fp8Cases() {
  std::vector<layout_cases::NamedCase> out;
  for (const layout_cases::NamedCase& c : layout_cases::NamedCases()) {
    if (TwoByteFloats(c.make().spec.dtype)) out.push_back(c);
  }
  return out;
}

// Fills `cache` with N(0, 1) values of `kv`'s dtype, some large (outlier
// channels), some zero; then makes every element of every block finite
// (elements need not sit at even offsets of a region, so the fill's words
// may straddle them).
inline void FillFinite(layout_cases::Cache& cache, const KvCacheLayout& kv, uint64_t seed) {
  const DType dtype = kv.layout().spec().dtype;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  for (std::vector<uint8_t>& region : cache.regions) {
    for (size_t i = 0; i + 1 < region.size(); i += 2) {
      const uint64_t r = rng();
      const float x = r % 97 == 0 ? 0.0f : normal(rng) * (r % 61 == 0 ? 300.0f : 1.0f);
      const uint16_t h = dtype == DType::kBf16 ? fp8::FloatToBf16(x) : fp8::FloatToFp16(x);
      std::memcpy(&region[i], &h, 2);
    }
  }
  const CopyPlan plan = CopyPlan::Build(kv, cache.Mapped());
  const uint64_t block_bytes = kv.layout().block_bytes();
  std::vector<uint8_t> raw(block_bytes);
  const uint16_t exponent = dtype == DType::kBf16 ? 0x7f80 : 0x7c00;
  for (uint32_t b = 0; b < kv.num_blocks(); ++b) {
    GatherBlock(plan, b, raw.data());
    for (size_t i = 0; i + 1 < block_bytes; i += 2) {
      const auto h = static_cast<uint16_t>(raw[i] | (raw[i + 1] << 8));
      if ((h & exponent) == exponent) raw[i + 1] &= 0x80;
    }
    ScatterBlock(plan, b, raw.data());
  }
}

// Shifts every bf16 value's magnitude bits down by 8, making subnormals (and
// zeros): groups whose 448/amax is past the largest float (issue 31, item 7).
inline void MakeTiny(layout_cases::Cache& cache) {
  for (std::vector<uint8_t>& r : cache.regions) {
    for (size_t i = 0; i + 1 < r.size(); i += 2) {
      uint16_t v;
      std::memcpy(&v, r.data() + i, 2);
      v = static_cast<uint16_t>((v & 0x8000) | ((v & 0x7fff) >> 8));
      std::memcpy(r.data() + i, &v, 2);
    }
  }
}

}  // namespace kvtier::codec_cases
