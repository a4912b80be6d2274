// RMSNorm over the last dimension (Llama's), a block per row, as the CPU twin
// (kernels/rms_norm.rs): rstd = 1 / sqrt(mean(x^2) + eps) in f32, y = x rstd w rounded once.
// The backward writes dx and each row's rstd in one kernel, then the weight's gradient as
// column sums of g x rstd over a fixed number of row blocks (bias.cu's `finish_sums` adds them).
#include "common.cuh"

// 1 / sqrt(mean(row^2) + eps), to every thread of the block.
template <typename T>
__device__ __forceinline__ float row_rstd(const T* xr, size_t cols, float eps, float* scratch) {
  float s = 0.f;
  for (size_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float v = load_f(xr[j]);
    s += v * v;
  }
  return 1.f / sqrtf(block_sum(s, scratch) / (float)cols + eps);
}

template <typename T>
__device__ void rms_fwd(const T* x, const T* w, T* y, size_t cols, float eps) {
  __shared__ float scratch[32];
  const size_t off = (size_t)blockIdx.x * cols;
  const float s = row_rstd(x + off, cols, eps, scratch);
  for (size_t j = threadIdx.x; j < cols; j += blockDim.x)
    y[off + j] = store_f<T>(load_f(x[off + j]) * s * load_f(w[j]));
}

// dx = s g w - x s^3 mean(g w x) of one row, and its rstd into stats[row].
template <typename T>
__device__ void rms_bwd_dx(const T* x, const T* w, const T* g, T* dx, float* stats, size_t cols,
                           float eps) {
  __shared__ float scratch[32];
  const size_t off = (size_t)blockIdx.x * cols;
  const float s = row_rstd(x + off, cols, eps, scratch);
  float acc = 0.f;
  for (size_t j = threadIdx.x; j < cols; j += blockDim.x)
    acc += load_f(g[off + j]) * load_f(w[j]) * load_f(x[off + j]);
  const float m = block_sum(acc, scratch) / (float)cols * s * s * s;
  for (size_t j = threadIdx.x; j < cols; j += blockDim.x)
    dx[off + j] = store_f<T>(s * load_f(g[off + j]) * load_f(w[j]) - load_f(x[off + j]) * m);
  if (threadIdx.x == 0) stats[blockIdx.x] = s;
}

// As bias.cu's column_partials, for sum g x rstd: partial[blockIdx.y][cols].
template <typename T>
__device__ void rms_partials(const T* x, const T* g, const float* stats, float* partial,
                             size_t rows, size_t cols, size_t per) {
  __shared__ float acc[8][33];
  const size_t c = blockIdx.x * 32 + threadIdx.x;
  const size_t r0 = blockIdx.y * per, r1 = min(rows, r0 + per);
  float sw = 0.f;
  if (c < cols)
    for (size_t r = r0 + threadIdx.y; r < r1; r += 8)
      sw += load_f(g[r * cols + c]) * load_f(x[r * cols + c]) * stats[r];
  acc[threadIdx.y][threadIdx.x] = sw;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float t = acc[0][threadIdx.x];
    for (int k = 1; k < 8; k++) t += acc[k][threadIdx.x];
    partial[blockIdx.y * cols + c] = t;
  }
}

#define RMS(S, T)                                                                                \
  extern "C" __global__ void rms_fwd_##S(const T* x, const T* w, T* y, size_t cols, float eps) { \
    rms_fwd(x, w, y, cols, eps);                                                                 \
  }                                                                                              \
  NORM_BWD_ENTRIES(rms, S, T)
EACH_TYPE(RMS)
