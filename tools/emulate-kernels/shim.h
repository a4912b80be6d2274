// Host stand-ins for what the kernels take from the GPU (tools/emulate-kernels.sh): CUDA threads
// as std::threads (a block's at once, blocks one after another: `grid`), __syncthreads and the warp
// shuffles as barriers, and mma.sync m16n8k16 (f32 += bf16/f16 x bf16/f16) computed from every
// lane's fragments as the PTX ISA lays them out: A a0 (g, 2c..), a1 (g + 8, 2c..), a2 (g,
// 2c + 8..), a3 (g + 8, 2c + 8..); B b0 (k 2c.., n g), b1 (k 2c + 8.., n g); C (g, 2c), (g,
// 2c + 1), (g + 8, 2c), (g + 8, 2c + 1), with g = lane / 4, c = lane % 4.
#pragma once
#include <barrier>
#include <thread>
#include <vector>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <functional>
#include <memory>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
using std::min; using std::max;
struct U3 { unsigned x = 0, y = 0, z = 0; };
inline thread_local U3 threadIdx, blockIdx;
inline U3 blockDim, gridDim;
inline std::barrier<>* block_bar;
struct Warp { std::barrier<>* bar; double f[32]; uint32_t a[32][4], b[32][2]; };
inline Warp warps[32];
inline void sync_block() { block_bar->arrive_and_wait(); }
template <typename V> V shfl_xor(V v, int o) {
  Warp& w = warps[threadIdx.x / 32]; int l = threadIdx.x % 32;
  w.f[l] = v; w.bar->arrive_and_wait(); V r = (V)w.f[l ^ o]; w.bar->arrive_and_wait(); return r;
}
// The _rn intrinsics: IEEE operations, rounded once (built with -ffp-contract=off).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }

// Runs `body` as a grid of gx x gy blocks of `threads` threads (a multiple of 32), a block's
// threads at once, blocks one after another.
inline void grid(int gx, int gy, int threads, const std::function<void()>& body) {
  blockDim.x = threads; gridDim.x = gx; gridDim.y = gy;
  std::barrier<> bb(threads); block_bar = &bb;
  std::vector<std::unique_ptr<std::barrier<>>> wb;
  for (int w = 0; w < threads / 32; w++) { wb.emplace_back(new std::barrier<>(32)); warps[w].bar = wb.back().get(); }
  for (int by = 0; by < gy; by++) for (int bx = 0; bx < gx; bx++) {
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; t++) ts.emplace_back([&, t] { threadIdx.x = t; blockIdx.x = bx; blockIdx.y = by; body(); });
    for (auto& t : ts) t.join();
  }
}
template <typename T> float el(uint32_t r, int hi) {
  uint16_t bits = hi ? (r >> 16) : (r & 0xffff); T v; memcpy(&v, &bits, 2);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(v); else return __half2float(v);
}
template <typename T> void mma_emu(float* c, const uint32_t* a, const uint32_t* b) {
  Warp& w = warps[threadIdx.x / 32]; int l = threadIdx.x % 32;
  memcpy(w.a[l], a, 16); memcpy(w.b[l], b, 8);
  w.bar->arrive_and_wait();
  float A[16][16], B[16][8];
  for (int lane = 0; lane < 32; lane++) {
    int g = lane >> 2, t = lane & 3;
    for (int h = 0; h < 2; h++) {
      A[g][2*t+h] = el<T>(w.a[lane][0], h); A[g+8][2*t+h] = el<T>(w.a[lane][1], h);
      A[g][2*t+8+h] = el<T>(w.a[lane][2], h); A[g+8][2*t+8+h] = el<T>(w.a[lane][3], h);
      B[2*t+h][g] = el<T>(w.b[lane][0], h); B[2*t+8+h][g] = el<T>(w.b[lane][1], h);
    }
  }
  int g = l >> 2, t = l & 3;
  for (int e = 0; e < 4; e++) {
    int row = g + (e >= 2 ? 8 : 0), col = 2*t + (e & 1);
    float s = 0; for (int k = 0; k < 16; k++) s += A[row][k] * B[k][col];
    c[e] += s;
  }
  w.bar->arrive_and_wait();
}
