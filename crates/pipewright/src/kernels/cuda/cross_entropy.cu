// Softmax cross-entropy over the classes, a block per row, as the CPU twin
// (kernels/cross_entropy.rs): each thread keeps a running maximum and sum of exponentials
// (online softmax) over its columns, the block combines them; the loss is
// max + log(sum) - x[target], zero where the target is ignored (-100). The backward recomputes
// both from one read and writes g (softmax - one_hot) once. Row i of the logits starts at
// i * ld (ld >= cols: the view of a padded head's product); the gradient's rows are packed.
// The losses and their gradient are f32 whatever the logits' type (kernels/cross_entropy.rs).
#include "common.cuh"

// (max, sum exp(x - max)) of row xr, to every thread.
template <typename T> __device__ __forceinline__ float2 row_lse(const T* xr, size_t cols, float* scratch) {
  float m = -INFINITY, s = 0.f;
  for (size_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float v = load_f(xr[j]);
    if (v > m) {
      s = s * expf(m - v) + 1.f;
      m = v;
    } else {
      s += expf(v - m);
    }
  }
  const float mx = block_max(m, scratch);
  const float part = m == -INFINITY ? 0.f : s * expf(m - mx);
  return make_float2(mx, block_sum(part, scratch));
}

template <typename T>
__device__ void ce_fwd(const T* x, const int64_t* t, float* nll, size_t cols, size_t ld) {
  __shared__ float scratch[32];
  const size_t row = blockIdx.x;
  const int64_t k = t[row];
  if (k == -100) {
    if (threadIdx.x == 0) nll[row] = 0.f;
    return;
  }
  const float2 ms = row_lse(x + row * ld, cols, scratch);
  if (threadIdx.x == 0) nll[row] = ms.x + logf(ms.y) - load_f(x[row * ld + k]);
}

template <typename T>
__device__ void ce_bwd(const T* x, const float* g, const int64_t* t, T* dx, size_t cols, size_t ld) {
  __shared__ float scratch[32];
  const size_t row = blockIdx.x;
  const int64_t k = t[row];
  const T* xr = x + row * ld;
  T* dr = dx + row * cols;
  if (k == -100) {
    for (size_t j = threadIdx.x; j < cols; j += blockDim.x) dr[j] = store_f<T>(0.f);
    return;
  }
  const float2 ms = row_lse(xr, cols, scratch);
  const float gv = g[row], scale = gv / ms.y;
  for (size_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float d = expf(load_f(xr[j]) - ms.x) * scale;
    dr[j] = store_f<T>((int64_t)j == k ? d - gv : d);
  }
}

#define CE(S, T)                                                                                 \
  extern "C" __global__ void ce_fwd_##S(const T* x, const int64_t* t, float* nll, size_t cols,  \
                                        size_t ld) {                                             \
    ce_fwd(x, t, nll, cols, ld);                                                                 \
  }                                                                                              \
  extern "C" __global__ void ce_bwd_##S(const T* x, const float* g, const int64_t* t, T* dx,     \
                                        size_t cols, size_t ld) {                                \
    ce_bwd(x, g, t, dx, cols, ld);                                                               \
  }
EACH_TYPE(CE)
