// Vector arithmetic shared by the CPU handlers: 16 floats as one GCC vector value, which the
// compiler lowers to the clone's widest registers (one zmm with AVX-512, two ymm with AVX2, four xmm
// otherwise); the register-tiled row product of the attention and CCA handlers (attention_cpu.cc,
// cca_cpu.cc); and the 8 x 32 GEMM tile of the grouped-matmul and Newton-Schulz handlers
// (grouped_matmul_cpu.cc, newton_schulz_cpu.cc). The hot functions are compiled for x86-64-v4 and v3 besides the baseline (target_clones,
// x86-64 with GCC only) and chosen at load time. Everything here has internal linkage: each
// handler's translation unit gets its own copy.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ZAYA_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ZAYA_CLONES
#endif
// Helpers of the cloned functions: inlined into each clone, so compiled for its instruction set.
#define ZAYA_INLINE inline __attribute__((always_inline))

namespace zaya {
namespace {

typedef float vf __attribute__((vector_size(64)));
constexpr int kLanes = 16;

ZAYA_INLINE vf load_vf(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

ZAYA_INLINE void store_vf(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

// acc[i * as + (0 .. W)] += sum_j coef[i * si + j * sj] * rows[j * rs + (0 .. W)] for i < R, j < n:
// R accumulator rows of W floats stay in registers while j is walked.
template <int W, int R>
ZAYA_INLINE void mac_rows(float* __restrict acc, int64_t as, const float* __restrict coef, int64_t si, int64_t sj,
                          const float* __restrict rows, int64_t rs, int64_t n) {
  constexpr int V = W / kLanes;
  vf a[R][V];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < V; ++t) a[r][t] = load_vf(acc + r * as + t * kLanes);
  for (int64_t j = 0; j < n; ++j) {
    vf x[V];
    for (int t = 0; t < V; ++t) x[t] = load_vf(rows + j * rs + t * kLanes);
    for (int r = 0; r < R; ++r) {
      const float c = coef[r * si + j * sj];
      for (int t = 0; t < V; ++t) a[r][t] += c * x[t];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < V; ++t) store_vf(acc + r * as + t * kLanes, a[r][t]);
}

template <int W>
ZAYA_CLONES void mac_fixed(float* acc, int64_t as, const float* coef, int64_t si, int64_t sj, const float* rows,
                           int64_t rs, int64_t m, int64_t n) {
  constexpr int R = W <= 32 ? 4 : (W == 64 ? 2 : 1);
  int64_t i = 0;
  for (; i + R <= m; i += R) mac_rows<W, R>(acc + i * as, as, coef + i * si, si, sj, rows, rs, n);
  for (; i < m; ++i) mac_rows<W, 1>(acc + i * as, as, coef + i * si, si, sj, rows, rs, n);
}

ZAYA_CLONES void mac_any(float* __restrict acc, int64_t as, const float* __restrict coef, int64_t si, int64_t sj,
                         const float* __restrict rows, int64_t rs, int64_t m, int64_t n, int64_t w) {
  for (int64_t i = 0; i < m; ++i) {
    float* __restrict a = acc + i * as;
    for (int64_t j = 0; j < n; ++j) {
      const float x = coef[i * si + j * sj];
      const float* __restrict r = rows + j * rs;
#pragma omp simd
      for (int64_t c = 0; c < w; ++c) a[c] += x * r[c];
    }
  }
}

// The m x w block at acc (row stride as) += coef (m x n, strides si, sj) . rows (n x w, row stride
// rs): register tiles for w of 16, 32, 64 and 128 floats, a vectorised loop otherwise.
void mac(float* acc, int64_t as, const float* coef, int64_t si, int64_t sj, const float* rows, int64_t rs, int64_t m,
         int64_t n, int64_t w) {
  switch (w) {
    case 16:
      return mac_fixed<16>(acc, as, coef, si, sj, rows, rs, m, n);
    case 32:
      return mac_fixed<32>(acc, as, coef, si, sj, rows, rs, m, n);
    case 64:
      return mac_fixed<64>(acc, as, coef, si, sj, rows, rs, m, n);
    case 128:
      return mac_fixed<128>(acc, as, coef, si, sj, rows, rs, m, n);
    default:
      return mac_any(acc, as, coef, si, sj, rows, rs, m, n, w);
  }
}

// The GEMM register tile: c (8 x 32, row stride ldc) = (load ? c : 0) + sum over k < kc of
// a(i, k) b[k * ldb][0..32), with a(i, k) at a[i * ai + k * ak] (A read in place through its strides,
// or a packed micro-panel) and b's rows ldb floats apart; 16 vector accumulators, the products summed
// over k in order with fused multiply-adds.
ZAYA_CLONES __attribute__((optimize("fp-contract=fast"))) void gemm_tile(const float* __restrict a, int64_t ai,
                                                                          int64_t ak, const float* __restrict b,
                                                                          int64_t ldb, int64_t kc,
                                                                          float* __restrict c, int64_t ldc,
                                                                          bool load) {
  constexpr int kRows = 8;
  vf acc[kRows][2];
  for (int i = 0; i < kRows; ++i) {
    acc[i][0] = load ? load_vf(c + i * ldc) : vf{};
    acc[i][1] = load ? load_vf(c + i * ldc + kLanes) : vf{};
  }
  for (int64_t k = 0; k < kc; ++k) {
    const vf b0 = load_vf(b + k * ldb), b1 = load_vf(b + k * ldb + kLanes);
    for (int i = 0; i < kRows; ++i) {
      const float s = a[i * ai + k * ak];
      acc[i][0] += s * b0;
      acc[i][1] += s * b1;
    }
  }
  for (int i = 0; i < kRows; ++i) {
    store_vf(c + i * ldc, acc[i][0]);
    store_vf(c + i * ldc + kLanes, acc[i][1]);
  }
}

}  // namespace
}  // namespace zaya
