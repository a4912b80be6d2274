// The row kernels of attention through cuBLAS (kernels/attention_blas.rs): over the f32
// scores S (rows of T keys, row r being query r mod T), the causal softmax P (in the element
// type, for the next product) and each row's log-sum-exp; and from S, those log-sum-exps and
// dP = dy v^T, the scores' gradient dS = scale P (dP - sum_j P dP). A block per row.
#include "common.cuh"

template <typename T>
__device__ void causal_softmax(const float* S, T* P, float* lse, int t) {
  __shared__ float scratch[32];
  const size_t r = blockIdx.x;
  const int i = (int)(r % t);
  const float* s = S + r * t;
  float m = -INFINITY;
  for (int j = threadIdx.x; j <= i; j += blockDim.x) m = fmaxf(m, s[j]);
  m = block_max(m, scratch);
  float z = 0.f;
  for (int j = threadIdx.x; j <= i; j += blockDim.x) z += expf(s[j] - m);
  z = block_sum(z, scratch);
  const float inv = 1.f / z;
  for (int j = threadIdx.x; j < t; j += blockDim.x)
    P[r * t + j] = store_f<T>(j <= i ? expf(s[j] - m) * inv : 0.f);
  if (threadIdx.x == 0) lse[r] = m + logf(z);
}

template <typename T>
__device__ void causal_softmax_grad(const float* S, const float* lse, const float* dP, T* dS, int t,
                                    float scale) {
  __shared__ float scratch[32];
  const size_t r = blockIdx.x;
  const int i = (int)(r % t);
  const float* s = S + r * t;
  const float* dp = dP + r * t;
  const float l = lse[r];
  float d = 0.f;
  for (int j = threadIdx.x; j <= i; j += blockDim.x) d += expf(s[j] - l) * dp[j];
  d = block_sum(d, scratch);
  for (int j = threadIdx.x; j < t; j += blockDim.x)
    dS[r * t + j] = store_f<T>(j <= i ? expf(s[j] - l) * (dp[j] - d) * scale : 0.f);
}

#define SOFTMAX(S_, T)                                                                          \
  extern "C" __global__ void causal_softmax_##S_(const float* S, T* P, float* lse, int t) {    \
    causal_softmax(S, P, lse, t);                                                               \
  }                                                                                             \
  extern "C" __global__ void causal_softmax_grad_##S_(const float* S, const float* lse,        \
                                                      const float* dP, T* dS, int t,            \
                                                      float scale) {                            \
    causal_softmax_grad(S, lse, dP, dS, t, scale);                                              \
  }
EACH_TYPE(SOFTMAX)
