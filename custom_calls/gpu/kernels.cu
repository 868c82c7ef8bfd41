// GPU handlers, one source for CUDA (nvcc, sm_90) and HIP (hipcc, gfx942/gfx90a) through vendor.h:
// fused residual scaling + RMSNorm forward/backward and the batched Newton-Schulz iteration.
// Same FFI signatures and results as the CPU twin (custom_calls/cpu/kernels_cpu.cc).

#include <cmath>
#include <cstdint>

#include "vendor.h"
#include "xla/ffi/api/ffi.h"
#include "zaya_math.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kThreads = 256;  // a multiple of both the 32-wide warp and the 64-wide wavefront
constexpr int kTile = 16;      // 16 x 16 = 256 threads per matmul tile
constexpr int kRowsPerBlock = 16;

// Sum of ``value`` over the block (blockDim.x == kThreads), through shared memory.
__device__ float block_sum(float value, float* scratch) {
  scratch[threadIdx.x] = value;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) scratch[threadIdx.x] += scratch[threadIdx.x + stride];
    __syncthreads();
  }
  const float total = scratch[0];
  __syncthreads();
  return total;
}

template <typename T>
__global__ void norm_forward_kernel(const T* f, const float* h, const float* params, float eps, int64_t width,
                                    int64_t per_group, float* h_out, T* y) {
  __shared__ float scratch[kThreads];
  const int64_t r = blockIdx.x, o = r * width;
  const float* p = params + (r / per_group) * zaya::kNumParams * width;
  float ss = 0.f;
  for (int64_t j = threadIdx.x; j < width; j += kThreads) {
    const float x = zaya::residual_update<T>(zaya::Elem<T>::load(f, o + j), h[o + j], p, width, j);
    h_out[o + j] = x;
    const float xr = zaya::Elem<T>::round(x);
    ss += xr * xr;
  }
  const float inv = rsqrtf(block_sum(ss, scratch) / static_cast<float>(width) + eps);
  for (int64_t j = threadIdx.x; j < width; j += kThreads) {
    const float n = zaya::Elem<T>::round(zaya::Elem<T>::round(h_out[o + j]) * inv);
    zaya::Elem<T>::store(y, o + j, p[zaya::kNormWeight * width + j] * n);
  }
}

// Each block handles kRowsPerBlock rows: per-row scalars first, then per column the gradients of
// those rows, accumulating the parameter gradients in registers and adding them once per block.
template <typename T>
__global__ void norm_backward_kernel(const T* f, const float* h, const float* params, const float* dh_out,
                                     const T* dy, float eps, int64_t rows, int64_t width, int64_t per_group,
                                     T* df, float* dh, float* dparams) {
  using E = zaya::Elem<T>;
  __shared__ float scratch[kThreads];
  __shared__ float inv_s[kRowsPerBlock], k_s[kRowsPerBlock];
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock;
  const int count = static_cast<int>(min(static_cast<int64_t>(kRowsPerBlock), rows - first));
  for (int i = 0; i < count; ++i) {
    const int64_t r = first + i, o = r * width;
    const float* p = params + (r / per_group) * zaya::kNumParams * width;
    float ss = 0.f;
    for (int64_t j = threadIdx.x; j < width; j += kThreads) {
      const float xr = E::round(zaya::residual_update<T>(E::load(f, o + j), h[o + j], p, width, j));
      ss += xr * xr;
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / static_cast<float>(width) + eps);
    float dot = 0.f;
    for (int64_t j = threadIdx.x; j < width; j += kThreads) {
      const float xr = E::round(zaya::residual_update<T>(E::load(f, o + j), h[o + j], p, width, j));
      dot += E::round(E::load(dy, o + j) * p[zaya::kNormWeight * width + j]) * xr;
    }
    const float total = block_sum(dot, scratch);
    if (threadIdx.x == 0) {
      inv_s[i] = inv;
      k_s[i] = inv * inv * inv * total / static_cast<float>(width);
    }
  }
  __syncthreads();
  for (int64_t j = threadIdx.x; j < width; j += kThreads) {
    float acc[zaya::kNumParams] = {0.f, 0.f, 0.f, 0.f, 0.f};
    int64_t group = first / per_group;
    for (int i = 0; i < count; ++i) {
      const int64_t r = first + i, o = r * width;
      if (r / per_group != group) {  // flush when the rows cross into the next parameter group
        for (int q = 0; q < zaya::kNumParams; ++q) {
          atomicAdd(dparams + (group * zaya::kNumParams + q) * width + j, acc[q]);
          acc[q] = 0.f;
        }
        group = r / per_group;
      }
      const float* p = params + group * zaya::kNumParams * width;
      const float xr = E::round(zaya::residual_update<T>(E::load(f, o + j), h[o + j], p, width, j));
      const float g_y = E::load(dy, o + j);
      acc[zaya::kNormWeight] += g_y * E::round(xr * inv_s[i]);
      const float dn = E::round(g_y * p[zaya::kNormWeight * width + j]);
      const float dx = dh_out[o + j] + E::round(inv_s[i] * dn - k_s[i] * xr);
      const float rs = p[zaya::kResidualScale * width + j];
      dh[o + j] = dx * rs;
      acc[zaya::kResidualBias] += dx * rs;
      acc[zaya::kResidualScale] += dx * (h[o + j] + p[zaya::kResidualBias * width + j]);
      const float db = E::round(dx);
      const float fb = E::round(E::load(f, o + j) + p[zaya::kHiddenBias * width + j]);
      const float dsum = E::round(db * p[zaya::kHiddenScale * width + j]);
      acc[zaya::kHiddenScale] += E::round(db * fb);
      acc[zaya::kHiddenBias] += dsum;
      E::store(df, o + j, dsum);
    }
    for (int q = 0; q < zaya::kNumParams; ++q) atomicAdd(dparams + (group * zaya::kNumParams + q) * width + j, acc[q]);
  }
}

// out[i][j] = beta * sum_k P[i][k] P[j][k] + alpha * Q[i][j] for an (m x k) P: the product with
// its own transpose, symmetric, so only tiles on or above the diagonal are computed and mirrored.
__global__ void gram_kernel(const float* p, const float* q, int64_t m, int64_t k, float alpha, float beta,
                            float* out) {
  if (blockIdx.x < blockIdx.y) return;  // below the diagonal: written by the mirrored tile
  const int64_t batch = blockIdx.z;
  p += batch * m * k;
  out += batch * m * m;
  if (q) q += batch * m * m;
  __shared__ float a[kTile][kTile + 1], b[kTile][kTile + 1];
  const int tx = threadIdx.x % kTile, ty = threadIdx.x / kTile;
  const int64_t row = static_cast<int64_t>(blockIdx.y) * kTile + ty;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kTile + tx;
  const int64_t col_row = static_cast<int64_t>(blockIdx.x) * kTile + ty;  // rows of P loaded for the columns
  float sum = 0.f;
  for (int64_t t = 0; t < k; t += kTile) {
    a[ty][tx] = (row < m && t + tx < k) ? p[row * k + t + tx] : 0.f;
    b[ty][tx] = (col_row < m && t + tx < k) ? p[col_row * k + t + tx] : 0.f;
    __syncthreads();
    for (int s = 0; s < kTile; ++s) sum += a[ty][s] * b[tx][s];
    __syncthreads();
  }
  if (row < m && col < m && col >= row) {
    const float v = beta * sum + (q ? alpha * q[row * m + col] : 0.f);
    out[row * m + col] = v;
    out[col * m + row] = v;
  }
}

// next = a * x + poly @ x for (m x m) poly and (m x n) x.
__global__ void update_kernel(const float* poly, const float* x, int64_t m, int64_t n, float a, float* next) {
  const int64_t batch = blockIdx.z;
  poly += batch * m * m;
  x += batch * m * n;
  next += batch * m * n;
  __shared__ float ps[kTile][kTile + 1], xs[kTile][kTile + 1];
  const int tx = threadIdx.x % kTile, ty = threadIdx.x / kTile;
  const int64_t row = static_cast<int64_t>(blockIdx.y) * kTile + ty;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kTile + tx;
  float sum = 0.f;
  for (int64_t t = 0; t < m; t += kTile) {
    ps[ty][tx] = (row < m && t + tx < m) ? poly[row * m + t + tx] : 0.f;
    xs[ty][tx] = (t + ty < m && col < n) ? x[(t + ty) * n + col] : 0.f;
    __syncthreads();
    for (int s = 0; s < kTile; ++s) sum += ps[ty][s] * xs[s][tx];
    __syncthreads();
  }
  if (row < m && col < n) next[row * n + col] = a * x[row * n + col] + sum;
}

ffi::Error launched() {
  const gpuError_t err = gpuGetLastError();
  if (err != gpuSuccess) return ffi::Error::Internal(gpuGetErrorString(err));
  return ffi::Error::Success();
}

template <typename X, typename P>
ffi::Error norm_shape(const X& x, const P& params, int64_t& rows, int64_t& width, int64_t& groups) {
  auto xd = x.dimensions();
  auto pd = params.dimensions();
  if (xd.size() < 1 || pd.size() < 2) return ffi::Error::InvalidArgument("x needs rank >= 1, params rank >= 2");
  width = xd.back();
  rows = width ? static_cast<int64_t>(x.element_count()) / width : 0;
  if (pd.back() != width || pd[pd.size() - 2] != zaya::kNumParams)
    return ffi::Error::InvalidArgument("params must have shape (..., 5, H) with H = x.shape[-1]");
  groups = static_cast<int64_t>(params.element_count()) / (zaya::kNumParams * width);
  if (groups < 1 || rows % groups)
    return ffi::Error::InvalidArgument("the rows of x must split evenly into the parameter groups");
  return ffi::Error::Success();
}

ffi::Error ResidualRmsNormFwdImpl(gpuStream_t stream, float eps, ffi::AnyBuffer f, ffi::Buffer<ffi::F32> h,
                                  ffi::Buffer<ffi::F32> params, ffi::Result<ffi::Buffer<ffi::F32>> h_out,
                                  ffi::Result<ffi::AnyBuffer> y) {
  int64_t rows, width, groups;
  if (auto err = norm_shape(f, params, rows, width, groups); err.failure()) return err;
  if (rows == 0) return ffi::Error::Success();
  const int64_t per_group = rows / groups;
  switch (f.element_type()) {
    case ffi::F32:
      norm_forward_kernel<float><<<rows, kThreads, 0, stream>>>(f.typed_data<float>(), h.typed_data(),
                                                                params.typed_data(), eps, width, per_group,
                                                                h_out->typed_data(), y->typed_data<float>());
      return launched();
    case ffi::BF16:
      norm_forward_kernel<uint16_t><<<rows, kThreads, 0, stream>>>(
          f.reinterpret_data<uint16_t>(), h.typed_data(), params.typed_data(), eps, width, per_group,
          h_out->typed_data(), y->reinterpret_data<uint16_t>());
      return launched();
    default:
      return ffi::Error::InvalidArgument("zaya_residual_rms_norm supports float32 and bfloat16");
  }
}

ffi::Error ResidualRmsNormBwdImpl(gpuStream_t stream, float eps, ffi::AnyBuffer f, ffi::Buffer<ffi::F32> h,
                                  ffi::Buffer<ffi::F32> params, ffi::Buffer<ffi::F32> dh_out, ffi::AnyBuffer dy,
                                  ffi::Result<ffi::AnyBuffer> df, ffi::Result<ffi::Buffer<ffi::F32>> dh,
                                  ffi::Result<ffi::Buffer<ffi::F32>> dparams) {
  int64_t rows, width, groups;
  if (auto err = norm_shape(f, params, rows, width, groups); err.failure()) return err;
  gpuMemsetAsync(dparams->typed_data(), 0, dparams->size_bytes(), stream);
  if (rows == 0) return launched();
  const int64_t per_group = rows / groups;
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  switch (f.element_type()) {
    case ffi::F32:
      norm_backward_kernel<float><<<blocks, kThreads, 0, stream>>>(
          f.typed_data<float>(), h.typed_data(), params.typed_data(), dh_out.typed_data(), dy.typed_data<float>(),
          eps, rows, width, per_group, df->typed_data<float>(), dh->typed_data(), dparams->typed_data());
      return launched();
    case ffi::BF16:
      norm_backward_kernel<uint16_t><<<blocks, kThreads, 0, stream>>>(
          f.reinterpret_data<uint16_t>(), h.typed_data(), params.typed_data(), dh_out.typed_data(),
          dy.reinterpret_data<uint16_t>(), eps, rows, width, per_group, df->reinterpret_data<uint16_t>(),
          dh->typed_data(), dparams->typed_data());
      return launched();
    default:
      return ffi::Error::InvalidArgument("zaya_residual_rms_norm supports float32 and bfloat16");
  }
}

ffi::Error NewtonSchulzImpl(gpuStream_t stream, ffi::ScratchAllocator scratch, int32_t steps, float a, float b,
                            float c, ffi::Buffer<ffi::F32> x, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  auto d = x.dimensions();
  if (d.size() < 2) return ffi::Error::InvalidArgument("zaya_newton_schulz needs (..., m, n) matrices");
  const int64_t m = d[d.size() - 2], n = d.back();
  if (m > n) return ffi::Error::InvalidArgument("zaya_newton_schulz needs m <= n (transpose tall matrices)");
  const int64_t count = m * n ? static_cast<int64_t>(x.element_count()) / (m * n) : 0;
  if (count == 0) return ffi::Error::Success();
  auto gram = scratch.Allocate(sizeof(float) * count * m * m);
  auto poly = scratch.Allocate(sizeof(float) * count * m * m);
  auto next = scratch.Allocate(sizeof(float) * count * m * n);
  if (!gram || !poly || !next) return ffi::Error::Internal("zaya_newton_schulz: no scratch memory");
  float* cur = y->typed_data();
  float* other = static_cast<float*>(*next);
  gpuMemcpyAsync(cur, x.typed_data(), sizeof(float) * count * m * n, gpuMemcpyDeviceToDevice, stream);
  const dim3 square((m + kTile - 1) / kTile, (m + kTile - 1) / kTile, count);
  const dim3 wide((n + kTile - 1) / kTile, (m + kTile - 1) / kTile, count);
  for (int s = 0; s < steps; ++s) {
    gram_kernel<<<square, kTile * kTile, 0, stream>>>(cur, nullptr, m, n, 0.f, 1.f, static_cast<float*>(*gram));
    gram_kernel<<<square, kTile * kTile, 0, stream>>>(static_cast<float*>(*gram), static_cast<float*>(*gram), m,
                                                      m, b, c, static_cast<float*>(*poly));
    update_kernel<<<wide, kTile * kTile, 0, stream>>>(static_cast<float*>(*poly), cur, m, n, a, other);
    float* t = cur;
    cur = other;
    other = t;
  }
  if (cur != y->typed_data())
    gpuMemcpyAsync(y->typed_data(), cur, sizeof(float) * count * m * n, gpuMemcpyDeviceToDevice, stream);
  return launched();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZayaResidualRmsNormFwd, ResidualRmsNormFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Attr<float>("eps")
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZayaResidualRmsNormBwd, ResidualRmsNormBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Attr<float>("eps")
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZayaNewtonSchulz, NewtonSchulzImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Attr<int32_t>("steps")
                                  .Attr<float>("a")
                                  .Attr<float>("b")
                                  .Attr<float>("c")
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
