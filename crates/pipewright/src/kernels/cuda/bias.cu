// A bias added to every row, and column sums (the bias gradient, and LayerNorm's weight and
// bias gradients): rows in a fixed number of blocks summed in f32, then the blocks in order,
// so the sums do not depend on the launch (deterministic, as the CPU twin).
#include "common.cuh"

template <typename T> __device__ void bias_add(const T* y, const T* b, T* out, size_t n, size_t cols) {
  GRID_STRIDE(i, n) out[i] = store_f<T>(load_f(y[i]) + load_f(b[i % cols]));
}

// Block (blockIdx.x, blockIdx.y): columns 32 blockIdx.x .. +32 of the rows
// `[blockIdx.y * per, (blockIdx.y + 1) * per)`, threads (32, 8); writes
// partial[blockIdx.y * cols + col] (f32).
template <typename T>
__device__ void column_partials(const T* g, float* partial, size_t rows, size_t cols, size_t per) {
  __shared__ float acc[8][33];
  const size_t col = blockIdx.x * 32 + threadIdx.x;
  const size_t r0 = blockIdx.y * per, r1 = min(rows, r0 + per);
  float s = 0.f;
  if (col < cols)
    for (size_t r = r0 + threadIdx.y; r < r1; r += 8) s += load_f(g[r * cols + col]);
  acc[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float t = acc[0][threadIdx.x];
    for (int k = 1; k < 8; k++) t += acc[k][threadIdx.x];
    partial[blockIdx.y * cols + col] = t;
  }
}

// out[col] = the sum of the `blocks` partials of column col: block (blockIdx.x), threads
// (32, 8): thread y adds partials y, y + 8, ..., then the eight sums are added in order.
template <typename T> __device__ void finish_sums(const float* partial, T* out, size_t cols, size_t blocks) {
  __shared__ float acc[8][33];
  const size_t c = blockIdx.x * 32 + threadIdx.x;
  float s = 0.f;
  if (c < cols)
    for (size_t k = threadIdx.y; k < blocks; k += 8) s += partial[k * cols + c];
  acc[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float t = acc[0][threadIdx.x];
    for (int k = 1; k < 8; k++) t += acc[k][threadIdx.x];
    out[c] = store_f<T>(t);
  }
}

#define BIAS(S, T)                                                                              \
  extern "C" __global__ void bias_add_##S(const T* y, const T* b, T* out, size_t n, size_t cols) { \
    bias_add(y, b, out, n, cols);                                                               \
  }                                                                                             \
  extern "C" __global__ void column_partials_##S(const T* g, float* p, size_t rows, size_t cols,  \
                                                 size_t per) {                                  \
    column_partials(g, p, rows, cols, per);                                                     \
  }                                                                                             \
  extern "C" __global__ void finish_sums_##S(const float* p, T* out, size_t cols, size_t blocks) { \
    finish_sums(p, out, cols, blocks);                                                          \
  }
EACH_TYPE(BIAS)
