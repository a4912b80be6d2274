// Shared by pipewright's CUDA kernels: loads that widen f32, bf16 and f16 to f32, stores that
// round once (to nearest even, as the CPU twins' `half` conversions), warp and block reductions,
// and the macro that writes one extern "C" entry point per element type (the Rust side loads
// `NAME_f32`, `NAME_bf16` and `NAME_f16` by name).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;
typedef __half f16;

__device__ __forceinline__ float load_f(float x) { return x; }
__device__ __forceinline__ float load_f(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float load_f(f16 x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T store_f(float x);
template <> __device__ __forceinline__ float store_f<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 store_f<bf16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ f16 store_f<f16>(float x) { return __float2half_rn(x); }

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The sum over the block (blockDim.x a multiple of 32, at most 1024) of every thread's `v`,
// returned to every thread; `scratch` is 32 floats of shared memory, reusable at once.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return warp_sum(lane < warps ? scratch[lane] : 0.f);
}

// The block's largest `v`, as block_sum.
__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return warp_max(lane < warps ? scratch[lane] : -INFINITY);
}

// One grid-stride loop index type for element-wise kernels over more than 2^31 elements.
#define GRID_STRIDE(i, n)                                                            \
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (size_t)(n);  \
       i += (size_t)gridDim.x * blockDim.x)

// `EACH_TYPE(M)` expands `M(suffix, type)` for the three element types.
#define EACH_TYPE(M) M(f32, float) M(bf16, bf16) M(f16, f16)

// `NORM_BWD_ENTRIES(P, S, T)` writes a row norm's two backward entry points for element type T
// (suffix S), which LayerNorm (P = ln) and RMSNorm (P = rms) share in shape: `P_bwd_dx_S`
// (dx and each row's statistics) and `P_partials_S` (the weight's column sums over row blocks).
#define NORM_BWD_ENTRIES(P, S, T)                                                                \
  extern "C" __global__ void P##_bwd_dx_##S(const T* x, const T* w, const T* g, T* dx,           \
                                            float* stats, size_t cols, float eps) {              \
    P##_bwd_dx(x, w, g, dx, stats, cols, eps);                                                   \
  }                                                                                              \
  extern "C" __global__ void P##_partials_##S(const T* x, const T* g, const float* stats,        \
                                              float* partial, size_t rows, size_t cols,          \
                                              size_t per) {                                      \
    P##_partials(x, g, stats, partial, rows, cols, per);                                         \
  }
