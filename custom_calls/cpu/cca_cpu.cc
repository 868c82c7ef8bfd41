// CCA's query/key path for XLA:CPU (spec §2.3 steps 2-6, zaya_jax/model/cca.py), forward and
// backward, as one custom call per direction: from the raw projections z = [q0 || k0] (batch, seq,
// C = (nq + nk) d) to the attention's q (batch, seq, nq, d) and k (batch, seq, nk, d):
//   stage 1  s1[t] = dw_bias + sum_j dw_kernel[j] * z[t - (k0-1-j)]        (zero before the document)
//   stage 2  s2[t] = g_bias + sum_j P_j[t] @ g_kernel[j]  per head group    (P_j[t] = s1[t - (k1-1-j)],
//                                                                           dw_bias before the document)
//   "mean" residuals: q_res[h] = (q0[h] + k0[h / groups]) / 2, k_res[kh] = mean of its group's q_res
//   q = rope(l2(s2_q + q_res) * sqrt(d)), k = rope(l2(s2_k + k_res) * sqrt(d) * temp[kh])
// with l2(x) = x / sqrt(max(|x|^2, eps^2)) (eps: float32's) and partial NeoX RoPE from the given cos
// and sin tables (batch, seq, rd). A document starts where the segment id changes.
//
// Why a custom call: in XLA:CPU these steps are some forty small operations per layer (shifts,
// selects, 32 x 32 grouped products, reductions, concatenations) run one after another at a few ns per
// element; at the `tiny` preset they took 30 of the 123 ms of a forward and backward pass. Here
// one pass over each chunk of rows does them all while the rows are in cache.
//
// Work items are (batch row, chunk of kChunk positions); a chunk recomputes the few positions before
// it that its convolution reads (and, in the backward, the few after it whose gradients reach it).
// The forward also returns the heads before normalisation (batch, seq, C), which the backward reads;
// it recomputes the rest it needs (stage 1 and the taps) from the inputs.
// Parameter gradients are summed per lane (a fixed share of the items, in order) and the lanes in
// order, so a gradient does not depend on the threads' timing. float32 only.
//
// Registered from Python as zaya_cca_qk_fwd / zaya_cca_qk_bwd on "cpu" (zaya_jax/ops/cca_cpu.py).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "zaya_parallel.h"
#include "zaya_simd.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kChunk = 64;
constexpr float kEps2 = std::numeric_limits<float>::epsilon() * std::numeric_limits<float>::epsilon();

using zaya::mac;

struct Dims {
  int64_t batch, seq, nq, nk, d, c, heads, k0, k1, rd;  // heads = nq + nk, c = heads * d
  int64_t chunks() const { return (seq + kChunk - 1) / kChunk; }
  int64_t param_size() const { return k0 * c + c + k1 * heads * d * d + c + nk; }
};

struct Inputs {
  const float *z, *dw_kernel, *dw_bias, *g_kernel, *g_bias, *temp, *cos, *sin;
  const int32_t* seg;  // (batch, seq)
};

// Position t - shift exists and is in t's document (seg: one batch row's ids).
ZAYA_INLINE bool keep(const int32_t* seg, int64_t t, int64_t shift) {
  return t >= shift && (shift == 0 || seg[t - shift] == seg[t]);
}

// y = x * scale / sqrt(max(|x|^2, eps^2)) over n floats; returns the factor.
ZAYA_INLINE float l2_factor(const float* x, int64_t n, float scale) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  return scale / std::sqrt(std::max(ss, kEps2));
}

// out = rope(y) for one head: pairs (i, i + rd/2) of dims [0, rd) rotated, the rest copied.
ZAYA_INLINE void rope(const float* y, const float* cs, const float* sn, int64_t rd, int64_t d, float* out) {
  const int64_t half = rd / 2;
  for (int64_t i = 0; i < half; ++i) {
    out[i] = y[i] * cs[i] + (-y[i + half]) * sn[i];
    out[i + half] = y[i + half] * cs[i + half] + y[i] * sn[i + half];
  }
  for (int64_t i = rd; i < d; ++i) out[i] = y[i];
}

// dy = rope's transpose applied to g.
ZAYA_INLINE void rope_transpose(const float* g, const float* cs, const float* sn, int64_t rd, int64_t d, float* dy) {
  const int64_t half = rd / 2;
  for (int64_t i = 0; i < half; ++i) {
    dy[i] = g[i] * cs[i] + g[i + half] * sn[i + half];
    dy[i + half] = g[i + half] * cs[i + half] - g[i] * sn[i];
  }
  for (int64_t i = rd; i < d; ++i) dy[i] = g[i];
}

struct Kernel {
  Dims d;
  Inputs in;
  std::vector<float> g_kernel_t;  // (k1, heads, d_out, d_in): the backward's transposed taps

  int64_t groups() const { return d.nq / d.nk; }

  // Stage 1 of batch row b at positions [from, to) into out ((to - from) x c).
  ZAYA_INLINE void stage1(int64_t b, int64_t from, int64_t to, float* out) const {
    const int32_t* seg = in.seg + b * d.seq;
    for (int64_t t = from; t < to; ++t) {
      float* row = out + (t - from) * d.c;
      std::memcpy(row, in.dw_bias, d.c * sizeof(float));
      for (int64_t j = 0; j < d.k0; ++j) {
        const int64_t shift = d.k0 - 1 - j;
        if (!keep(seg, t, shift)) continue;
        const float* w = in.dw_kernel + j * d.c;
        const float* x = in.z + (b * d.seq + t - shift) * d.c;
#pragma omp simd
        for (int64_t c = 0; c < d.c; ++c) row[c] += w[c] * x[c];
      }
    }
  }

  // The stage-2 inputs P_j of positions [t0, t1) (rows of (t1 - t0) x c per tap, taps after each
  // other in p) from stage 1 of positions [s0, ...) in s1.
  ZAYA_INLINE void taps(int64_t b, int64_t t0, int64_t t1, const float* s1, int64_t s0, float* p) const {
    const int32_t* seg = in.seg + b * d.seq;
    const int64_t n = t1 - t0;
    for (int64_t j = 0; j < d.k1; ++j) {
      const int64_t shift = d.k1 - 1 - j;
      for (int64_t t = t0; t < t1; ++t) {
        const float* from = keep(seg, t, shift) ? s1 + (t - shift - s0) * d.c : in.dw_bias;
        std::memcpy(p + (j * n + t - t0) * d.c, from, d.c * sizeof(float));
      }
    }
  }

  // Stage 2 of n positions from their taps p: s2 (n x c).
  ZAYA_INLINE void stage2(const float* p, int64_t n, float* s2) const {
    for (int64_t r = 0; r < n; ++r) std::memcpy(s2 + r * d.c, in.g_bias, d.c * sizeof(float));
    for (int64_t j = 0; j < d.k1; ++j)
      for (int64_t g = 0; g < d.heads; ++g)
        mac(s2 + g * d.d, d.c, p + j * n * d.c + g * d.d, d.c, 1, in.g_kernel + (j * d.heads + g) * d.d * d.d, d.d,
            n, d.d, d.d);
  }

  // The pre-normalisation q and k heads of one position (pre: c floats, q heads then k heads)
  // from its stage-2 row and raw projections.
  ZAYA_INLINE void pre_norm(const float* s2, const float* z, float* pre) const {
    const int64_t g = groups(), w = d.d;
    for (int64_t h = 0; h < d.nq; ++h)
      for (int64_t i = 0; i < w; ++i)
        pre[h * w + i] = s2[h * w + i] + (z[h * w + i] + z[(d.nq + h / g) * w + i]) * 0.5f;
    for (int64_t kh = 0; kh < d.nk; ++kh)
      for (int64_t i = 0; i < w; ++i) {
        float sum = 0.f;
        for (int64_t m = 0; m < g; ++m) sum += (z[(kh * g + m) * w + i] + z[(d.nq + kh) * w + i]) * 0.5f;
        pre[(d.nq + kh) * w + i] = s2[(d.nq + kh) * w + i] + sum / static_cast<float>(g);
      }
  }
};

// One item's forward: q, k and the heads before normalisation (pre_out, batch x seq x c) of its positions.
ZAYA_CLONES void forward_item(const Kernel& kern, int64_t index, float* q, float* k, float* pre_out) {
  const Dims& d = kern.d;
  const Inputs& in = kern.in;
  const int64_t b = index / d.chunks(), t0 = (index % d.chunks()) * kChunk, t1 = std::min(d.seq, t0 + kChunk);
  const int64_t s0 = std::max<int64_t>(0, t0 - (d.k1 - 1)), n = t1 - t0, w = d.d;
  const float scale = std::sqrt(static_cast<float>(w));
  std::vector<float> s1((t1 - s0) * d.c), p(d.k1 * n * d.c), s2(n * d.c), y(w);
  kern.stage1(b, s0, t1, s1.data());
  kern.taps(b, t0, t1, s1.data(), s0, p.data());
  kern.stage2(p.data(), n, s2.data());
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t row = b * d.seq + t;
    float* pre = pre_out + row * d.c;
    kern.pre_norm(s2.data() + (t - t0) * d.c, in.z + row * d.c, pre);
    const float *cs = in.cos + row * d.rd, *sn = in.sin + row * d.rd;
    for (int64_t h = 0; h < d.heads; ++h) {
      const float* x = pre + h * w;
      const float f = l2_factor(x, w, scale);
      const bool key = h >= d.nq;
      for (int64_t i = 0; i < w; ++i) y[i] = key ? (x[i] * f) * in.temp[h - d.nq] : x[i] * f;
      rope(y.data(), cs, sn, d.rd, w, key ? k + (row * d.nk + h - d.nq) * w : q + (row * d.nq + h) * w);
    }
  }
}

// One item's backward: dz of its positions written; its parameter gradients added to params
// (dw_kernel, dw_bias, g_kernel, g_bias, temp; Dims::param_size floats).
ZAYA_CLONES void backward_item(const Kernel& kern, int64_t index, const float* pre_in, const float* dq,
                               const float* dk, float* dz, float* params) {
  const Dims& d = kern.d;
  const Inputs& in = kern.in;
  const int64_t b = index / d.chunks(), t0 = (index % d.chunks()) * kChunk, t1 = std::min(d.seq, t0 + kChunk);
  const int64_t p0 = d.k0 - 1, p1 = d.k1 - 1, w = d.d, c = d.c, g = kern.groups();
  const int64_t e1 = std::min(d.seq, t1 + p0 + p1);  // stage-2 rows whose gradients reach the chunk
  const int64_t f1 = std::min(d.seq, t1 + p0);       // stage-1 rows whose gradients reach it
  const int64_t s0 = std::max<int64_t>(0, t0 - p1), n = e1 - t0, own = t1 - t0;
  const float scale = std::sqrt(static_cast<float>(w));
  const int32_t* seg = in.seg + b * d.seq;
  float* d_dw_kernel = params;
  float* d_dw_bias = d_dw_kernel + d.k0 * c;
  float* d_g_kernel = d_dw_bias + c;
  float* d_g_bias = d_g_kernel + d.k1 * d.heads * w * w;
  float* d_temp = d_g_bias + c;

  std::vector<float> s1((e1 - s0) * c), p(d.k1 * n * c), ds2(n * c), dp(d.k1 * n * c, 0.f),
      ds1((f1 - t0) * c, 0.f), gy(w), dres(d.heads * w);
  kern.stage1(b, s0, e1, s1.data());
  kern.taps(b, t0, e1, s1.data(), s0, p.data());

  // Normalisation, temperature and RoPE backward: ds2 for rows [t0, e1), the residual part of dz
  // and the temperature's gradient for the chunk's own rows.
  for (int64_t t = t0; t < e1; ++t) {
    const int64_t row = b * d.seq + t, r = t - t0;
    const float* pre = pre_in + row * c;  // the forward's pre-normalisation heads
    const float *cs = in.cos + row * d.rd, *sn = in.sin + row * d.rd;
    float* out = ds2.data() + r * c;
    for (int64_t h = 0; h < d.heads; ++h) {
      const float* x = pre + h * w;
      const bool key = h >= d.nq;
      const float* grad = key ? dk + (row * d.nk + h - d.nq) * w : dq + (row * d.nq + h) * w;
      rope_transpose(grad, cs, sn, d.rd, w, gy.data());
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < w; ++i) ss += x[i] * x[i];
      const float f = scale / std::sqrt(std::max(ss, kEps2));
      if (key) {
        const float temp = in.temp[h - d.nq];
        if (t < t1) {
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t i = 0; i < w; ++i) s += gy[i] * (x[i] * f);
          d_temp[h - d.nq] += s;
        }
        for (int64_t i = 0; i < w; ++i) gy[i] *= temp;
      }
      // y = x f with f = scale / |x| (above eps): dx = f (gy - x <x, gy> / |x|^2)
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < w; ++i) dot += x[i] * gy[i];
      const float k_ = ss > kEps2 ? dot / ss : 0.f;
      for (int64_t i = 0; i < w; ++i) out[h * w + i] = f * (gy[i] - x[i] * k_);
    }
    if (t >= t1) continue;
    // the mean residuals: q_res[h] feeds pre_q[h] and (1/g of) pre_k[h / g]
    float* dzr = dz + row * c;
    for (int64_t h = 0; h < d.nq; ++h)
      for (int64_t i = 0; i < w; ++i)
        dres[h * w + i] = out[h * w + i] + out[(d.nq + h / g) * w + i] / static_cast<float>(g);
    for (int64_t h = 0; h < d.nq; ++h)
      for (int64_t i = 0; i < w; ++i) dzr[h * w + i] = dres[h * w + i] * 0.5f;
    for (int64_t kh = 0; kh < d.nk; ++kh)
      for (int64_t i = 0; i < w; ++i) {
        float s = 0.f;
        for (int64_t m = 0; m < g; ++m) s += dres[(kh * g + m) * w + i];
        dzr[(d.nq + kh) * w + i] = s * 0.5f;
      }
  }

  // Stage 2 backward: its bias and kernel (own rows), and the taps' gradients (all n rows).
  for (int64_t r = 0; r < own; ++r)
    for (int64_t i = 0; i < c; ++i) d_g_bias[i] += ds2[r * c + i];
  for (int64_t j = 0; j < d.k1; ++j)
    for (int64_t h = 0; h < d.heads; ++h) {
      mac(d_g_kernel + (j * d.heads + h) * w * w, w, p.data() + j * n * c + h * w, 1, c, ds2.data() + h * w, c, w,
          own, w);
      mac(dp.data() + j * n * c + h * w, c, ds2.data() + h * w, c, 1, kern.g_kernel_t.data() + (j * d.heads + h) * w * w,
          w, n, w, w);
    }
  // ... into stage 1's rows [t0, f1) (a tap that read the bias before a document start: the bias).
  for (int64_t j = 0; j < d.k1; ++j) {
    const int64_t shift = d.k1 - 1 - j;
    for (int64_t t = t0; t < e1; ++t) {
      const float* from = dp.data() + (j * n + t - t0) * c;
      if (keep(seg, t, shift)) {
        if (t - shift >= t0 && t - shift < f1) {  // earlier rows are the previous chunk's
          float* to = ds1.data() + (t - shift - t0) * c;
#pragma omp simd
          for (int64_t i = 0; i < c; ++i) to[i] += from[i];
        }
      } else if (t < t1) {
        for (int64_t i = 0; i < c; ++i) d_dw_bias[i] += from[i];
      }
    }
  }
  // Stage 1 backward: its bias and kernel (own rows), and z.
  for (int64_t t = t0; t < t1; ++t) {
    const float* g1 = ds1.data() + (t - t0) * c;
    for (int64_t i = 0; i < c; ++i) d_dw_bias[i] += g1[i];
    for (int64_t j = 0; j < d.k0; ++j) {
      const int64_t shift = d.k0 - 1 - j;
      if (!keep(seg, t, shift)) continue;
      const float* x = in.z + (b * d.seq + t - shift) * c;
      float* dw = d_dw_kernel + j * c;
#pragma omp simd
      for (int64_t i = 0; i < c; ++i) dw[i] += g1[i] * x[i];
    }
    float* dzr = dz + (b * d.seq + t) * c;
    for (int64_t j = 0; j < d.k0; ++j) {
      const int64_t shift = d.k0 - 1 - j;
      if (t + shift >= d.seq || !keep(seg, t + shift, shift)) continue;
      const float* g1s = ds1.data() + (t + shift - t0) * c;
      const float* wj = in.dw_kernel + j * c;
#pragma omp simd
      for (int64_t i = 0; i < c; ++i) dzr[i] += g1s[i] * wj[i];
    }
  }
}

ffi::Error dims_of(const ffi::Buffer<ffi::F32>& z, const ffi::Buffer<ffi::F32>& dw_kernel,
                   const ffi::Buffer<ffi::F32>& dw_bias, const ffi::Buffer<ffi::F32>& g_kernel,
                   const ffi::Buffer<ffi::F32>& g_bias, const ffi::Buffer<ffi::F32>& temp,
                   const ffi::Buffer<ffi::F32>& cos, const ffi::Buffer<ffi::F32>& sin,
                   const ffi::Buffer<ffi::S32>& seg, int64_t nq, int64_t nk, Dims& d) {
  auto zd = z.dimensions(), wd = dw_kernel.dimensions(), gd = g_kernel.dimensions(), cd = cos.dimensions();
  if (zd.size() != 3 || wd.size() != 2 || gd.size() != 4 || cd.size() != 3)
    return ffi::Error::InvalidArgument(
        "zaya_cca_qk: z (batch, seq, C), dw_kernel (k0, C), g_kernel (k1, heads, d, d), cos/sin (batch, seq, rd)");
  d = Dims{zd[0], zd[1], nq, nk, gd[2], zd[2], gd[1], wd[0], gd[0], cd[2]};
  if (nq < 1 || nk < 1 || nq % nk || d.heads != nq + nk || gd[3] != d.d || d.c != d.heads * d.d || wd[1] != d.c)
    return ffi::Error::InvalidArgument("zaya_cca_qk: needs C = (nq + nk) d, g_kernel (k1, nq + nk, d, d), nk | nq");
  if (dw_bias.element_count() != static_cast<size_t>(d.c) || g_bias.element_count() != static_cast<size_t>(d.c) ||
      temp.element_count() != static_cast<size_t>(nk))
    return ffi::Error::InvalidArgument("zaya_cca_qk: the biases must have C elements and temp nk");
  if (cd[0] != d.batch || cd[1] != d.seq || d.rd > d.d || d.rd % 2 || sin.dimensions().size() != 3 ||
      sin.element_count() != cos.element_count() || seg.element_count() != static_cast<size_t>(d.batch * d.seq))
    return ffi::Error::InvalidArgument(
        "zaya_cca_qk: cos and sin (batch, seq, rd) with an even rd <= d, segment ids (batch, seq)");
  if (d.k0 < 1 || d.k1 < 1) return ffi::Error::InvalidArgument("zaya_cca_qk: both convolutions need a tap");
  return ffi::Error::Success();
}

Inputs inputs_of(const ffi::Buffer<ffi::F32>& z, const ffi::Buffer<ffi::F32>& dw_kernel,
                 const ffi::Buffer<ffi::F32>& dw_bias, const ffi::Buffer<ffi::F32>& g_kernel,
                 const ffi::Buffer<ffi::F32>& g_bias, const ffi::Buffer<ffi::F32>& temp,
                 const ffi::Buffer<ffi::F32>& cos, const ffi::Buffer<ffi::F32>& sin, const ffi::Buffer<ffi::S32>& seg) {
  return Inputs{z.typed_data(),      dw_kernel.typed_data(), dw_bias.typed_data(), g_kernel.typed_data(),
                g_bias.typed_data(), temp.typed_data(),      cos.typed_data(),     sin.typed_data(),
                seg.typed_data()};
}

using F32 = ffi::Buffer<ffi::F32>;

ffi::Error CcaQkFwdImpl(ffi::ThreadPool pool, int64_t nq, int64_t nk, F32 z, F32 dw_kernel, F32 dw_bias, F32 g_kernel,
                        F32 g_bias, F32 temp, F32 cos, F32 sin, ffi::Buffer<ffi::S32> seg, ffi::Result<F32> q,
                        ffi::Result<F32> k, ffi::Result<F32> pre) {
  Kernel kern;
  if (auto err = dims_of(z, dw_kernel, dw_bias, g_kernel, g_bias, temp, cos, sin, seg, nq, nk, kern.d); err.failure())
    return err;
  kern.in = inputs_of(z, dw_kernel, dw_bias, g_kernel, g_bias, temp, cos, sin, seg);
  const int64_t items = kern.d.batch * kern.d.chunks();
  float *qo = q->typed_data(), *ko = k->typed_data(), *po = pre->typed_data();
  zaya::parallel_items(pool, items, zaya::worker_count(pool, items, 1),
                       [&](int64_t i, int) { forward_item(kern, i, qo, ko, po); });
  return ffi::Error::Success();
}

ffi::Error CcaQkBwdImpl(ffi::ThreadPool pool, int64_t nq, int64_t nk, F32 z, F32 dw_kernel, F32 dw_bias, F32 g_kernel,
                        F32 g_bias, F32 temp, F32 cos, F32 sin, ffi::Buffer<ffi::S32> seg, F32 pre, F32 dq, F32 dk,
                        ffi::Result<F32> dz, ffi::Result<F32> d_dw_kernel, ffi::Result<F32> d_dw_bias,
                        ffi::Result<F32> d_g_kernel, ffi::Result<F32> d_g_bias, ffi::Result<F32> d_temp) {
  Kernel kern;
  if (auto err = dims_of(z, dw_kernel, dw_bias, g_kernel, g_bias, temp, cos, sin, seg, nq, nk, kern.d); err.failure())
    return err;
  const Dims& d = kern.d;
  if (pre.element_count() != static_cast<size_t>(d.batch * d.seq * d.c) ||
      dq.element_count() != static_cast<size_t>(d.batch * d.seq * nq * d.d) ||
      dk.element_count() != static_cast<size_t>(d.batch * d.seq * nk * d.d))
    return ffi::Error::InvalidArgument("zaya_cca_qk_bwd: pre must be shaped like z, dq and dk like q and k");
  kern.in = inputs_of(z, dw_kernel, dw_bias, g_kernel, g_bias, temp, cos, sin, seg);
  const int64_t w = d.d;
  kern.g_kernel_t.resize(d.k1 * d.heads * w * w);
  for (int64_t m = 0; m < d.k1 * d.heads; ++m)
    for (int64_t i = 0; i < w; ++i)
      for (int64_t o = 0; o < w; ++o) kern.g_kernel_t[(m * w + o) * w + i] = kern.in.g_kernel[(m * w + i) * w + o];

  const int64_t items = d.batch * d.chunks(), size = d.param_size();
  const int lanes = static_cast<int>(std::min<int64_t>(items, 2 * zaya::worker_count(pool, items, 1)));
  std::vector<float> parts(static_cast<size_t>(lanes) * size, 0.f);
  const float *dqp = dq.typed_data(), *dkp = dk.typed_data(), *prep = pre.typed_data();
  float* dzp = dz->typed_data();
  zaya::parallel_items(pool, lanes, zaya::worker_count(pool, lanes, 1), [&](int64_t lane, int) {
    for (int64_t i = lane; i < items; i += lanes) backward_item(kern, i, prep, dqp, dkp, dzp, parts.data() + lane * size);
  });
  for (int lane = 1; lane < lanes; ++lane)
    for (int64_t e = 0; e < size; ++e) parts[e] += parts[static_cast<size_t>(lane) * size + e];
  const float* sum = parts.data();
  const int64_t sizes[5] = {d.k0 * d.c, d.c, d.k1 * d.heads * w * w, d.c, d.nk};
  float* outs[5] = {d_dw_kernel->typed_data(), d_dw_bias->typed_data(), d_g_kernel->typed_data(),
                    d_g_bias->typed_data(), d_temp->typed_data()};
  for (int o = 0; o < 5; ++o) {
    std::memcpy(outs[o], sum, sizes[o] * sizeof(float));
    sum += sizes[o];
  }
  return ffi::Error::Success();
}

}  // namespace

static auto bind_inputs() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Attr<int64_t>("nq")
      .Attr<int64_t>("nk")
      .Arg<F32>()  // z
      .Arg<F32>()  // dw_kernel
      .Arg<F32>()  // dw_bias
      .Arg<F32>()  // g_kernel
      .Arg<F32>()  // g_bias
      .Arg<F32>()  // temp
      .Arg<F32>()  // cos
      .Arg<F32>()  // sin
      .Arg<ffi::Buffer<ffi::S32>>();  // segment ids
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZayaCcaQkFwd, CcaQkFwdImpl, bind_inputs().Ret<F32>().Ret<F32>().Ret<F32>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZayaCcaQkBwd, CcaQkBwdImpl,
                              bind_inputs()
                                  .Arg<F32>()  // the forward's pre-normalisation heads (batch, seq, C)
                                  .Arg<F32>()  // dq
                                  .Arg<F32>()  // dk
                                  .Ret<F32>()
                                  .Ret<F32>()
                                  .Ret<F32>()
                                  .Ret<F32>()
                                  .Ret<F32>()
                                  .Ret<F32>());
