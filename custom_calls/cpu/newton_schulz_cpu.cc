// Muon's Newton-Schulz orthogonalisation on CPU, one matrix per work item, every iteration of it on
// data that stays in the worker's cache:
//
//   zaya_newton_schulz_cpu  x (..., m, n) float32, m <= n, already normalised -> the iterate after
//                           `steps` quintic steps X <- aX + (bG + cG^2)X, G = XX^T, in the standard
//                           formulation or the Gram one (`gram`: the iteration on m x m matrices,
//                           G recomputed from X every `restart` steps; zaya_jax/ops/newton_schulz.py)
//   zaya_newton_schulz      the platform-shared target (GPU kernels in gpu/kernels.cu): the standard
//                           formulation, the same code
//
// Why a kernel: XLA runs each step as five to eight operations over the whole stack (two or three
// batched products, scalings, sums, a loop), every one a trip through memory and the thread pool;
// tiny's Muon leaves ran at 116 GFLOP/s where the batched products alone ran at 140-150
// (bench/RESULTS.md, issue 41). Here a worker takes one matrix through all of its steps.
//
// The m x m products are symmetric in exact arithmetic: G and G^2, and in the Gram form every matrix
// of a segment is a polynomial in its first G, so they all commute. Only the 32 x 32 blocks on and
// above the diagonal are computed and the upper triangle is copied below it (10 of 16 blocks at
// m = 128), so these matrices are exactly symmetric (the JAX reference symmetrises G by averaging).
// Not the product that carries the segments' Q across a restart: its float32 asymmetry is what the
// restart's fresh G corrects, and copied it left low-rank input ~1e-3 off the float64 iteration.
//
// The GEMM is the grouped matmul's register tile (zaya::gemm_tile, 8 x 32, k blocks of 256):
// A read in place (a last partial 8-row block packed), B read in place where its 32-column panel is
// contiguous, packed otherwise (B = X^T of a Gram matrix, partial panels). aX + PX adds aX to the
// finished PX: accumulators started from aX left the result 2.5x further from the float64 iteration.
//
// Determinism: a matrix is one item and its products run in a fixed order, so its bits do not depend
// on the batch size, the threads or their timing (a device's share of a stack under shard_map gives
// the bits the whole stack gives on one device).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "zaya_parallel.h"
#include "zaya_simd.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMr = 8;    // rows of the register tile
constexpr int64_t kNr = 32;   // its columns (two vectors of 16); also the symmetric block size
constexpr int64_t kTile = 32; // rows per block of C (kTile / kMr register tiles)
constexpr int64_t kKc = 256;  // contraction block

// A strided matrix: element (i, j) at p[i * rs + j * cs].
struct Mat {
  const float* p;
  int64_t rs, cs;
  float at(int64_t i, int64_t j) const { return p[i * rs + j * cs]; }
};

// A worker's scratch, sized for the largest matrix it meets.
struct Work {
  std::vector<float> x, g, p, t, q, total;  // an m x n iterate, m x m matrices
  std::vector<float> bpack;                 // B's packed panels (panels x k x 32 floats)
  float apack[kMr * kKc];                   // a partial 8-row block of A, zero rows past m
  float edge[kMr * kNr];
  void size(int64_t m, int64_t n) {
    x.resize(m * n);
    for (auto* v : {&g, &p, &t, &q, &total}) v->resize(m * m);
    const auto padded = [](int64_t v) { return (v + kNr - 1) / kNr * kNr; };
    bpack.resize(std::max(padded(m) * n, padded(n) * m));  // B = Y^T (n x m) or a k = m product
  }
};

// C (m x n, row stride ldc) = (accumulate ? C : 0) + A (m x k, row-major, row stride lda) B (k x n).
// With `upper` (m == n, the product known to be symmetric) only the 32 x 32 blocks on and above the
// diagonal are computed and C's upper triangle is copied into its lower one. Full 8-row blocks of A
// are read in place (packed, they cost a third of the products' time in scalar copies); a last
// partial one is packed with zero rows.
void gemm(const float* a, int64_t lda, Mat b, int64_t m, int64_t k, int64_t n, float* c, int64_t ldc,
          bool accumulate, bool upper, Work& w) {
  const int64_t panels = (n + kNr - 1) / kNr;
  auto in_place = [&](int64_t p) { return b.cs == 1 && (p + 1) * kNr <= n; };
  for (int64_t p = 0; p < panels; ++p) {
    if (in_place(p)) continue;
    float* dst = w.bpack.data() + p * k * kNr;
    const int64_t cols = std::min(kNr, n - p * kNr);
    for (int64_t kk = 0; kk < k; ++kk) {
      for (int64_t j = 0; j < cols; ++j) dst[kk * kNr + j] = b.at(kk, p * kNr + j);
      for (int64_t j = cols; j < kNr; ++j) dst[kk * kNr + j] = 0.f;
    }
  }
  for (int64_t r0 = 0; r0 < m; r0 += kTile) {
    const int64_t rows = std::min(kTile, m - r0), micros = (rows + kMr - 1) / kMr, full = rows / kMr;
    const int64_t first = upper ? r0 / kNr : 0;
    for (int64_t k0 = 0; k0 < k; k0 += kKc) {
      const int64_t kc = std::min(kKc, k - k0);
      if (full < micros)  // the partial block, k-contiguous rows of kc, rows past `rows` zero
        for (int64_t i = 0; i < kMr; ++i)
          for (int64_t kk = 0; kk < kc; ++kk) {
            const int64_t row = full * kMr + i;
            w.apack[i * kc + kk] = row < rows ? a[(r0 + row) * lda + k0 + kk] : 0.f;
          }
      const bool load = accumulate || k0 > 0;
      for (int64_t p = first; p < panels; ++p) {
        const int64_t ldb = in_place(p) ? b.rs : kNr;
        const float* panel = (in_place(p) ? b.p + p * kNr : w.bpack.data() + p * k * kNr) + k0 * ldb;
        const int64_t cols = std::min(kNr, n - p * kNr);
        for (int64_t t = 0; t < micros; ++t) {
          const int64_t valid = std::min(kMr, rows - t * kMr);
          float* out = c + (r0 + t * kMr) * ldc + p * kNr;
          const float* at = t < full ? a + (r0 + t * kMr) * lda + k0 : w.apack;
          const int64_t ld = t < full ? lda : kc;
          if (valid == kMr && cols == kNr) {
            zaya::gemm_tile(at, ld, 1, panel, ldb, kc, out, ldc, load);
            continue;
          }
          std::fill(w.edge, w.edge + kMr * kNr, 0.f);
          if (load)
            for (int64_t i = 0; i < valid; ++i) std::memcpy(w.edge + i * kNr, out + i * ldc, sizeof(float) * cols);
          zaya::gemm_tile(at, ld, 1, panel, ldb, kc, w.edge, kNr, load);
          for (int64_t i = 0; i < valid; ++i) std::memcpy(out + i * ldc, w.edge + i * kNr, sizeof(float) * cols);
        }
      }
    }
  }
  if (upper)
    for (int64_t i = 1; i < m; ++i)
      for (int64_t j = 0; j < i; ++j) c[i * ldc + j] = c[j * ldc + i];
}

struct Coeffs {
  float a, b, c;
};

Mat rows_of(const float* p, int64_t width) { return {p, width, 1}; }
Mat transposed(const float* p, int64_t width) { return {p, 1, width}; }

// G (m x m) = Y Y^T for Y (m x n).
void gram_of(const float* y, int64_t m, int64_t n, float* g, Work& w) {
  gemm(y, n, transposed(y, n), m, n, m, g, m, false, true, w);
}

// P = (diag ? aI : 0) + bG + cG^2, the square through `p` itself.
void polynomial(const float* g, int64_t m, Coeffs k, bool diag, float* p, Work& w) {
  gemm(g, m, rows_of(g, m), m, m, m, p, m, false, true, w);
  for (int64_t i = 0; i < m * m; ++i) p[i] = k.c * p[i] + k.b * g[i];
  if (diag)
    for (int64_t i = 0; i < m; ++i) p[i * m + i] += k.a;
}

// out = the standard iteration from x0: `steps` times X <- aX + (bG + cG^2)X, in turns through
// `out` and the scratch iterate so that the last step writes `out`.
void standard(const float* x0, float* out, int64_t m, int64_t n, int steps, Coeffs k, Work& w) {
  const float* x = x0;
  for (int s = 0; s < steps; ++s) {
    float* next = (steps - 1 - s) % 2 == 0 ? out : w.x.data();
    gram_of(x, m, n, w.g.data(), w);
    polynomial(w.g.data(), m, k, false, w.p.data(), w);
    gemm(w.p.data(), m, rows_of(x, n), m, m, n, next, n, false, false, w);
    for (int64_t i = 0; i < m * n; ++i) next[i] += k.a * x[i];
    x = next;
  }
}

// C = A B for m x m matrices known to commute (a symmetric result).
void sym_product(const std::vector<float>& a, const std::vector<float>& b, int64_t m, std::vector<float>& c,
                 Work& w) {
  gemm(a.data(), m, rows_of(b.data(), m), m, m, m, c.data(), m, false, true, w);
}

// The Gram formulation (newton_schulz_gram_reference): per segment of `restart` steps, Q with
// X_k = Q X from G = X X^T alone (P = aI + bG + cG^2, Q <- PQ, G <- PGP), the segments' Qs
// multiplied into `total`; a later segment's G is the Gram matrix of total X0, formed whole in
// the scratch iterate. out = total X0.
void gram_form(const float* x0, float* out, int64_t m, int64_t n, int steps, int restart, Coeffs k, Work& w) {
  for (int done = 0; done < steps;) {
    const int seg = std::min(restart, steps - done);
    if (done == 0) {
      gram_of(x0, m, n, w.g.data(), w);
    } else {
      gemm(w.total.data(), m, rows_of(x0, n), m, m, n, w.x.data(), n, false, false, w);
      gram_of(w.x.data(), m, n, w.g.data(), w);
    }
    polynomial(w.g.data(), m, k, true, w.q.data(), w);  // Q_1 = P_0
    if (seg > 1) {
      sym_product(w.q, w.g, m, w.t, w);  // G_1 = Q G Q
      sym_product(w.t, w.q, m, w.g, w);
      for (int s = 2; s < seg; ++s) {
        polynomial(w.g.data(), m, k, true, w.p.data(), w);
        sym_product(w.p, w.q, m, w.t, w);
        std::swap(w.q, w.t);
        sym_product(w.p, w.g, m, w.t, w);
        sym_product(w.t, w.p, m, w.g, w);
      }
      polynomial(w.g.data(), m, k, true, w.p.data(), w);
      sym_product(w.p, w.q, m, w.t, w);
      std::swap(w.q, w.t);
    }
    if (done == 0) {
      std::swap(w.total, w.q);
    } else {  // in full: its asymmetry is float32 error that G from total X0 corrects (symmetrised: ~1e-3 off)
      gemm(w.q.data(), m, rows_of(w.total.data(), m), m, m, m, w.t.data(), m, false, false, w);
      std::swap(w.total, w.t);
    }
    done += seg;
  }
  gemm(w.total.data(), m, rows_of(x0, n), m, m, n, out, n, false, false, w);
}

ffi::Error Orthogonalize(ffi::ThreadPool& pool, const char* name, int32_t steps, Coeffs k, bool gram, int32_t restart,
                         ffi::Buffer<ffi::F32>& x, ffi::Result<ffi::Buffer<ffi::F32>>& y) {
  auto d = x.dimensions();
  if (d.size() < 2) return ffi::Error::InvalidArgument(std::string(name) + " needs (..., m, n) matrices");
  const int64_t m = d[d.size() - 2], n = d.back();
  if (m > n) return ffi::Error::InvalidArgument(std::string(name) + " needs m <= n (transpose tall matrices)");
  if (steps < 0 || restart < 1)
    return ffi::Error::InvalidArgument(std::string(name) + " needs steps >= 0 and restart >= 1");
  const int64_t count = m * n ? static_cast<int64_t>(x.element_count()) / (m * n) : 0;
  const float* in = x.typed_data();
  float* out = y->typed_data();
  if (steps == 0 || count == 0) {
    std::copy(in, in + count * m * n, out);
    return ffi::Error::Success();
  }
  const int workers = zaya::worker_count(pool, count, 0);
  std::vector<Work> work(workers);
  zaya::parallel_items(pool, count, workers, [&](int64_t i, int worker) {
    Work& w = work[worker];
    w.size(m, n);
    if (gram)
      gram_form(in + i * m * n, out + i * m * n, m, n, steps, restart, k, w);
    else
      standard(in + i * m * n, out + i * m * n, m, n, steps, k, w);
  });
  return ffi::Error::Success();
}

ffi::Error NewtonSchulzCpuImpl(ffi::ThreadPool pool, int32_t steps, float a, float b, float c, bool gram,
                               int32_t restart, ffi::Buffer<ffi::F32> x, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  return Orthogonalize(pool, "zaya_newton_schulz_cpu", steps, {a, b, c}, gram, restart, x, y);
}

ffi::Error NewtonSchulzImpl(ffi::ThreadPool pool, int32_t steps, float a, float b, float c, ffi::Buffer<ffi::F32> x,
                            ffi::Result<ffi::Buffer<ffi::F32>> y) {
  return Orthogonalize(pool, "zaya_newton_schulz", steps, {a, b, c}, false, 1, x, y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZayaNewtonSchulzCpu, NewtonSchulzCpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<int32_t>("steps")
                                  .Attr<float>("a")
                                  .Attr<float>("b")
                                  .Attr<float>("c")
                                  .Attr<bool>("gram")
                                  .Attr<int32_t>("restart")
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZayaNewtonSchulz, NewtonSchulzImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<int32_t>("steps")
                                  .Attr<float>("a")
                                  .Attr<float>("b")
                                  .Attr<float>("c")
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
