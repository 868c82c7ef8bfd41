// The vendor shim: one kernel source compiles as CUDA (nvcc) or HIP (hipcc, ROCm). Kernels use
// only what both share; nothing assumes a 32-wide warp (AMD CDNA wavefronts are 64 wide), so
// reductions go through shared memory over the whole block.
#pragma once

#if defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__)
#include <hip/hip_runtime.h>
#define ZAYA_GPU_HIP 1
typedef hipStream_t gpuStream_t;
typedef hipError_t gpuError_t;
#define gpuSuccess hipSuccess
#define gpuGetLastError hipGetLastError
#define gpuGetErrorString hipGetErrorString
#define gpuMemsetAsync hipMemsetAsync
#define gpuMemcpyAsync hipMemcpyAsync
#define gpuMemcpyDeviceToDevice hipMemcpyDeviceToDevice
#else
#include <cuda_runtime.h>
#define ZAYA_GPU_CUDA 1
typedef cudaStream_t gpuStream_t;
typedef cudaError_t gpuError_t;
#define gpuSuccess cudaSuccess
#define gpuGetLastError cudaGetLastError
#define gpuGetErrorString cudaGetErrorString
#define gpuMemsetAsync cudaMemsetAsync
#define gpuMemcpyAsync cudaMemcpyAsync
#define gpuMemcpyDeviceToDevice cudaMemcpyDeviceToDevice
#endif
