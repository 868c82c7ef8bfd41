// Grouped matrix products for XLA:CPU, on one register-tiled GEMM core:
//
//   zaya_grouped_matmul     the dropless MoE's expert GEMMs over rows sorted by expert (jax.lax.ragged_dot's
//                           contract): y[r] = x[r] @ w[g(r)] (w: G x K x N; transpose_w: w[g]^T, w G x N x K),
//                           rows past sum(group_sizes) zero; no padding rows, no per-block copy of the weights
//   zaya_grouped_matmul_dw  its weight gradient: dw[g] = x[rows of g]^T @ dy[rows of g] (0 for an empty group)
//
// Why a kernel: XLA:CPU has no grouped GEMM. Its ragged_dot is a dense product per group (G times the
// work), and the blocked form (a batched matmul over 128-row blocks, each with its group's weights)
// runs its 128 x 128 x 512 products at 46-79 GFLOP/s on a 2-core AVX-512 machine where one
// 2048 x 128 x 512 product runs at ~190: XLA:CPU runs a batch of small products at about one core's
// peak (bench/RESULTS.md, issue 41). Here every group is one GEMM over its own rows.
//
// The GEMM: C = A @ B with A and B read through strided views. A panel of 32 columns of B is read in
// place where those columns are contiguous (a row-major B); otherwise (a transposed B, the last
// partial panel) it is packed first (k-major, zero-padded). A is read in place through its strides
// (only a last partial 8-row micro-panel is packed, zero-padded), and an 8 x 32 register tile (16
// accumulators of 16 floats; zaya::gemm_tile in zaya_simd.h, shared with the Newton-Schulz handler)
// runs over the contraction in blocks of kKc, the products summed in order (as XLA:CPU's dot does).
// Work items are (problem, 32-row tile, panels): all of a row's panels, or 4 where there are too few
// row tiles to keep every thread busy; they are spread over XLA's intra-op pool and the calling
// thread, and each output element is one item's, so the results do not depend on the threads'
// timing. Vectors are GCC vector extensions (AVX-512 in one register, split by the compiler for
// AVX2, SSE or NEON), the tile compiled for x86-64-v4 and v3 besides the baseline (target_clones,
// x86-64 with GCC only).
// float32 only; the Python side keeps XLA's products for other dtypes.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "zaya_parallel.h"
#include "zaya_simd.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMr = 8;    // rows of the register tile
constexpr int64_t kNr = 32;   // columns of the register tile (two vectors of 16)
constexpr int64_t kTile = 32; // rows per work item (kTile / kMr register tiles)
constexpr int64_t kKc = 256;  // contraction block: a B panel block is kKc x 32 floats (32 KiB)

// A strided matrix view: element (i, j) at p[i * rs + j * cs].
struct View {
  const float* p;
  int64_t rs, cs;
  float at(int64_t i, int64_t j) const { return p[i * rs + j * cs]; }
};

// Panel p of B (K x N): K x 32 floats, k-major, columns past N zero.
void pack_panel(View b, int64_t k, int64_t n, int64_t p, float* panel) {
  const int64_t cols = std::min(kNr, n - p * kNr);
  for (int64_t kk = 0; kk < k; ++kk) {
    float* row = panel + kk * kNr;
    for (int64_t j = 0; j < cols; ++j) row[j] = b.at(kk, p * kNr + j);
    for (int64_t j = cols; j < kNr; ++j) row[j] = 0.f;
  }
}

// One GEMM of a grouped call: C (m x n, leading dimension ldc) = A (m x k) @ B (k x n), A and B
// read through their views. A panel of B whose 32 columns are contiguous in memory (a row-major B)
// is read in place; the others (a transposed B, the last partial panel) are packed into `packed`
// (room for ceil(n / 32) panels) before the products.
struct Problem {
  View a, b;
  int64_t m, k, n;
  float* c;
  int64_t ldc;
  float* packed;
  int64_t panels() const { return (n + kNr - 1) / kNr; }
  bool in_place(int64_t p) const { return b.cs == 1 && (p + 1) * kNr <= n; }
  const float* panel(int64_t p) const { return in_place(p) ? b.p + p * kNr : packed + p * k * kNr; }
  int64_t panel_stride(int64_t p) const { return in_place(p) ? b.rs : kNr; }
};

// Rows [r0, r0 + rows) (rows <= kTile) and panels [p0, p1) of a problem's C. Full 8-row micro-tiles
// read A in place through its strides (packing it cost ~5% of the train step's kernel time in
// scalar copies); the last, partial one is packed with zero rows.
void tile_product(const Problem& q, int64_t r0, int64_t rows, int64_t p0, int64_t p1) {
  const int64_t micro = (rows + kMr - 1) / kMr, full = rows / kMr, k = q.k;
  float ap[kMr * kKc];
  float acc[kMr * kNr];
  for (int64_t k0 = 0; k0 < k; k0 += kKc) {
    const int64_t kc = std::min(kKc, k - k0);
    if (full < micro)  // the partial micro-panel for this block, rows past `rows` zero
      for (int64_t kk = 0; kk < kc; ++kk)
        for (int64_t i = 0; i < kMr; ++i) {
          const int64_t row = full * kMr + i;
          ap[kk * kMr + i] = row < rows ? q.a.at(r0 + row, k0 + kk) : 0.f;
        }
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t ldb = q.panel_stride(p);
      const float* panel = q.panel(p) + k0 * ldb;
      const int64_t cols = std::min(kNr, q.n - p * kNr);
      for (int64_t t = 0; t < micro; ++t) {
        if (t < full)
          zaya::gemm_tile(q.a.p + (r0 + t * kMr) * q.a.rs + k0 * q.a.cs, q.a.rs, q.a.cs, panel, ldb, kc, acc,
                          kNr, false);
        else
          zaya::gemm_tile(ap, 1, kMr, panel, ldb, kc, acc, kNr, false);
        const int64_t valid = std::min(kMr, rows - t * kMr);
        for (int64_t i = 0; i < valid; ++i) {
          float* out = q.c + (r0 + t * kMr + i) * q.ldc + p * kNr;
          const float* src = acc + i * kNr;
          if (k0 == 0)
            std::memcpy(out, src, sizeof(float) * cols);
          else
            for (int64_t j = 0; j < cols; ++j) out[j] += src[j];
        }
      }
    }
  }
}

// Runs work(item) for every item on the pool's threads, the caller one of them (measured faster than
// the threads and the caller besides at these items' sizes on 2 cores).
template <typename Work>
void parallel_items(ffi::ThreadPool& pool, int64_t items, Work work) {
  zaya::parallel_items(pool, items, zaya::worker_count(pool, items, 0), [&](int64_t i, int) { work(i); });
}

// Packs every problem's B (one item per panel), then runs every (problem, kTile rows, panels)
// tile: all of a row's panels per item (A packed once per tile), or 4 (128 columns) where there are
// too few row tiles to keep every worker busy to the end.
void run_problems(ffi::ThreadPool& pool, std::vector<Problem>& problems) {
  struct Ref {
    int64_t problem, a, b;
  };
  int64_t row_tiles = 0, widest = 0;
  for (const Problem& q : problems) {
    row_tiles += (q.m + kTile - 1) / kTile;
    widest = std::max(widest, q.panels());
  }
  const int64_t per_item = row_tiles >= 8 * (pool.num_threads() + 1) ? widest : 4;
  std::vector<Ref> packs, tiles;
  for (int64_t i = 0; i < static_cast<int64_t>(problems.size()); ++i) {
    const Problem& q = problems[i];
    for (int64_t p = 0; p < q.panels(); ++p)
      if (!q.in_place(p)) packs.push_back({i, p, 0});
    for (int64_t r = 0; r < q.m; r += kTile)
      for (int64_t p = 0; p < q.panels(); p += per_item) tiles.push_back({i, r, p});
  }
  parallel_items(pool, static_cast<int64_t>(packs.size()), [&](int64_t i) {
    const Problem& q = problems[packs[i].problem];
    pack_panel(q.b, q.k, q.n, packs[i].a, q.packed + packs[i].a * q.k * kNr);
  });
  parallel_items(pool, static_cast<int64_t>(tiles.size()), [&](int64_t i) {
    const Problem& q = problems[tiles[i].problem];
    const int64_t r0 = tiles[i].a, p0 = tiles[i].b;
    tile_product(q, r0, std::min(kTile, q.m - r0), p0, std::min(q.panels(), p0 + per_item));
  });
}

// Row offsets of the groups: starts[g], ends[g] (sizes below 0 count as 0; rows past `rows` are cut).
void group_bounds(const int32_t* sizes, int64_t groups, int64_t rows, std::vector<int64_t>& starts,
                  std::vector<int64_t>& ends) {
  starts.resize(groups);
  ends.resize(groups);
  int64_t at = 0;
  for (int64_t g = 0; g < groups; ++g) {
    starts[g] = at;
    at = std::min(rows, at + std::max<int64_t>(0, sizes[g]));
    ends[g] = at;
  }
}

ffi::Error GroupedMatmulImpl(ffi::ThreadPool pool, bool transpose_w, ffi::Buffer<ffi::F32> x,
                             ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> group_sizes,
                             ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || group_sizes.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("zaya_grouped_matmul: x (rows, K), w (G, K, N), group_sizes (G,)");
  const int64_t rows = xd[0], k = xd[1], groups = wd[0];
  const int64_t n = transpose_w ? wd[1] : wd[2];
  if ((transpose_w ? wd[2] : wd[1]) != k || group_sizes.dimensions()[0] != groups)
    return ffi::Error::InvalidArgument("zaya_grouped_matmul: w's contraction size or group count does not match");
  std::vector<int64_t> starts, ends;
  group_bounds(group_sizes.typed_data(), groups, rows, starts, ends);
  float* out = y->typed_data();
  const int64_t covered = groups ? ends.back() : 0;
  std::memset(out + covered * n, 0, sizeof(float) * (rows - covered) * n);
  const int64_t panel_floats = (n + kNr - 1) / kNr * kNr * k;
  std::vector<float> packed(static_cast<size_t>(groups * panel_floats));
  std::vector<Problem> problems;
  for (int64_t g = 0; g < groups; ++g) {
    if (ends[g] == starts[g]) continue;
    const float* wg = w.typed_data() + g * k * n;
    problems.push_back({View{x.typed_data() + starts[g] * k, k, 1}, transpose_w ? View{wg, 1, k} : View{wg, n, 1},
                        ends[g] - starts[g], k, n, out + starts[g] * n, n, packed.data() + g * panel_floats});
  }
  run_problems(pool, problems);
  return ffi::Error::Success();
}

ffi::Error GroupedMatmulDwImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> dy,
                               ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> dw) {
  auto xd = x.dimensions(), yd = dy.dimensions(), wd = dw->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || wd.size() != 3 || xd[0] != yd[0] || wd[1] != xd[1] || wd[2] != yd[1] ||
      group_sizes.dimensions().size() != 1 || group_sizes.dimensions()[0] != wd[0])
    return ffi::Error::InvalidArgument("zaya_grouped_matmul_dw: x (rows, K), dy (rows, N), dw (G, K, N)");
  const int64_t rows = xd[0], k = xd[1], n = yd[1], groups = wd[0];
  std::vector<int64_t> starts, ends;
  group_bounds(group_sizes.typed_data(), groups, rows, starts, ends);
  float* out = dw->typed_data();
  // dw[g] (K x N) = x_g^T (K x rows_g) @ dy_g (rows_g x N), contracted over the group's rows; a group
  // without rows gets zeros.
  const int64_t panels = (n + kNr - 1) / kNr;
  std::vector<float> packed(static_cast<size_t>(panels * kNr * rows));
  std::vector<Problem> problems;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t depth = ends[g] - starts[g];
    if (depth == 0) {
      std::memset(out + g * k * n, 0, sizeof(float) * k * n);
      continue;
    }
    problems.push_back({View{x.typed_data() + starts[g] * k, 1, k}, View{dy.typed_data() + starts[g] * n, n, 1}, k,
                        depth, n, out + g * k * n, n, packed.data() + panels * kNr * starts[g]});
  }
  run_problems(pool, problems);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZayaGroupedMatmul, GroupedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<bool>("transpose_w")
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZayaGroupedMatmulDw, GroupedMatmulDwImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
