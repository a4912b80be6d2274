// The sum of squares of a tensor in f64 (gradient norms, clipping, the overflow check): a
// fixed grid of blocks each sums a grid-stride share and writes one partial, which the host
// adds in block order; the grid depends only on the length, so the result does too.
#include "common.cuh"

__device__ __forceinline__ double warp_sum_d(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename T> __device__ void sum_sq(const T* x, size_t n, double* partial) {
  __shared__ double scratch[32];
  double s = 0.0;
  GRID_STRIDE(i, n) {
    const double v = load_f(x[i]);
    s += v * v;
  }
  s = warp_sum_d(s);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) scratch[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = warp_sum_d(lane < (int)(blockDim.x >> 5) ? scratch[lane] : 0.0);
    if (lane == 0) partial[blockIdx.x] = s;
  }
}

#define SUM_SQ(S, T)                                                                        \
  extern "C" __global__ void sum_sq_##S(const T* x, size_t n, double* partial) {            \
    sum_sq(x, n, partial);                                                                  \
  }
EACH_TYPE(SUM_SQ)
