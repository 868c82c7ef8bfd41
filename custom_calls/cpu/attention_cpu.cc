// Fused flash attention for XLA:CPU, forward and backward, with CCA's whole mask description (the
// same per-row vectors as the Pallas GPU kernel, zaya_jax/ops/attention/pallas.py):
//   key j is visible to query i  <=>  k_slot[j] <= q_slot[i]  &&  k_slot[j] >= q_low[i]
//                                     && q_seg[b, i] == k_seg[b, j]
// (q_low = q_slot - window + 1, or very negative without a window; a padding key carries a segment
// no query has). GQA without repeating K/V: one work item is (batch, KV head, block) and holds the
// g query heads of that KV head, so each key block is loaded once for all of them.
//
// Forward: FlashAttention-2 over key blocks (online max / denominator), returning the output and the
// natural-log log-sum-exp per row (-inf and a zero output for a row that sees no key). Backward: one
// pass per (batch, KV head, key block) recomputing the probabilities from the log-sum-exp; dK and dV
// are that key block's own. dQ: where there are at least 4 (batch, KV head) pairs per worker, one
// item is a pair, which walks its key blocks in order and owns its dQ (no partial sums); otherwise
// one item is a key block and dQ is accumulated in one buffer per lane (a fixed share of the items),
// summed at the end. Either way in the same order on every call. Key blocks (forward) and query
// blocks (backward) that hold no visible pair are skipped from the slot ranges.
//
// Work items are spread over XLA's intra-op thread pool (ffi::ThreadPool); the calling thread works
// too, so the kernel never waits on a pool that is busy elsewhere. Inner loops are written for the
// compiler to vectorise (contiguous innermost axes, `omp simd`), and the hot functions are compiled
// for AVX-512 and AVX2 besides the baseline (target_clones; x86-64 with GCC only), chosen at load time.
//
// Registered from Python as zaya_attention_fwd / zaya_attention_bwd on "cpu" (zaya_jax/ops/attention/cpu.py).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "zaya_math.h"
#include "zaya_parallel.h"
#include "zaya_simd.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlockQ = 64;
constexpr int64_t kBlockK = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 to ~2 ulp, vectorisable (no libm call): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2]
// (n rounded by adding 1.5 * 2^23). x below -87 (and -inf) gives exactly 0.
ZAYA_INLINE float exp_nonpositive(float x) {
  const bool tiny = x < -87.f;
  x = tiny ? -87.f : x;
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return tiny ? 0.f : p * scale;
}

struct Dims {
  int64_t batch, seq_q, seq_k, heads, kv_heads, width, groups;
  float scale;
  int64_t q_blocks() const { return (seq_q + kBlockQ - 1) / kBlockQ; }
  int64_t k_blocks() const { return (seq_k + kBlockK - 1) / kBlockK; }
};

struct Mask {
  const int32_t *q_slot, *q_low, *q_seg, *k_slot, *k_seg;  // q_seg, k_seg: (batch, seq)
};

// The slot range [lo, hi] of the keys some query of rows [r0, r1) may see, and the same for the
// queries some key of [c0, c1) may be seen by: a block pair outside both is skipped.
struct Range {
  int32_t lo, hi;
};

Range query_reach(const Mask& m, int64_t r0, int64_t r1) {
  Range r{std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min()};
  for (int64_t i = r0; i < r1; ++i) {
    r.lo = std::min(r.lo, m.q_low[i]);
    r.hi = std::max(r.hi, m.q_slot[i]);
  }
  return r;
}

Range key_span(const Mask& m, int64_t c0, int64_t c1) {
  Range r{std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min()};
  for (int64_t j = c0; j < c1; ++j) {
    r.lo = std::min(r.lo, m.k_slot[j]);
    r.hi = std::max(r.hi, m.k_slot[j]);
  }
  return r;
}

bool overlaps(Range reach, Range span) { return span.lo <= reach.hi && span.hi >= reach.lo; }

// Whether every query of rows [r0, r1) sees every key of [c0, c1) (batch b): such a block pair (most
// of a causal triangle) needs no mask at all.
bool all_visible(const Mask& m, int64_t b, int64_t seq_q, int64_t seq_k, int64_t r0, int64_t r1, int64_t c0,
                 int64_t c1) {
  const int32_t seg = m.q_seg[b * seq_q + r0];
  int32_t first_slot = std::numeric_limits<int32_t>::max(), last_low = std::numeric_limits<int32_t>::min();
  for (int64_t i = r0; i < r1; ++i) {
    if (m.q_seg[b * seq_q + i] != seg) return false;
    first_slot = std::min(first_slot, m.q_slot[i]);
    last_low = std::max(last_low, m.q_low[i]);
  }
  for (int64_t j = c0; j < c1; ++j)
    if (m.k_slot[j] > first_slot || m.k_slot[j] < last_low || m.k_seg[b * seq_k + j] != seg) return false;
  return true;
}

using zaya::parallel_items;

// The pool's threads and the caller.
int worker_count(ffi::ThreadPool& pool, int64_t items) { return zaya::worker_count(pool, items, 1); }

// rows [r0, r0 + rows) of query head h of a (batch, seq_q, heads, width) array, times `scale`, as float
template <typename T>
void load_rows(const T* x, const Dims& d, int64_t b, int64_t h, int64_t r0, int64_t rows, float scale, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t base = ((b * d.seq_q + r0 + r) * d.heads + h) * d.width;
    for (int64_t c = 0; c < d.width; ++c) out[r * d.width + c] = zaya::Elem<T>::load(x, base + c) * scale;
  }
}

using zaya::kLanes;
using zaya::load_vf;
using zaya::store_vf;
using zaya::vf;

// s (rows x kBlockK) = a (rows x width) . bt (width x kBlockK): four rows at a time, their score
// rows (4 x 4 vectors) held in registers while the width is walked.
template <int R>
ZAYA_INLINE void score_rows(const float* __restrict a, const float* __restrict bt, int64_t width, float* __restrict s) {
  constexpr int V = kBlockK / kLanes;
  vf acc[R][V] = {};
  for (int64_t c = 0; c < width; ++c) {
    vf b[V];
    for (int t = 0; t < V; ++t) b[t] = load_vf(bt + c * kBlockK + t * kLanes);
    for (int r = 0; r < R; ++r) {
      const float x = a[r * width + c];
      for (int t = 0; t < V; ++t) acc[r][t] += x * b[t];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < V; ++t) store_vf(s + r * kBlockK + t * kLanes, acc[r][t]);
}

ZAYA_CLONES void scores(const float* __restrict a, const float* __restrict bt, int64_t rows, int64_t width,
                        float* __restrict s) {
  int64_t i = 0;
  for (; i + 4 <= rows; i += 4) score_rows<4>(a + i * width, bt, width, s + i * kBlockK);
  for (; i < rows; ++i) score_rows<1>(a + i * width, bt, width, s + i * kBlockK);
}

// acc (m x w, contiguous rows) += coef (m x n, strides si, sj) . rows (n x w, contiguous rows).
void accumulate(float* acc, const float* coef, int64_t si, int64_t sj, const float* rows, int64_t m, int64_t n,
                int64_t w) {
  zaya::mac(acc, w, coef, si, sj, rows, w, m, n, w);
}

// One key block's slots and segments (keys past the sequence's end get a slot no query reaches).
// A score row is masked by mask_row (hidden keys -> -inf, returns the row's max), or only reduced by
// max_row where the whole block is visible, then exponentiated by exp_row (returns the sum).
struct KeyBlock {
  int32_t slot[kBlockK];
  int32_t seg[kBlockK];
};

ZAYA_CLONES float mask_row(float* __restrict s, const KeyBlock& kb, int32_t slot, int32_t low, int32_t seg) {
  float m = kNegInf;
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < kBlockK; ++j) {
    const bool visible = (kb.slot[j] <= slot) & (kb.slot[j] >= low) & (kb.seg[j] == seg);
    s[j] = visible ? s[j] : kNegInf;
    m = std::max(m, s[j]);
  }
  return m;
}

ZAYA_CLONES float max_row(const float* __restrict s) {
  float m = kNegInf;
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < kBlockK; ++j) m = std::max(m, s[j]);
  return m;
}

ZAYA_CLONES float exp_row(float* __restrict s, float shift) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < kBlockK; ++j) {
    s[j] = exp_nonpositive(s[j] - shift);
    sum += s[j];
  }
  return sum;
}

// The block's key slots and segments, padded with keys no query sees.
void load_key_block(const Mask& mask, int64_t b, int64_t seq_k, int64_t c0, int64_t nc, KeyBlock& kb) {
  for (int64_t j = 0; j < kBlockK; ++j) {
    kb.slot[j] = j < nc ? mask.k_slot[c0 + j] : std::numeric_limits<int32_t>::max();
    kb.seg[j] = j < nc ? mask.k_seg[b * seq_k + c0 + j] : 0;
  }
}

template <typename T>
struct Forward {
  const T *q, *k, *v;
  Mask mask;
  Dims d;
  T* out;
  float* lse;

  // One (batch, KV head, query block): the g query heads of that KV head, rows (head, position).
  void item(int64_t index) const {
    const int64_t qb = index % d.q_blocks(), kh = (index / d.q_blocks()) % d.kv_heads;
    const int64_t b = index / (d.q_blocks() * d.kv_heads);
    const int64_t r0 = qb * kBlockQ, nr = std::min(kBlockQ, d.seq_q - r0), w = d.width, rows = d.groups * kBlockQ;
    std::vector<float> qt(rows * w, 0.f), kt(w * kBlockK), vb(kBlockK * w), s(rows * kBlockK), acc(rows * w, 0.f);
    std::vector<float> row_max(rows, kNegInf), denom(rows, 0.f);
    KeyBlock keys;
    for (int64_t g = 0; g < d.groups; ++g)
      load_rows(q, d, b, kh * d.groups + g, r0, nr, d.scale, qt.data() + g * kBlockQ * w);
    const Range reach = query_reach(mask, r0, r0 + nr);
    const int32_t* qseg = mask.q_seg + b * d.seq_q + r0;
    for (int64_t kb = 0; kb < d.k_blocks(); ++kb) {
      const int64_t c0 = kb * kBlockK, nc = std::min(kBlockK, d.seq_k - c0);
      if (!overlaps(reach, key_span(mask, c0, c0 + nc))) continue;
      for (int64_t j = 0; j < kBlockK; ++j)
        for (int64_t c = 0; c < w; ++c) {
          const int64_t at = ((b * d.seq_k + c0 + j) * d.kv_heads + kh) * w + c;
          kt[c * kBlockK + j] = j < nc ? zaya::Elem<T>::load(k, at) : 0.f;
          vb[j * w + c] = j < nc ? zaya::Elem<T>::load(v, at) : 0.f;
        }
      load_key_block(mask, b, d.seq_k, c0, nc, keys);
      const bool full = nc == kBlockK && all_visible(mask, b, d.seq_q, d.seq_k, r0, r0 + nr, c0, c0 + nc);
      scores(qt.data(), kt.data(), rows, w, s.data());
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t r = i % kBlockQ;
        float* si = s.data() + i * kBlockK;
        const float block_max = r >= nr ? kNegInf
                                : full  ? max_row(si)
                                        : mask_row(si, keys, mask.q_slot[r0 + r], mask.q_low[r0 + r], qseg[r]);
        const float m = std::max(row_max[i], block_max);
        if (m == kNegInf) {  // nothing visible in this block or before: no contribution
          std::fill(si, si + kBlockK, 0.f);
          continue;
        }
        const float alpha = exp_nonpositive(row_max[i] - m);
        denom[i] = denom[i] * alpha + exp_row(si, m);
        row_max[i] = m;
        float* ai = acc.data() + i * w;
        for (int64_t c = 0; c < w; ++c) ai[c] *= alpha;
      }
      accumulate(acc.data(), s.data(), kBlockK, 1, vb.data(), rows, kBlockK, w);
    }
    for (int64_t g = 0; g < d.groups; ++g)
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t i = g * kBlockQ + r, h = kh * d.groups + g;
        const bool seen = denom[i] > 0.f;
        const float inv = seen ? 1.f / denom[i] : 0.f;
        const int64_t row = (b * d.seq_q + r0 + r) * d.heads + h;
        for (int64_t c = 0; c < w; ++c) zaya::Elem<T>::store(out, row * w + c, acc[i * w + c] * inv);
        lse[row] = seen ? row_max[i] + std::log(denom[i]) : kNegInf;
      }
  }
};

template <typename T>
struct Backward {
  const T *q, *k, *v, *out, *d_out;
  const float *lse, *d_lse;
  Mask mask;
  Dims d;
  T *dk, *dv;
  float* delta;  // (batch, seq_q, heads): rowsum(d_out * out) - d_lse

  void row_delta(int64_t row) const {
    float s = 0.f;
    for (int64_t c = 0; c < d.width; ++c)
      s += zaya::Elem<T>::load(d_out, row * d.width + c) * zaya::Elem<T>::load(out, row * d.width + c);
    delta[row] = s - d_lse[row];
  }

  // Key block kb of (batch b, KV head kh): its dK and dV, written out; its share of dQ added to
  // dq_heads, the (groups, seq_q, width) float dQ of that KV head's query heads (unscaled).
  void key_block(int64_t b, int64_t kh, int64_t kb, float* dq_heads) const {
    const int64_t c0 = kb * kBlockK, nc = std::min(kBlockK, d.seq_k - c0), w = d.width;
    std::vector<float> kt(w * kBlockK), vt(w * kBlockK), krows(kBlockK * w), dkb(kBlockK * w, 0.f),
        dvb(kBlockK * w, 0.f), qt(kBlockQ * w), dout(kBlockQ * w), p(kBlockQ * kBlockK), dp(kBlockQ * kBlockK);
    for (int64_t j = 0; j < kBlockK; ++j)
      for (int64_t c = 0; c < w; ++c) {
        const int64_t at = ((b * d.seq_k + c0 + j) * d.kv_heads + kh) * w + c;
        const float kv = j < nc ? zaya::Elem<T>::load(k, at) : 0.f, vv = j < nc ? zaya::Elem<T>::load(v, at) : 0.f;
        kt[c * kBlockK + j] = kv;
        krows[j * w + c] = kv;
        vt[c * kBlockK + j] = vv;
      }
    KeyBlock keys;
    load_key_block(mask, b, d.seq_k, c0, nc, keys);
    const Range span = key_span(mask, c0, c0 + nc);
    for (int64_t qb = 0; qb < d.q_blocks(); ++qb) {
      const int64_t r0 = qb * kBlockQ, nr = std::min(kBlockQ, d.seq_q - r0);
      if (!overlaps(query_reach(mask, r0, r0 + nr), span)) continue;
      const bool full = nc == kBlockK && all_visible(mask, b, d.seq_q, d.seq_k, r0, r0 + nr, c0, c0 + nc);
      for (int64_t g = 0; g < d.groups; ++g) {
        const int64_t h = kh * d.groups + g;
        if (nr < kBlockQ) {
          std::fill(qt.begin(), qt.end(), 0.f);
          std::fill(dout.begin(), dout.end(), 0.f);
        }
        load_rows(q, d, b, h, r0, nr, d.scale, qt.data());
        load_rows(d_out, d, b, h, r0, nr, 1.f, dout.data());
        scores(qt.data(), kt.data(), kBlockQ, w, p.data());
        scores(dout.data(), vt.data(), kBlockQ, w, dp.data());
        for (int64_t r = 0; r < kBlockQ; ++r) {
          float* pr = p.data() + r * kBlockK;
          float* dpr = dp.data() + r * kBlockK;
          const int64_t row = (b * d.seq_q + r0 + r) * d.heads + h;
          if (r >= nr || lse[row] == kNegInf) {  // a padded row, or one that sees no key
            std::fill(pr, pr + kBlockK, 0.f);
            std::fill(dpr, dpr + kBlockK, 0.f);
            continue;
          }
          if (!full) mask_row(pr, keys, mask.q_slot[r0 + r], mask.q_low[r0 + r], mask.q_seg[b * d.seq_q + r0 + r]);
          exp_row(pr, lse[row]);
          const float dl = delta[row];
#pragma omp simd
          for (int64_t j = 0; j < kBlockK; ++j) dpr[j] = pr[j] * (dpr[j] - dl);  // dS
        }
        accumulate(dvb.data(), p.data(), 1, kBlockK, dout.data(), kBlockK, kBlockQ, w);  // dV += P^T dO
        accumulate(dkb.data(), dp.data(), 1, kBlockK, qt.data(), kBlockK, kBlockQ, w);   // dK += dS^T (q scale)
        accumulate(dq_heads + (g * d.seq_q + r0) * w, dp.data(), kBlockK, 1, krows.data(), nr, kBlockK,
                   w);  // dQ += dS K (scaled when written)
      }
    }
    for (int64_t j = 0; j < nc; ++j)
      for (int64_t c = 0; c < w; ++c) {
        const int64_t at = ((b * d.seq_k + c0 + j) * d.kv_heads + kh) * w + c;
        zaya::Elem<T>::store(dk, at, dkb[j * w + c]);
        zaya::Elem<T>::store(dv, at, dvb[j * w + c]);
      }
  }
};

ffi::Error dims_of(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v, float scale, Dims& d) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4)
    return ffi::Error::InvalidArgument("zaya_attention: q, k, v must be (batch, seq, heads, width)");
  d = Dims{qd[0], qd[1], kd[1], qd[2], kd[2], qd[3], 0, scale};
  if (kd[0] != d.batch || kd[3] != d.width || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2] || vd[3] != kd[3])
    return ffi::Error::InvalidArgument("zaya_attention: k and v must be (batch, seq_k, kv_heads, width) like q");
  if (d.kv_heads < 1 || d.heads % d.kv_heads)
    return ffi::Error::InvalidArgument("zaya_attention: query heads must be a multiple of kv heads");
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type())
    return ffi::Error::InvalidArgument("zaya_attention: q, k and v must share a dtype");
  d.groups = d.heads / d.kv_heads;
  return ffi::Error::Success();
}

using I32 = ffi::Buffer<ffi::S32>;

ffi::Error mask_of(const Dims& d, const I32& q_slot, const I32& q_low, const I32& q_seg, const I32& k_slot,
                   const I32& k_seg, Mask& m) {
  const auto n = [](const I32& x) { return static_cast<int64_t>(x.element_count()); };
  if (n(q_slot) != d.seq_q || n(q_low) != d.seq_q || n(k_slot) != d.seq_k || n(q_seg) != d.batch * d.seq_q ||
      n(k_seg) != d.batch * d.seq_k)
    return ffi::Error::InvalidArgument(
        "zaya_attention: the mask vectors must be q_slot, q_low (seq_q), q_seg (batch, seq_q), k_slot (seq_k), "
        "k_seg (batch, seq_k)");
  m = Mask{q_slot.typed_data(), q_low.typed_data(), q_seg.typed_data(), k_slot.typed_data(), k_seg.typed_data()};
  return ffi::Error::Success();
}

template <typename T>
void run_forward(ffi::ThreadPool& pool, const Forward<T>& f) {
  const int64_t items = f.d.batch * f.d.kv_heads * f.d.q_blocks();
  parallel_items(pool, items, worker_count(pool, items), [&](int64_t i, int) { f.item(i); });
}

ffi::Error AttentionFwdImpl(ffi::ThreadPool pool, float scale, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            I32 q_slot, I32 q_low, I32 q_seg, I32 k_slot, I32 k_seg, ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::Buffer<ffi::F32>> lse) {
  Dims d;
  if (auto err = dims_of(q, k, v, scale, d); err.failure()) return err;
  Mask m;
  if (auto err = mask_of(d, q_slot, q_low, q_seg, k_slot, k_seg, m); err.failure()) return err;
  switch (q.element_type()) {
    case ffi::F32:
      run_forward(pool, Forward<float>{q.typed_data<float>(), k.typed_data<float>(), v.typed_data<float>(), m, d,
                                       out->typed_data<float>(), lse->typed_data()});
      return ffi::Error::Success();
    case ffi::BF16:
      run_forward(pool, Forward<uint16_t>{q.reinterpret_data<uint16_t>(), k.reinterpret_data<uint16_t>(),
                                          v.reinterpret_data<uint16_t>(), m, d, out->reinterpret_data<uint16_t>(),
                                          lse->typed_data()});
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("zaya_attention supports float32 and bfloat16");
  }
}

// dq (batch, seq_q, heads, width) rows of query heads [h0, h0 + n) of batch b from sum (n, seq_q,
// width) floats, times scale.
template <typename T>
void store_dq(T* dq, const Dims& d, int64_t b, int64_t h0, int64_t n, const float* sum, float scale) {
  for (int64_t g = 0; g < n; ++g)
    for (int64_t s = 0; s < d.seq_q; ++s) {
      const float* from = sum + (g * d.seq_q + s) * d.width;
      const int64_t to = ((b * d.seq_q + s) * d.heads + h0 + g) * d.width;
      for (int64_t c = 0; c < d.width; ++c) zaya::Elem<T>::store(dq, to + c, from[c] * scale);
    }
}

template <typename T>
void run_backward(ffi::ThreadPool& pool, Backward<T> bw, T* dq_out) {
  const Dims& d = bw.d;
  const int64_t rows = d.batch * d.seq_q * d.heads;
  std::vector<float> delta(rows);
  bw.delta = delta.data();
  const int64_t row_chunks = (rows + 255) / 256;
  parallel_items(pool, row_chunks, worker_count(pool, row_chunks), [&](int64_t i, int) {
    for (int64_t r = i * 256; r < std::min(rows, (i + 1) * 256); ++r) bw.row_delta(r);
  });
  // Every sum below runs in a fixed order whichever thread runs it, so the gradient does not depend
  // on the threads' timing (a resumed run repeats the uninterrupted one bit for bit).
  const int64_t heads = d.batch * d.kv_heads, head_size = d.groups * d.seq_q * d.width;
  const int pool_workers = worker_count(pool, std::numeric_limits<int64_t>::max());
  if (heads >= 4 * static_cast<int64_t>(pool_workers)) {
    // Enough (batch, KV head) pairs to share out: each is one item that walks all its key blocks in
    // order and owns its query heads' dQ, summed in a local buffer and written once.
    parallel_items(pool, heads, worker_count(pool, heads), [&](int64_t i, int) {
      const int64_t b = i / d.kv_heads, kh = i % d.kv_heads;
      std::vector<float> dq(head_size, 0.f);
      for (int64_t kb = 0; kb < d.k_blocks(); ++kb) bw.key_block(b, kh, kb, dq.data());
      store_dq(dq_out, d, b, kh * d.groups, d.groups, dq.data(), d.scale);
    });
    return;
  }
  // Few pairs (long sequences, small batches): one item per key block. dQ's partial sums go to
  // `lanes` buffers with a fixed share of the items each (lane l: items l, l + lanes, ..., in
  // order), summed in lane order at the end. Twice as many lanes as workers keeps a busy thread's
  // lane short.
  const int64_t items = heads * d.k_blocks();
  const int lanes = static_cast<int>(std::min<int64_t>(items, 2 * static_cast<int64_t>(worker_count(pool, items))));
  const int64_t size = heads * head_size;  // (batch, KV head, group, seq_q, width) per lane
  std::vector<float> parts(static_cast<size_t>(lanes) * size, 0.f);
  parallel_items(pool, lanes, worker_count(pool, lanes), [&](int64_t lane, int) {
    for (int64_t i = lane; i < items; i += lanes) {
      const int64_t pair = i / d.k_blocks();
      bw.key_block(pair / d.kv_heads, pair % d.kv_heads, i % d.k_blocks(), parts.data() + lane * size + pair * head_size);
    }
  });
  parallel_items(pool, heads, worker_count(pool, heads), [&](int64_t pair, int) {
    float* sum = parts.data() + pair * head_size;  // lane 0's share, the others added in lane order
    for (int lane = 1; lane < lanes; ++lane) {
      const float* part = parts.data() + lane * size + pair * head_size;
#pragma omp simd
      for (int64_t e = 0; e < head_size; ++e) sum[e] += part[e];
    }
    store_dq(dq_out, d, pair / d.kv_heads, (pair % d.kv_heads) * d.groups, d.groups, sum, d.scale);
  });
}

ffi::Error AttentionBwdImpl(ffi::ThreadPool pool, float scale, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            I32 q_slot, I32 q_low, I32 q_seg, I32 k_slot, I32 k_seg, ffi::AnyBuffer out,
                            ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer d_out, ffi::Buffer<ffi::F32> d_lse,
                            ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                            ffi::Result<ffi::AnyBuffer> dv) {
  Dims d;
  if (auto err = dims_of(q, k, v, scale, d); err.failure()) return err;
  if (out.element_type() != q.element_type() || d_out.element_type() != q.element_type())
    return ffi::Error::InvalidArgument("zaya_attention_bwd: out and d_out must have q's dtype");
  Mask m;
  if (auto err = mask_of(d, q_slot, q_low, q_seg, k_slot, k_seg, m); err.failure()) return err;
  switch (q.element_type()) {
    case ffi::F32:
      run_backward(pool,
                   Backward<float>{q.typed_data<float>(), k.typed_data<float>(), v.typed_data<float>(),
                                   out.typed_data<float>(), d_out.typed_data<float>(), lse.typed_data(),
                                   d_lse.typed_data(), m, d, dk->typed_data<float>(), dv->typed_data<float>(),
                                   nullptr},
                   dq->typed_data<float>());
      return ffi::Error::Success();
    case ffi::BF16:
      run_backward(pool,
                   Backward<uint16_t>{q.reinterpret_data<uint16_t>(), k.reinterpret_data<uint16_t>(),
                                      v.reinterpret_data<uint16_t>(), out.reinterpret_data<uint16_t>(),
                                      d_out.reinterpret_data<uint16_t>(), lse.typed_data(), d_lse.typed_data(), m, d,
                                      dk->reinterpret_data<uint16_t>(), dv->reinterpret_data<uint16_t>(), nullptr},
                   dq->reinterpret_data<uint16_t>());
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("zaya_attention supports float32 and bfloat16");
  }
}

}  // namespace

// Both handlers take the pool, the scale, q, k, v and the five mask vectors first.
static auto bind_inputs() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Attr<float>("scale")
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<I32>()
      .Arg<I32>()
      .Arg<I32>()
      .Arg<I32>()
      .Arg<I32>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZayaAttentionFwd, AttentionFwdImpl,
                              bind_inputs().Ret<ffi::AnyBuffer>().Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZayaAttentionBwd, AttentionBwdImpl,
                              bind_inputs()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
