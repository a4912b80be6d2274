// Rotary position embedding (Hugging Face's rotate_half layout), as the CPU twin
// (kernels/rotary.rs): a thread per pair (i, i + hd/2) of a row, rotated by the angle
// (start + row % t) * inv[i] (f32, as the CPU's tables compute it); `sign` -1 rotates back,
// which is the backward.
#include "common.cuh"

template <typename T>
__device__ void rope(const T* x, T* y, const float* inv, size_t pairs, size_t half, size_t t,
                     size_t start, float sign) {
  GRID_STRIDE(k, pairs) {
    const size_t row = k / half, i = k % half;
    const float a = (float)(start + row % t) * inv[i];
    const float c = cosf(a), s = sign * sinf(a);
    const size_t o = row * 2 * half;
    const float xa = load_f(x[o + i]), xb = load_f(x[o + i + half]);
    y[o + i] = store_f<T>(xa * c - xb * s);
    y[o + i + half] = store_f<T>(xb * c + xa * s);
  }
}

#define ROPE(S, T)                                                                               \
  extern "C" __global__ void rope_##S(const T* x, T* y, const float* inv, size_t pairs,          \
                                      size_t half, size_t t, size_t start, float sign) {         \
    rope(x, y, inv, pairs, half, t, start, sign);                                                \
  }
EACH_TYPE(ROPE)
