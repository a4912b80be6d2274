// LayerNorm over the last dimension, a block per row, as the CPU twin (kernels/layer_norm.rs):
// mean, then the variance of the centred row (two passes, f32), biased. The backward writes
// dx and each row's mean and 1/std in one kernel, then the weight and bias gradients as column
// sums of g x-hat and g over a fixed number of row blocks (bias.cu's `finish_sums` adds them).
#include "common.cuh"

// Mean and 1 / sqrt(var + eps) of row `xr`, to every thread of the block.
template <typename T>
__device__ __forceinline__ float2 row_stats(const T* xr, size_t cols, float eps, float* scratch) {
  float s = 0.f;
  for (size_t j = threadIdx.x; j < cols; j += blockDim.x) s += load_f(xr[j]);
  const float mean = block_sum(s, scratch) / (float)cols;
  float v = 0.f;
  for (size_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float d = load_f(xr[j]) - mean;
    v += d * d;
  }
  const float var = block_sum(v, scratch) / (float)cols;
  return make_float2(mean, 1.f / sqrtf(var + eps));
}

template <typename T>
__device__ void ln_fwd(const T* x, const T* w, const T* b, T* y, size_t cols, float eps) {
  __shared__ float scratch[32];
  const size_t off = (size_t)blockIdx.x * cols;
  const float2 st = row_stats(x + off, cols, eps, scratch);
  for (size_t j = threadIdx.x; j < cols; j += blockDim.x)
    y[off + j] = store_f<T>((load_f(x[off + j]) - st.x) * st.y * load_f(w[j]) + load_f(b[j]));
}

// dx of one row and its (mean, rstd) into stats[2 row ..].
template <typename T>
__device__ void ln_bwd_dx(const T* x, const T* w, const T* g, T* dx, float* stats, size_t cols,
                          float eps) {
  __shared__ float scratch[32];
  const size_t off = (size_t)blockIdx.x * cols;
  const float2 st = row_stats(x + off, cols, eps, scratch);
  float s1 = 0.f, s2 = 0.f;
  for (size_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float gw = load_f(g[off + j]) * load_f(w[j]);
    s1 += gw;
    s2 += gw * ((load_f(x[off + j]) - st.x) * st.y);
  }
  const float m1 = block_sum(s1, scratch) / (float)cols;
  const float m2 = block_sum(s2, scratch) / (float)cols;
  for (size_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float xh = (load_f(x[off + j]) - st.x) * st.y;
    dx[off + j] = store_f<T>(st.y * (load_f(g[off + j]) * load_f(w[j]) - m1 - xh * m2));
  }
  if (threadIdx.x == 0) {
    stats[2 * blockIdx.x] = st.x;
    stats[2 * blockIdx.x + 1] = st.y;
  }
}

// As bias.cu's column_partials, for [sum g x-hat | sum g]: partial[blockIdx.y][2 cols].
template <typename T>
__device__ void ln_partials(const T* x, const T* g, const float* stats, float* partial, size_t rows,
                            size_t cols, size_t per) {
  __shared__ float acc[2][8][33];
  const size_t c = blockIdx.x * 32 + threadIdx.x;
  const size_t r0 = blockIdx.y * per, r1 = min(rows, r0 + per);
  float sw = 0.f, sb = 0.f;
  if (c < cols)
    for (size_t r = r0 + threadIdx.y; r < r1; r += 8) {
      const float gv = load_f(g[r * cols + c]);
      sw += gv * ((load_f(x[r * cols + c]) - stats[2 * r]) * stats[2 * r + 1]);
      sb += gv;
    }
  acc[0][threadIdx.y][threadIdx.x] = sw;
  acc[1][threadIdx.y][threadIdx.x] = sb;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float tw = acc[0][0][threadIdx.x], tb = acc[1][0][threadIdx.x];
    for (int k = 1; k < 8; k++) {
      tw += acc[0][k][threadIdx.x];
      tb += acc[1][k][threadIdx.x];
    }
    partial[blockIdx.y * 2 * cols + c] = tw;
    partial[blockIdx.y * 2 * cols + cols + c] = tb;
  }
}

#define LN(S, T)                                                                                 \
  extern "C" __global__ void ln_fwd_##S(const T* x, const T* w, const T* b, T* y, size_t cols,   \
                                        float eps) {                                             \
    ln_fwd(x, w, b, y, cols, eps);                                                               \
  }                                                                                              \
  NORM_BWD_ENTRIES(ln, S, T)
EACH_TYPE(LN)
