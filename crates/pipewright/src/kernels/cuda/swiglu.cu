// SwiGLU's gate, silu(g) u, forward and backward: the CPU twin's formulas (kernels/swiglu.rs),
// s = 1 / (1 + exp(-g)) in f32; the backward writes [dg | du] (2n elements) from one
// exponential per element.
#include "common.cuh"

template <typename T> __device__ void swiglu_fwd(const T* g, const T* u, T* y, size_t n) {
  GRID_STRIDE(i, n) {
    const float gv = load_f(g[i]);
    const float s = 1.f / (1.f + expf(-gv));
    y[i] = store_f<T>(gv * s * load_f(u[i]));
  }
}

template <typename T>
__device__ void swiglu_bwd(const T* g, const T* u, const T* d, T* out, size_t n) {
  GRID_STRIDE(i, n) {
    const float gv = load_f(g[i]), uv = load_f(u[i]), dv = load_f(d[i]);
    const float s = 1.f / (1.f + expf(-gv));
    out[i] = store_f<T>(dv * uv * s * (1.f + gv * (1.f - s)));
    out[n + i] = store_f<T>(dv * gv * s);
  }
}

#define SWIGLU(S, T)                                                                             \
  extern "C" __global__ void swiglu_fwd_##S(const T* g, const T* u, T* y, size_t n) {            \
    swiglu_fwd(g, u, y, n);                                                                      \
  }                                                                                              \
  extern "C" __global__ void swiglu_bwd_##S(const T* g, const T* u, const T* d, T* out,          \
                                            size_t n) {                                          \
    swiglu_bwd(g, u, d, out, n);                                                                 \
  }
EACH_TYPE(SWIGLU)
