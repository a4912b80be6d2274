// The sum of squares of each of many tensors in f64 (gradient norms, clipping, the overflow
// check), all in one launch (table.cuh): each block sums its share of its item's elements and
// writes one partial, which the host adds in block order. An item's blocks depend only on its
// length, so its sum does too. An item's buffer: p[0] the tensor.
#include "table.cuh"

__device__ __forceinline__ double warp_sum_d(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename T> __device__ void sum_sq(const Item* items, int count, double* partial) {
  __shared__ double scratch[32];
  double s = 0.0;
  ITEM_LOOP(items, count, it, i) {
    const double v = load_f(reinterpret_cast<const T*>(it.p[0])[i]);
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
  extern "C" __global__ void sum_sq_##S(const Item* items, int count, double* partial) {    \
    sum_sq<T>(items, count, partial);                                                       \
  }
EACH_TYPE(SUM_SQ)
