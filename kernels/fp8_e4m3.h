// Element conversions for the block codecs (kernels/codec.h): OCP OFP8 E4M3
// (E4M3FN: bias 7, largest finite ±448, no Inf, NaN S.1111.111), IEEE fp16
// and bfloat16, each to and from fp32 with round-to-nearest-even. Written as
// plain inline functions over integers and floats so that the CUDA codec
// kernel can share them (its CPU reference is the host codec).
//
// The conversions the CUDA codec kernels share (kernels/cuda/
// codec_kernel_body.h) are host-and-device code under nvcc (KVTIER_HOST_DEVICE).
//
// Pure functions; thread-safe.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/host_device.h"


namespace kvtier::fp8 {

inline constexpr float kE4m3Max = 448.0f;

KVTIER_HOST_DEVICE uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}
KVTIER_HOST_DEVICE float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// A finite fp32 to E4M3, round to nearest even, saturating to ±448 (a value
// past 448 becomes 448, never NaN). Integer operations only (the codec runs
// it per element). REQUIRES: x is finite.
inline uint8_t FloatToE4m3(float x) {
  // Branch-free but for the clamps (the rounding decision is a coin toss on
  // real data: a branch there would be mispredicted half the time).
  const uint32_t u = FloatBits(x);
  const uint32_t sign = (u >> 24) & 0x80;
  const uint32_t a = u & 0x7fffffff;
  const int exp = static_cast<int>(a >> 23) - 127;
  const uint32_t full = (a & 0x7fffff) | (exp > -127 ? 0x800000u : 0u);  // with the implicit bit
  // Normal: 3 of 23 mantissa bits under the exponent field. Subnormal:
  // steps of 2^-9; below 2^-10 all of it rounds away (shift capped at 31).
  const bool normal = exp >= -6;
  const int sub_shift = 14 - exp > 31 ? 31 : 14 - exp;
  const int shift = normal ? 20 : sub_shift;
  const uint32_t normal_code = (static_cast<uint32_t>(exp + 7) << 3) | ((a & 0x7fffff) >> 20);
  uint32_t code = normal ? normal_code : full >> shift;
  const uint32_t rest = full & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  code += static_cast<uint32_t>(rest > half) | (static_cast<uint32_t>(rest == half) & code & 1);
  code = a >= 0x43e00000 || code > 0x7e ? 0x7e : code;  // 448 and up, and what rounds past it
  return static_cast<uint8_t>(sign | code);
}

// FloatToE4m3 for the codec's loops: the same results for every finite x
// with |x| <= 448 · (1 + 2^-20) (what a group's scaling yields), computed
// with fp32 additions and integer selects only, so that the compiler
// vectorizes a loop of it on any x86-64 (no per-lane shifts, no branches,
// no float compare or conversion, which -ftrapping-math keeps in branches).
// RNE to E4M3's step at x's exponent: (|x| + c) − c with c = 2^(e + 20), whose
// fp32 ulp is that step (2^-9, E4M3's subnormal step, below 2^-6).
KVTIER_HOST_DEVICE uint8_t FloatToE4m3Rounded(float x) {
  const uint32_t u = FloatBits(x);
  const uint32_t sign = (u >> 24) & 0x80;
  const uint32_t a = u & 0x7fffffff;
  const uint32_t exp_bits = a & 0x7f800000;
  const uint32_t c_bits = (exp_bits > 0x3c800000u ? exp_bits : 0x3c800000u) + (20u << 23);
  const float sum = BitsFloat(a) + BitsFloat(c_bits);
  uint32_t rb = FloatBits(sum - BitsFloat(c_bits));
  rb = rb < 0x43e00000u ? rb : 0x43e00000u;  // saturates at 448
  const uint32_t normal_code = (rb >> 20) - (120u << 3);
  // Below 2^-6, sum = 2^14 + k·2^-9: k (0-7) is sum's low mantissa bits.
  const uint32_t sub_code = FloatBits(sum) & 0xfu;
  return static_cast<uint8_t>(sign | (rb >= 0x3c800000u ? normal_code : sub_code));
}

// E4m3ToFloat for the codec's loops: integer selects and one fp32
// subtraction, no branches. REQUIRES: q is not a NaN code (S.1111.111).
// A subnormal code (field 0) is built as 2^-6·(1 + mant/8) − 2^-6 =
// mant·2^-9, exactly.
KVTIER_HOST_DEVICE float E4m3ToFloatFinite(uint8_t q) {
  const uint32_t field = (q >> 3) & 0xfu;
  const uint32_t mant_bits = uint32_t{q & 0x7u} << 20;
  // Masks, not ?: (which GCC keeps as branches here).
  const uint32_t sub = 0u - static_cast<uint32_t>(field == 0);  // all ones for a subnormal code
  const uint32_t base = (0x3c800000u & sub) | (((field + 120u) << 23) & ~sub) | mant_bits;
  const float magnitude = BitsFloat(base) - BitsFloat(0x3c800000u & sub);
  return BitsFloat(FloatBits(magnitude) | (uint32_t{q & 0x80u} << 24));
}

// FloatToBf16 for values known to be finite (no NaN branch).
KVTIER_HOST_DEVICE uint16_t FiniteToBf16(float f) {
  const uint32_t u = FloatBits(f);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float E4m3ToFloat(uint8_t q) {
  const int field = (q >> 3) & 0xf;
  const int mant = q & 0x7;
  float v;
  if (field == 0) {
    v = std::ldexp(static_cast<float>(mant), -9);
  } else if (field == 15 && mant == 7) {
    v = NAN;
  } else {
    v = std::ldexp(1.0f + static_cast<float>(mant) / 8.0f, field - 7);
  }
  return (q & 0x80) != 0 ? -v : v;
}

KVTIER_HOST_DEVICE float Bf16ToFloat(uint16_t h) { return BitsFloat(uint32_t{h} << 16); }

inline uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

KVTIER_HOST_DEVICE float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t e = (h >> 10) & 0x1f;
  const uint32_t m = h & 0x3ff;
  if (e == 0) {  // zero or subnormal: m * 2^-24, exact in fp32
    const float v = static_cast<float>(m) * 0x1p-24f;
    return sign != 0 ? -v : v;
  }
  if (e == 31) return BitsFloat(sign | 0x7f800000 | (m << 13));  // Inf or NaN
  return BitsFloat(sign | ((e - 15 + 127) << 23) | (m << 13));
}

KVTIER_HOST_DEVICE uint16_t FloatToFp16(float f) {
  const uint32_t x = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  const uint32_t a = x & 0x7fffffff;
  if (a >= 0x7f800000) return sign | (a > 0x7f800000 ? 0x7e00 : 0x7c00);  // NaN, Inf
  if (a >= 0x477ff000) return sign | 0x7c00;  // 65520 and up round past 65504
  if (a < 0x38800000) {                       // below 2^-14: subnormal steps of 2^-24 (exact scaling)
    // Exact scaling; rounds to nearest even (the default rounding mode).
#if defined(__CUDA_ARCH__)
    return sign | static_cast<uint16_t>(rintf(fabsf(f) * 16777216.0f));
#else
    return sign | static_cast<uint16_t>(std::nearbyint(std::fabs(f) * 16777216.0f));
#endif
  }
  uint32_t h = ((((a >> 23) - 127 + 15) << 10) | ((a & 0x7fffff) >> 13));
  const uint32_t rest = a & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1) != 0)) ++h;  // a carry moves into the exponent
  return sign | static_cast<uint16_t>(h);
}

}  // namespace kvtier::fp8
