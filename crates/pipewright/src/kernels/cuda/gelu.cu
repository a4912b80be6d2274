// GELU, tanh approximation, forward and backward: the CPU twin's formulas (kernels/gelu.rs),
// written as 1 / (1 + exp(-2u)) so negative inputs keep their relative precision.
#include "common.cuh"

#define GELU_K 0.7978845608028654f
#define GELU_C 0.044715f

__device__ __forceinline__ float gelu_e2u(float v) {
  return expf(-(GELU_K + GELU_K) * (v + GELU_C * v * v * v));
}

template <typename T> __device__ void gelu_fwd(const T* x, T* y, size_t n) {
  GRID_STRIDE(i, n) {
    const float v = load_f(x[i]);
    y[i] = store_f<T>(v / (1.f + gelu_e2u(v)));
  }
}

template <typename T> __device__ void gelu_bwd(const T* x, const T* g, T* dx, size_t n) {
  GRID_STRIDE(i, n) {
    const float v = load_f(x[i]), e = gelu_e2u(v);
    const float s = 1.f / (1.f + e);
    const float s1 = isfinite(e) ? e * s : 1.f;
    const float slope = s + v * s * s1 * (2.f * GELU_K) * (1.f + (3.f * GELU_C) * v * v);
    dx[i] = store_f<T>(load_f(g[i]) * slope);
  }
}

#define GELU(S, T)                                                                         \
  extern "C" __global__ void gelu_fwd_##S(const T* x, T* y, size_t n) { gelu_fwd(x, y, n); } \
  extern "C" __global__ void gelu_bwd_##S(const T* x, const T* g, T* dx, size_t n) {        \
    gelu_bwd(x, g, dx, n);                                                                 \
  }
EACH_TYPE(GELU)
