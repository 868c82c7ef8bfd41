// CPU handlers (the "CPU twin" of the GPU kernels): fused residual scaling + RMSNorm, forward and
// backward, registered from Python as zaya_residual_rms_norm_fwd/_bwd on "cpu". The twin of the
// GPU's zaya_newton_schulz is in newton_schulz_cpu.cc.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "zaya_math.h"

namespace ffi = xla::ffi;

namespace {

struct Shape {
  int64_t rows = 0, width = 0, groups = 0;
};

// x: (..., H) rows; params: (..., 5, H) with G groups; rows are split into G equal consecutive runs.
template <typename X, typename P>
ffi::Error norm_shape(const X& x, const P& params, Shape& s) {
  auto xd = x.dimensions();
  auto pd = params.dimensions();
  if (xd.size() < 1 || pd.size() < 2) return ffi::Error::InvalidArgument("x needs rank >= 1, params rank >= 2");
  s.width = xd.back();
  s.rows = s.width ? static_cast<int64_t>(x.element_count()) / s.width : 0;
  if (pd.back() != s.width || pd[pd.size() - 2] != zaya::kNumParams)
    return ffi::Error::InvalidArgument("params must have shape (..., 5, H) with H = x.shape[-1]");
  s.groups = static_cast<int64_t>(params.element_count()) / (zaya::kNumParams * s.width);
  if (s.groups < 1 || s.rows % s.groups)
    return ffi::Error::InvalidArgument("the rows of x must split evenly into the parameter groups");
  return ffi::Error::Success();
}

template <typename T>
void norm_forward(const T* f, const float* h, const float* params, float eps, Shape s, float* h_out, T* y) {
  const int64_t w = s.width, per_group = s.rows / s.groups;
  std::vector<float> xr(w);
  for (int64_t r = 0; r < s.rows; ++r) {
    const float* p = params + (r / per_group) * zaya::kNumParams * w;
    const int64_t o = r * w;
    float ss = 0.f;
    for (int64_t j = 0; j < w; ++j) {
      const float x = zaya::residual_update<T>(zaya::Elem<T>::load(f, o + j), h[o + j], p, w, j);
      h_out[o + j] = x;
      xr[j] = zaya::Elem<T>::round(x);
      ss += xr[j] * xr[j];
    }
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(w) + eps);
    for (int64_t j = 0; j < w; ++j) {
      const float n = zaya::Elem<T>::round(xr[j] * inv);
      zaya::Elem<T>::store(y, o + j, p[zaya::kNormWeight * w + j] * n);
    }
  }
}

template <typename T>
void norm_backward(const T* f, const float* h, const float* params, const float* dh_out, const T* dy,
                   float eps, Shape s, T* df, float* dh, float* dparams) {
  using E = zaya::Elem<T>;
  const int64_t w = s.width, per_group = s.rows / s.groups;
  std::fill(dparams, dparams + s.groups * zaya::kNumParams * w, 0.f);
  std::vector<float> xr(w), dn(w);
  for (int64_t r = 0; r < s.rows; ++r) {
    const int64_t g = r / per_group, o = r * w;
    const float* p = params + g * zaya::kNumParams * w;
    float* dp = dparams + g * zaya::kNumParams * w;
    float ss = 0.f;
    for (int64_t j = 0; j < w; ++j) {
      xr[j] = E::round(zaya::residual_update<T>(E::load(f, o + j), h[o + j], p, w, j));
      ss += xr[j] * xr[j];
    }
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(w) + eps);
    float dot = 0.f;
    for (int64_t j = 0; j < w; ++j) {
      const float g_y = E::load(dy, o + j);
      const float n = E::round(xr[j] * inv);
      dp[zaya::kNormWeight * w + j] += g_y * n;
      dn[j] = E::round(g_y * p[zaya::kNormWeight * w + j]);
      dot += dn[j] * xr[j];
    }
    const float k = inv * inv * inv * dot / static_cast<float>(w);
    for (int64_t j = 0; j < w; ++j) {
      const float dx = dh_out[o + j] + E::round(inv * dn[j] - k * xr[j]);
      // residual = (h + rb) * rs
      const float rs = p[zaya::kResidualScale * w + j];
      dh[o + j] = dx * rs;
      dp[zaya::kResidualBias * w + j] += dx * rs;
      dp[zaya::kResidualScale * w + j] += dx * (h[o + j] + p[zaya::kResidualBias * w + j]);
      // branch = round(round(f + hb) * hs), its cotangent rounded to the compute dtype
      const float db = E::round(dx);
      const float fb = E::round(E::load(f, o + j) + p[zaya::kHiddenBias * w + j]);
      const float dsum = E::round(db * p[zaya::kHiddenScale * w + j]);
      dp[zaya::kHiddenScale * w + j] += E::round(db * fb);
      dp[zaya::kHiddenBias * w + j] += dsum;
      E::store(df, o + j, dsum);
    }
  }
}

ffi::Error ResidualRmsNormFwdImpl(float eps, ffi::AnyBuffer f, ffi::Buffer<ffi::F32> h, ffi::Buffer<ffi::F32> params,
                                  ffi::Result<ffi::Buffer<ffi::F32>> h_out, ffi::Result<ffi::AnyBuffer> y) {
  Shape shape;
  if (auto err = norm_shape(f, params, shape); err.failure()) return err;
  if (h.element_count() != f.element_count() || y->element_type() != f.element_type())
    return ffi::Error::InvalidArgument("h and y must match f in shape, y in dtype");
  switch (f.element_type()) {
    case ffi::F32:
      norm_forward<float>(f.typed_data<float>(), h.typed_data(), params.typed_data(), eps, shape,
                          h_out->typed_data(), y->typed_data<float>());
      return ffi::Error::Success();
    case ffi::BF16:
      norm_forward<uint16_t>(f.reinterpret_data<uint16_t>(), h.typed_data(), params.typed_data(), eps, shape,
                             h_out->typed_data(), y->reinterpret_data<uint16_t>());
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("zaya_residual_rms_norm supports float32 and bfloat16");
  }
}

ffi::Error ResidualRmsNormBwdImpl(float eps, ffi::AnyBuffer f, ffi::Buffer<ffi::F32> h, ffi::Buffer<ffi::F32> params,
                                  ffi::Buffer<ffi::F32> dh_out, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> df,
                                  ffi::Result<ffi::Buffer<ffi::F32>> dh, ffi::Result<ffi::Buffer<ffi::F32>> dparams) {
  Shape shape;
  if (auto err = norm_shape(f, params, shape); err.failure()) return err;
  if (dy.element_type() != f.element_type() || df->element_type() != f.element_type())
    return ffi::Error::InvalidArgument("dy and df must have f's dtype");
  switch (f.element_type()) {
    case ffi::F32:
      norm_backward<float>(f.typed_data<float>(), h.typed_data(), params.typed_data(), dh_out.typed_data(),
                           dy.typed_data<float>(), eps, shape, df->typed_data<float>(), dh->typed_data(),
                           dparams->typed_data());
      return ffi::Error::Success();
    case ffi::BF16:
      norm_backward<uint16_t>(f.reinterpret_data<uint16_t>(), h.typed_data(), params.typed_data(),
                              dh_out.typed_data(), dy.reinterpret_data<uint16_t>(), eps, shape,
                              df->reinterpret_data<uint16_t>(), dh->typed_data(), dparams->typed_data());
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("zaya_residual_rms_norm supports float32 and bfloat16");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZayaResidualRmsNormFwd, ResidualRmsNormFwdImpl,
                              ffi::Ffi::Bind()
                                  .Attr<float>("eps")
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZayaResidualRmsNormBwd, ResidualRmsNormBwdImpl,
                              ffi::Ffi::Bind()
                                  .Attr<float>("eps")
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
