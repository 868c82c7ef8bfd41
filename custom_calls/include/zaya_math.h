// Element math shared by the CPU and GPU kernels: bfloat16 conversion with round-to-nearest-even
// and the per-element formulas of the fused residual-scaling + RMSNorm (ZAYA1 spec §2.2).
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define ZAYA_HD __host__ __device__ inline
#else
#define ZAYA_HD inline
#endif

namespace zaya {

ZAYA_HD float bf16_to_float(uint16_t v) {
  union {
    uint32_t u;
    float f;
  } bits;
  bits.u = static_cast<uint32_t>(v) << 16;
  return bits.f;
}

ZAYA_HD uint16_t float_to_bf16(float f) {
  union {
    uint32_t u;
    float f;
  } bits;
  bits.f = f;
  uint32_t u = bits.u;
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Storage types: float (float32) and uint16_t (bfloat16 bits). ``round`` rounds a float32 value to
// the storage precision, which is what XLA does after every elementwise op in that dtype.
template <typename T>
struct Elem;

template <>
struct Elem<float> {
  ZAYA_HD static float load(const float* p, int64_t i) { return p[i]; }
  ZAYA_HD static void store(float* p, int64_t i, float v) { p[i] = v; }
  ZAYA_HD static float round(float v) { return v; }
};

template <>
struct Elem<uint16_t> {
  ZAYA_HD static float load(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }
  ZAYA_HD static void store(uint16_t* p, int64_t i, float v) { p[i] = float_to_bf16(v); }
  ZAYA_HD static float round(float v) { return bf16_to_float(float_to_bf16(v)); }
};

// Parameters of one group, stacked as (5, H) float32: the branch bias and scale, the residual bias
// and scale, and the RMSNorm weight. Branch parameters and the norm weight hold values already
// rounded to the compute dtype.
enum Param { kHiddenBias = 0, kHiddenScale = 1, kResidualBias = 2, kResidualScale = 3, kNormWeight = 4 };
constexpr int kNumParams = 5;

// The new residual h' = (h + rb) * rs + round(round(f + hb) * hs), as ResidualScaling computes it.
template <typename T>
ZAYA_HD float residual_update(float f, float h, const float* params, int64_t width, int64_t j) {
  const float branch = Elem<T>::round(Elem<T>::round(f + params[kHiddenBias * width + j]) *
                                      params[kHiddenScale * width + j]);
  const float residual = (h + params[kResidualBias * width + j]) * params[kResidualScale * width + j];
  return residual + branch;
}

}  // namespace zaya
