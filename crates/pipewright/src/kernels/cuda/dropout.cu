// Dropout with a mask drawn per element, the CPU twin's integers (kernels/dropout.rs): element i
// of this part is element e of the whole tensor, whose draw is words 2(e % 8) and 2(e % 8) + 1
// of ChaCha8 block e / 8 (rand_chacha's ChaCha8Rng, stream 0, key k0..k7); it is dropped when
// the draw's top 53 bits are below `threshold` (ceil(p 2^53)), else scaled in f32 and rounded
// once. The backward is the same kernel on the gradient.
#include "common.cuh"

#define CHACHA_QR(a, b, c, d)                                                                      \
  a += b; d = __funnelshift_l(d ^ a, d ^ a, 16);                                                   \
  c += d; b = __funnelshift_l(b ^ c, b ^ c, 12);                                                   \
  a += b; d = __funnelshift_l(d ^ a, d ^ a, 8);                                                    \
  c += d; b = __funnelshift_l(b ^ c, b ^ c, 7);

// The 64-bit draw j (0..8) of ChaCha8 block `counter`.
__device__ __forceinline__ uint64_t chacha8_draw(const uint32_t* k, uint64_t counter, unsigned j) {
  const uint32_t init[16] = {0x61707865u, 0x3320646eu, 0x79622d32u, 0x6b206574u, k[0], k[1],
                             k[2],        k[3],        k[4],        k[5],        k[6], k[7],
                             (uint32_t)counter, (uint32_t)(counter >> 32), 0u, 0u};
  uint32_t s[16];
#pragma unroll
  for (int i = 0; i < 16; i++) s[i] = init[i];
#pragma unroll
  for (int r = 0; r < 4; r++) {
    CHACHA_QR(s[0], s[4], s[8], s[12]);
    CHACHA_QR(s[1], s[5], s[9], s[13]);
    CHACHA_QR(s[2], s[6], s[10], s[14]);
    CHACHA_QR(s[3], s[7], s[11], s[15]);
    CHACHA_QR(s[0], s[5], s[10], s[15]);
    CHACHA_QR(s[1], s[6], s[11], s[12]);
    CHACHA_QR(s[2], s[7], s[8], s[13]);
    CHACHA_QR(s[3], s[4], s[9], s[14]);
  }
  // Only the two words asked for (a switch keeps the state in registers).
  uint32_t lo = 0, hi = 0;
#pragma unroll
  for (unsigned w = 0; w < 8; w++) {
    if (w == j) {
      lo = s[2 * w] + init[2 * w];
      hi = s[2 * w + 1] + init[2 * w + 1];
    }
  }
  return (uint64_t)lo | ((uint64_t)hi << 32);
}

template <typename T>
__device__ void dropout(const T* x, T* y, size_t n, uint64_t threshold, float scale, uint64_t along,
                        uint64_t whole, uint64_t offset, uint64_t inner, const uint32_t* k) {
  GRID_STRIDE(i, n) {
    const uint64_t slab = i / inner, r = i % inner;
    const uint64_t e = ((slab / along) * whole + offset + slab % along) * inner + r;
    const bool keep = (chacha8_draw(k, e / 8, (unsigned)(e % 8)) >> 11) >= threshold;
    y[i] = store_f<T>(keep ? load_f(x[i]) * scale : 0.f);
  }
}

#define DROPOUT(S, T)                                                                            \
  extern "C" __global__ void dropout_##S(const T* x, T* y, size_t n, uint64_t threshold,         \
                                         float scale, uint64_t along, uint64_t whole,            \
                                         uint64_t offset, uint64_t inner, uint32_t k0,           \
                                         uint32_t k1, uint32_t k2, uint32_t k3, uint32_t k4,     \
                                         uint32_t k5, uint32_t k6, uint32_t k7) {                \
    const uint32_t k[8] = {k0, k1, k2, k3, k4, k5, k6, k7};                                      \
    dropout(x, y, n, threshold, scale, along, whole, offset, inner, k);                          \
  }
EACH_TYPE(DROPOUT)
