// Causal self-attention on tensor cores, flash-style (FlashAttention-2's loop order), for bf16
// and f16 over the packed (batch, time, 3 C) q | k | v tensor of kernels/attention.rs (C = heads
// x head_dim, heads contiguous within each third): no (time x time) tensor, scores and
// softmax statistics in f32, P and dS rounded to the element type for their products (as
// FlashAttention rounds them), every product accumulated in f32 by mma.sync m16n8k16.
//
// D is the head dimension rounded up to 64 or 128 (columns past hd are zeros). A block is 4
// warps, a warp 16 rows (queries, or keys in the key-side backward); grid (batch x heads,
// time / 64). Softmax runs in base 2: s2 = scale log2(e) q.k, P = 2^(s2 - lse2).
// Forward: each warp walks the key tiles up to its last query, online softmax.
// Backward, two kernels and no atomics (deterministic), as attention.cu's: `fa_bwd_q` finds
// each row's lse2 (a first walk) and D_i = dy_i . y_i, then dq; it writes lse2 and D_i for
// `fa_bwd_kv`, which holds its block's 64 keys and values in shared memory and walks the query
// tiles from its first key on for dk and dv.
//
// Fragments of mma.m16n8k16 (g = lane / 4, c = lane % 4; a register holds two consecutive
// elements, the lower column in the low half): A (16 x 16, row-major) a0 = (g, 2c..), a1 =
// (g + 8, 2c..), a2 = (g, 2c + 8..), a3 = (g + 8, 2c + 8..); B (16 x 8, k x n) b0 = (k 2c..,
// n g), b1 = (k 2c + 8.., n g); C (16 x 8) c0, c1 = (g, 2c), (g, 2c + 1), c2, c3 = (g + 8, ...).
// An accumulator tile's rows and columns are so an A fragment of the next product: the C
// tiles j = 2kk, 2kk + 1 make a = (c0c1 of 2kk, c2c3 of 2kk, c0c1 of 2kk + 1, c2c3 of 2kk + 1).
#include "attention.cuh"


constexpr int WARPS = 4, ROWS = 16 * WARPS;

__device__ __forceinline__ void mma(float* c, const uint32_t* a, const uint32_t* b, bf16) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void mma(float* c, const uint32_t* a, const uint32_t* b, f16) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Two floats rounded to the element type, `lo` in the low half.
__device__ __forceinline__ uint32_t pack(float lo, float hi, bf16) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t pack(float lo, float hi, f16) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Two elements (16 bits each) as one register, `lo` in the low half.
template <typename T> __device__ __forceinline__ uint32_t pair(T lo, T hi) {
  return (uint32_t)(*reinterpret_cast<const uint16_t*>(&lo)) |
         ((uint32_t)(*reinterpret_cast<const uint16_t*>(&hi)) << 16);
}

// Elements i and i + 1 of shared memory (i even) as one register.
template <typename T> __device__ __forceinline__ uint32_t two(const T* sh, int i) {
  return *reinterpret_cast<const uint32_t*>(sh + i);
}

// Element (row, d) of a head's rows `stride` apart, zero past row T or column hd.
template <typename T>
__device__ __forceinline__ T at(const T* src, size_t stride, int row, int d, const Geo& g) {
  return (row < g.T && d < g.hd) ? src[(size_t)row * stride + d] : store_f<T>(0.f);
}

// The A fragments of rows r, r + 8 of a head (rows `stride` apart) over D columns.
template <typename T, int D>
__device__ __forceinline__ void load_a(const T* src, size_t stride, int r, int c, const Geo& g,
                                       uint32_t (*a)[4]) {
#pragma unroll
  for (int kc = 0; kc < D / 16; kc++) {
    const int d = kc * 16 + 2 * c;
    a[kc][0] = pair(at(src, stride, r, d, g), at(src, stride, r, d + 1, g));
    a[kc][1] = pair(at(src, stride, r + 8, d, g), at(src, stride, r + 8, d + 1, g));
    a[kc][2] = pair(at(src, stride, r, d + 8, g), at(src, stride, r, d + 9, g));
    a[kc][3] = pair(at(src, stride, r + 8, d + 8, g), at(src, stride, r + 8, d + 9, g));
  }
}

// Whether a head's rows (`stride` elements apart from `src`) can be read 16 bytes at a time.
template <typename T> __device__ __forceinline__ bool in_eights(const T* src, size_t stride, const Geo& g) {
  return reinterpret_cast<uintptr_t>(src) % 16 == 0 && stride % 8 == 0 && g.hd % 8 == 0;
}

// `n` rows from `row0` of a head into shared memory (D columns, zeros past T or hd): row r,
// column d at sh[r LD + d], or at sh[d LD + r] when TRANSPOSED. Eight columns at a time when
// the rows allow it.
template <typename T, int D, int LD, bool TRANSPOSED = false>
__device__ __forceinline__ void load_tile(const T* src, size_t stride, int row0, int n, const Geo& g,
                                          T* sh) {
  if (in_eights(src, stride, g)) {
    for (int e = threadIdx.x; e < n * D / 8; e += blockDim.x) {
      const int r = e / (D / 8), d = (e % (D / 8)) * 8, row = row0 + r;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (row < g.T && d < g.hd) v = *reinterpret_cast<const uint4*>(src + (size_t)row * stride + d);
      if (TRANSPOSED) {
        const T* x = reinterpret_cast<const T*>(&v);
#pragma unroll
        for (int i = 0; i < 8; i++) sh[(d + i) * LD + r] = x[i];
      } else {
        *reinterpret_cast<uint4*>(sh + r * LD + d) = v;
      }
    }
    return;
  }
  for (int e = threadIdx.x; e < n * D; e += blockDim.x) {
    const int r = e / D, d = e % D;
    sh[TRANSPOSED ? d * LD + r : r * LD + d] = at(src, stride, row0 + r, d, g);
  }
}

// The sum over the 4 lanes of a quad (the lanes holding one row of an accumulator).
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// s[j] = A B for the 8-column tiles j < J of B = rows of sh (k = columns, n = rows j 8 + g):
// q k^T with sh holding keys, dy v^T with sh holding values.
template <typename T, int D, int LD, int J>
__device__ __forceinline__ void products(const uint32_t (*a)[4], const T* sh, int g, int c,
                                         float (*s)[4]) {
#pragma unroll
  for (int j = 0; j < J; j++) {
    s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int kc = 0; kc < D / 16; kc++) {
      const uint32_t b[2] = {two(sh, (j * 8 + g) * LD + kc * 16 + 2 * c),
                             two(sh, (j * 8 + g) * LD + kc * 16 + 8 + 2 * c)};
      mma(s[j], a[kc], b, T());
    }
  }
}

// acc[n] += A B over one k tile of 16, A from the accumulator tiles p[0], p[1] (rounded), B
// (k 16 x D) = rows k0.. of sh (k = rows, n = columns): dS k and P^T dy and dS^T q.
template <typename T, int D, int LD>
__device__ __forceinline__ void accumulate(const float (*p)[4], const T* sh, int k0, int g, int c,
                                           float (*acc)[4]) {
  const uint32_t a[4] = {pack(p[0][0], p[0][1], T()), pack(p[0][2], p[0][3], T()),
                         pack(p[1][0], p[1][1], T()), pack(p[1][2], p[1][3], T())};
#pragma unroll
  for (int n = 0; n < D / 8; n++) {
    const int col = n * 8 + g, r = k0 + 2 * c;
    const uint32_t b[2] = {pair(sh[r * LD + col], sh[(r + 1) * LD + col]),
                           pair(sh[(r + 8) * LD + col], sh[(r + 9) * LD + col])};
    mma(acc[n], a, b, T());
  }
}

// Each accumulator value's (row, column) in a 16-row tile j of 8 columns: rows r, r + 8.
#define FA_ROW(e) ((e) < 2 ? 0 : 8)
#define FA_COL(j, e) ((j) * 8 + 2 * c + ((e) & 1))

// The online softmax's step over a tile of J x 8 keys from k0: the scores s of rows r, r + 8
// scaled into base 2 and masked (-inf past the row or T), each row's maximum m raised to the
// tile's, `shift` the exponent's shift (0 while a row has seen no key) and `corr` the factor
// the row's earlier sums are rescaled by.
template <int J>
__device__ __forceinline__ void online_max(float (*s)[4], int k0, int r, int c, const Geo& g, float sl2,
                                           float* m, float* shift, float* corr) {
  float mt[2] = {m[0], m[1]};
#pragma unroll
  for (int j = 0; j < J; j++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int key = k0 + FA_COL(j, e), row = r + FA_ROW(e);
      s[j][e] = (key <= row && key < g.T) ? s[j][e] * sl2 : -INFINITY;
      mt[e >> 1] = fmaxf(mt[e >> 1], s[j][e]);
    }
#pragma unroll
  for (int i = 0; i < 2; i++) {
    mt[i] = quad_max(mt[i]);
    shift[i] = mt[i] == -INFINITY ? 0.f : mt[i];
    corr[i] = exp2f(m[i] - shift[i]);
    m[i] = mt[i];
  }
}

template <typename T, int D> __device__ void fa_fwd(const T* qkv, T* y, Geo g) {
  constexpr int BK = 64, LDK = D + 8, LDV = BK + 8;
  __shared__ __align__(16) T Ks[BK * LDK];
  __shared__ __align__(16) T Vt[D * LDV];
  const int warp = threadIdx.x >> 5, gq = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
  const int b = blockIdx.x / g.H, h = blockIdx.x % g.H;
  const size_t rs = 3 * (size_t)g.C;
  const T* base = qkv + (size_t)b * g.T * rs + (size_t)h * g.hd;
  const int q0 = blockIdx.y * ROWS + warp * 16, r = q0 + gq;
  uint32_t qa[D / 16][4];
  load_a<T, D>(base, rs, r, c, g, qa);
  float o[D / 8][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
  for (int n = 0; n < D / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  const float sl2 = g.scale * 1.4426950408889634f;
  const int last = min(g.T, (int)(blockIdx.y + 1) * ROWS);
  for (int k0 = 0; k0 < last; k0 += BK) {
    __syncthreads();
    load_tile<T, D, LDK>(base + g.C, rs, k0, BK, g, Ks);
    load_tile<T, D, LDV, true>(base + 2 * g.C, rs, k0, BK, g, Vt);
    __syncthreads();
    if (k0 > q0 + 15) continue;  // every key after every row of this warp
    float s[BK / 8][4], shift[2], corr[2];
    products<T, D, LDK, BK / 8>(qa, Ks, gq, c, s);
    online_max<BK / 8>(s, k0, r, c, g, sl2, m, shift, corr);
#pragma unroll
    for (int i = 0; i < 2; i++) {
      l[i] *= corr[i];
#pragma unroll
      for (int n = 0; n < D / 8; n++) {
        o[n][2 * i] *= corr[i];
        o[n][2 * i + 1] *= corr[i];
      }
    }
#pragma unroll
    for (int j = 0; j < BK / 8; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const float p = exp2f(s[j][e] - shift[e >> 1]);
        s[j][e] = p;
        l[e >> 1] += p;
      }
#pragma unroll
    for (int kk = 0; kk < BK / 16; kk++) {
      const uint32_t a[4] = {pack(s[2 * kk][0], s[2 * kk][1], T()), pack(s[2 * kk][2], s[2 * kk][3], T()),
                             pack(s[2 * kk + 1][0], s[2 * kk + 1][1], T()),
                             pack(s[2 * kk + 1][2], s[2 * kk + 1][3], T())};
#pragma unroll
      for (int n = 0; n < D / 8; n++) {
        const uint32_t bv[2] = {two(Vt, (n * 8 + gq) * LDV + kk * 16 + 2 * c),
                                two(Vt, (n * 8 + gq) * LDV + kk * 16 + 8 + 2 * c)};
        mma(o[n], a, bv, T());
      }
    }
  }
  T* out = y + (size_t)b * g.T * g.C + (size_t)h * g.hd;
#pragma unroll
  for (int i = 0; i < 2; i++) l[i] = quad_sum(l[i]);
#pragma unroll
  for (int n = 0; n < D / 8; n++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int row = r + FA_ROW(e), d = FA_COL(n, e);
      if (row < g.T && d < g.hd) out[(size_t)row * g.C + d] = store_f<T>(o[n][e] / l[e >> 1]);
    }
}

template <typename T, int D>
__device__ void fa_bwd_q(const T* qkv, const T* y, const T* dy, T* dqkv, float* lse, float* dvec,
                         Geo g) {
  constexpr int BK = 32, LDK = D + 8;
  __shared__ __align__(16) T Ks[BK * LDK];
  __shared__ __align__(16) T Vs[BK * LDK];
  const int warp = threadIdx.x >> 5, gq = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
  const int b = blockIdx.x / g.H, h = blockIdx.x % g.H;
  const size_t rs = 3 * (size_t)g.C;
  const T* base = qkv + (size_t)b * g.T * rs + (size_t)h * g.hd;
  const size_t yo = (size_t)b * g.T * g.C + (size_t)h * g.hd;
  const int q0 = blockIdx.y * ROWS + warp * 16, r = q0 + gq;
  uint32_t qa[D / 16][4], da[D / 16][4];
  load_a<T, D>(base, rs, r, c, g, qa);
  load_a<T, D>(dy + yo, g.C, r, c, g, da);
  const float sl2 = g.scale * 1.4426950408889634f;
  const int last = min(g.T, (int)(blockIdx.y + 1) * ROWS);
  // Walk 1: each row's lse2, as the forward finds it.
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  for (int k0 = 0; k0 < last; k0 += BK) {
    __syncthreads();
    load_tile<T, D, LDK>(base + g.C, rs, k0, BK, g, Ks);
    __syncthreads();
    if (k0 > q0 + 15) continue;
    float s[BK / 8][4], shift[2], corr[2];
    products<T, D, LDK, BK / 8>(qa, Ks, gq, c, s);
    online_max<BK / 8>(s, k0, r, c, g, sl2, m, shift, corr);
#pragma unroll
    for (int i = 0; i < 2; i++) l[i] *= corr[i];
#pragma unroll
    for (int j = 0; j < BK / 8; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) l[e >> 1] += exp2f(s[j][e] - shift[e >> 1]);
  }
  float ls[2], di[2];
#pragma unroll
  for (int i = 0; i < 2; i++) {
    ls[i] = m[i] + log2f(quad_sum(l[i]));
    // D_i = dy_i . y_i over the row's columns, a quarter per lane.
    const int row = r + 8 * i;
    float part = 0.f;
    if (row < g.T)
      for (int d = c; d < g.hd; d += 4)
        part += load_f(y[yo + (size_t)row * g.C + d]) * load_f(dy[yo + (size_t)row * g.C + d]);
    di[i] = quad_sum(part);
  }
  // Walk 2: dq = scale sum_j p_ij (dp_ij - D_i) k_j.
  float dq[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; n++) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.f;
  for (int k0 = 0; k0 < last; k0 += BK) {
    __syncthreads();
    load_tile<T, D, LDK>(base + g.C, rs, k0, BK, g, Ks);
    load_tile<T, D, LDK>(base + 2 * g.C, rs, k0, BK, g, Vs);
    __syncthreads();
    if (k0 > q0 + 15) continue;
    float s[BK / 8][4], dp[BK / 8][4];
    products<T, D, LDK, BK / 8>(qa, Ks, gq, c, s);
    products<T, D, LDK, BK / 8>(da, Vs, gq, c, dp);
#pragma unroll
    for (int j = 0; j < BK / 8; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int key = k0 + FA_COL(j, e), row = r + FA_ROW(e), i = e >> 1;
        const float p = (key <= row && key < g.T) ? exp2f(s[j][e] * sl2 - ls[i]) : 0.f;
        s[j][e] = p * (dp[j][e] - di[i]);
      }
#pragma unroll
    for (int kk = 0; kk < BK / 16; kk++) accumulate<T, D, LDK>(s + 2 * kk, Ks, kk * 16, gq, c, dq);
  }
  T* out = dqkv + (size_t)b * g.T * rs + (size_t)h * g.hd;
#pragma unroll
  for (int n = 0; n < D / 8; n++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int row = r + FA_ROW(e), d = FA_COL(n, e);
      if (row < g.T && d < g.hd) out[(size_t)row * rs + d] = store_f<T>(dq[n][e] * g.scale);
    }
  if (c == 0)
#pragma unroll
    for (int i = 0; i < 2; i++) {
      const int row = r + 8 * i;
      if (row < g.T) {
        lse[(size_t)blockIdx.x * g.T + row] = ls[i];
        dvec[(size_t)blockIdx.x * g.T + row] = di[i];
      }
    }
}

template <typename T, int D>
__device__ void fa_bwd_kv(const T* qkv, const T* dy, T* dqkv, const float* lse, const float* dvec,
                          Geo g) {
  constexpr int BQ = 16, LDK = D + 8;
  __shared__ __align__(16) T Ks[ROWS * LDK];
  __shared__ __align__(16) T Vs[ROWS * LDK];
  __shared__ __align__(16) T Qs[BQ * LDK];
  __shared__ __align__(16) T Ds[BQ * LDK];
  __shared__ float Ls[BQ], Di[BQ];
  const int warp = threadIdx.x >> 5, gq = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
  const int b = blockIdx.x / g.H, h = blockIdx.x % g.H;
  const size_t rs = 3 * (size_t)g.C;
  const T* base = qkv + (size_t)b * g.T * rs + (size_t)h * g.hd;
  const T* dyb = dy + (size_t)b * g.T * g.C + (size_t)h * g.hd;
  const float* lu = lse + (size_t)blockIdx.x * g.T;
  const float* du = dvec + (size_t)blockIdx.x * g.T;
  const int k_block = blockIdx.y * ROWS, wk = warp * 16, k = k_block + wk + gq;
  load_tile<T, D, LDK>(base + g.C, rs, k_block, ROWS, g, Ks);
  load_tile<T, D, LDK>(base + 2 * g.C, rs, k_block, ROWS, g, Vs);
  const float sl2 = g.scale * 1.4426950408889634f;
  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; n++)
#pragma unroll
    for (int e = 0; e < 4; e++) dk[n][e] = dv[n][e] = 0.f;
  for (int q0 = k_block; q0 < g.T; q0 += BQ) {
    __syncthreads();
    load_tile<T, D, LDK>(base, rs, q0, BQ, g, Qs);
    load_tile<T, D, LDK>(dyb, g.C, q0, BQ, g, Ds);
    for (int e = threadIdx.x; e < BQ; e += blockDim.x) {
      const bool in = q0 + e < g.T;
      Ls[e] = in ? lu[q0 + e] : 0.f;
      Di[e] = in ? du[q0 + e] : 0.f;
    }
    __syncthreads();
    if (q0 + BQ - 1 < k_block + wk) continue;  // every query before every key of this warp
    // s^T = k q^T and dp^T = v dy^T: rows this warp's keys, columns the tile's queries.
    float s[BQ / 8][4], dp[BQ / 8][4];
#pragma unroll
    for (int j = 0; j < BQ / 8; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) s[j][e] = dp[j][e] = 0.f;
#pragma unroll
    for (int kc = 0; kc < D / 16; kc++) {
      const int col = kc * 16 + 2 * c;
      const int lo = (wk + gq) * LDK + col, hi = (wk + gq + 8) * LDK + col;
      const uint32_t ka[4] = {two(Ks, lo), two(Ks, hi), two(Ks, lo + 8), two(Ks, hi + 8)};
      const uint32_t va[4] = {two(Vs, lo), two(Vs, hi), two(Vs, lo + 8), two(Vs, hi + 8)};
#pragma unroll
      for (int j = 0; j < BQ / 8; j++) {
        const uint32_t bq[2] = {two(Qs, (j * 8 + gq) * LDK + col), two(Qs, (j * 8 + gq) * LDK + col + 8)};
        const uint32_t bd[2] = {two(Ds, (j * 8 + gq) * LDK + col), two(Ds, (j * 8 + gq) * LDK + col + 8)};
        mma(s[j], ka, bq, T());
        mma(dp[j], va, bd, T());
      }
    }
#pragma unroll
    for (int j = 0; j < BQ / 8; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int key = k + FA_ROW(e), qi = FA_COL(j, e), q = q0 + qi;
        const float p = (key <= q && q < g.T && key < g.T) ? exp2f(s[j][e] * sl2 - Ls[qi]) : 0.f;
        s[j][e] = p;
        dp[j][e] = p * (dp[j][e] - Di[qi]);
      }
    accumulate<T, D, LDK>(s, Ds, 0, gq, c, dv);
    accumulate<T, D, LDK>(dp, Qs, 0, gq, c, dk);
  }
  T* out = dqkv + (size_t)b * g.T * rs + (size_t)h * g.hd;
#pragma unroll
  for (int n = 0; n < D / 8; n++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int row = k + FA_ROW(e), d = FA_COL(n, e);
      if (row < g.T && d < g.hd) {
        out[(size_t)row * rs + g.C + d] = store_f<T>(dk[n][e] * g.scale);
        out[(size_t)row * rs + 2 * g.C + d] = store_f<T>(dv[n][e]);
      }
    }
}

#define FA_D(S, T, D) ATTN_ENTRIES(fa, 32 * WARPS, S, T, D)
#define FA(S, T) FA_D(S, T, 64) FA_D(S, T, 128)
FA(bf16, bf16)
FA(f16, f16)
