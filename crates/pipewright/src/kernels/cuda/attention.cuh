// Shared by the two causal attention kernels (attention.cu, the SIMT one for any head size;
// flash.cu, the tensor-core one for 64 and 128): the geometry both read from the host
// (kernels/attention.rs) and the macro that writes their three extern "C" entry points.
#pragma once
#include "common.cuh"

// A packed (batch, time, 3 C) q | k | v tensor's shape: T steps, H heads of hd columns,
// C = H hd, and the factor the scores are multiplied by (the caller's `scale`).
struct Geo {
  int T, H, hd, C;
  float scale;
};

// `ATTN_ENTRIES(P, THREADS, S, T, D)` writes `P_fwd_D_S`, `P_bwd_q_D_S` and `P_bwd_kv_D_S`,
// blocks of at most THREADS threads, calling the templates `P_fwd`, `P_bwd_q` and `P_bwd_kv`
// for element type T (suffix S) and head dimension D.
#define ATTN_ENTRIES(P, THREADS, S, T, D)                                                        \
  extern "C" __global__ void __launch_bounds__(THREADS) P##_fwd_##D##_##S(const T* qkv, T* y,    \
                                                                          Geo g) {               \
    P##_fwd<T, D>(qkv, y, g);                                                                    \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(THREADS)                                          \
      P##_bwd_q_##D##_##S(const T* qkv, const T* y, const T* dy, T* dqkv, float* lse,            \
                          float* dvec, Geo g) {                                                  \
    P##_bwd_q<T, D>(qkv, y, dy, dqkv, lse, dvec, g);                                             \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(THREADS)                                          \
      P##_bwd_kv_##D##_##S(const T* qkv, const T* dy, T* dqkv, const float* lse,                 \
                           const float* dvec, Geo g) {                                           \
    P##_bwd_kv<T, D>(qkv, dy, dqkv, lse, dvec, g);                                               \
  }
