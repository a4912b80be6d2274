// Causal self-attention, flash-style, over a packed (batch, time, 3 C) q | k | v tensor
// (C = heads x head_dim, heads contiguous within each third), as the CPU twin
// (kernels/attention.rs): no (time x time) tensor is ever stored. Scores, the online softmax
// and every accumulator are f32 whatever the element type; inputs are widened as they are
// loaded into shared memory and each output is rounded once.
//
// Threads: R = 64 rows (queries, or keys in the key-side backward) per block, L = D / 16
// lanes per row, D the head dimension rounded up to 32, 64 or 128. A lane owns 16 of its row's
// D columns, as four float4 groups interleaved with the other lanes' (lane 4 + 4 L m, m < 4),
// so a row's lanes read consecutive float4s of a shared row (no bank conflicts) and a dot
// product is 16 multiply-adds per lane and a sum over the row's L adjacent lanes.
//
// Forward: block (unit = b H + h, query block) walks the key tiles up to its last query.
// Backward, two kernels with no atomics (deterministic): `attn_bwd_q` walks the key tiles
// twice, for each row's log-sum-exp and then for dq, and writes both and D_i = dy_i . y_i; then
// `attn_bwd_kv`, a block per key block, walks the query tiles from its first key on and writes
// dk and dv from them.
#include "attention.cuh"


constexpr int R = 64;

// `n` rows from `row0` of a head whose row 0 column 0 is `src` (rows `stride` apart) into
// sh[n][D] as f32, zero past row T or column hd.
template <typename T, int D>
__device__ __forceinline__ void load_rows(const T* src, size_t stride, int row0, int n, const Geo& g,
                                          float* sh) {
  for (int e = threadIdx.x; e < n * D; e += blockDim.x) {
    const int r = e / D, d = e % D, t = row0 + r;
    sh[e] = (t < g.T && d < g.hd) ? load_f(src[(size_t)t * stride + d]) : 0.f;
  }
}

template <int D> __device__ __forceinline__ int col(int lane, int m, int c) {
  return lane * 4 + 4 * (D / 16) * m + c;
}

// This lane's 16 columns of row t into a (zero past T or hd).
template <typename T, int D>
__device__ __forceinline__ void load_mine(const T* src, size_t stride, int t, int lane, const Geo& g,
                                          float* a) {
#pragma unroll
  for (int m = 0; m < 4; m++)
#pragma unroll
    for (int c = 0; c < 4; c++) {
      const int d = col<D>(lane, m, c);
      a[4 * m + c] = (t < g.T && d < g.hd) ? load_f(src[(size_t)t * stride + d]) : 0.f;
    }
}

template <typename T, int D>
__device__ __forceinline__ void store_mine(T* dst, size_t stride, int t, int lane, const Geo& g,
                                           const float* a, float k) {
  if (t >= g.T) return;
#pragma unroll
  for (int m = 0; m < 4; m++)
#pragma unroll
    for (int c = 0; c < 4; c++) {
      const int d = col<D>(lane, m, c);
      if (d < g.hd) dst[(size_t)t * stride + d] = store_f<T>(a[4 * m + c] * k);
    }
}

// This lane's part of a . row (row: D floats in shared memory).
template <int D> __device__ __forceinline__ float dot_part(const float* a, const float* row, int lane) {
  float s = 0.f;
#pragma unroll
  for (int m = 0; m < 4; m++) {
    const float4 v = *reinterpret_cast<const float4*>(row + col<D>(lane, m, 0));
    s += a[4 * m] * v.x + a[4 * m + 1] * v.y + a[4 * m + 2] * v.z + a[4 * m + 3] * v.w;
  }
  return s;
}

// a += k row (this lane's columns).
template <int D> __device__ __forceinline__ void axpy(float* a, float k, const float* row, int lane) {
#pragma unroll
  for (int m = 0; m < 4; m++) {
    const float4 v = *reinterpret_cast<const float4*>(row + col<D>(lane, m, 0));
    a[4 * m] += k * v.x;
    a[4 * m + 1] += k * v.y;
    a[4 * m + 2] += k * v.z;
    a[4 * m + 3] += k * v.w;
  }
}

// The sum over a row's L adjacent lanes.
template <int D> __device__ __forceinline__ float row_sum(float v) {
#pragma unroll
  for (int o = 1; o < D / 16; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename T, int D> __device__ void attn_fwd(const T* qkv, T* y, Geo g) {
  constexpr int BK = 32;
  __shared__ __align__(16) float Ks[BK * D];
  __shared__ __align__(16) float Vs[BK * D];
  const int b = blockIdx.x / g.H, h = blockIdx.x % g.H;
  const int lane = threadIdx.x % (D / 16), i = blockIdx.y * R + threadIdx.x / (D / 16);
  const size_t rs = 3 * (size_t)g.C;
  const T* base = qkv + (size_t)b * g.T * rs + (size_t)h * g.hd;
  float q[16], o[16];
  load_mine<T, D>(base, rs, i, lane, g, q);
#pragma unroll
  for (int k = 0; k < 16; k++) o[k] = 0.f;
  float m = -INFINITY, l = 0.f;
  const int last = min(g.T, (int)(blockIdx.y + 1) * R);
  for (int k0 = 0; k0 < last; k0 += BK) {
    __syncthreads();
    load_rows<T, D>(base + g.C, rs, k0, BK, g, Ks);
    load_rows<T, D>(base + 2 * g.C, rs, k0, BK, g, Vs);
    __syncthreads();
    float s[BK];
    float mt = m;
#pragma unroll
    for (int jj = 0; jj < BK; jj++) {
      const float v = row_sum<D>(dot_part<D>(q, Ks + jj * D, lane)) * g.scale;
      const int j = k0 + jj;
      s[jj] = (j <= i && j < g.T) ? v : -INFINITY;
      mt = fmaxf(mt, s[jj]);
    }
    const float corr = expf(m - mt);
    l *= corr;
#pragma unroll
    for (int k = 0; k < 16; k++) o[k] *= corr;
#pragma unroll
    for (int jj = 0; jj < BK; jj++) {
      const float p = expf(s[jj] - mt);
      l += p;
      axpy<D>(o, p, Vs + jj * D, lane);
    }
    m = mt;
  }
  store_mine<T, D>(y + (size_t)b * g.T * g.C + (size_t)h * g.hd, g.C, i, lane, g, o, 1.f / l);
}

template <typename T, int D>
__device__ void attn_bwd_q(const T* qkv, const T* y, const T* dy, T* dqkv, float* lse, float* dvec,
                           Geo g) {
  constexpr int BK = 32;
  __shared__ __align__(16) float Ks[BK * D];
  __shared__ __align__(16) float Vs[BK * D];
  const int b = blockIdx.x / g.H, h = blockIdx.x % g.H;
  const int lane = threadIdx.x % (D / 16), i = blockIdx.y * R + threadIdx.x / (D / 16);
  const size_t rs = 3 * (size_t)g.C;
  const T* base = qkv + (size_t)b * g.T * rs + (size_t)h * g.hd;
  const size_t yo = (size_t)b * g.T * g.C + (size_t)h * g.hd;
  float q[16], a[16];
  load_mine<T, D>(base, rs, i, lane, g, q);
  // Pass 1: the row's log-sum-exp, as the forward finds it.
  float m = -INFINITY, l = 0.f;
  const int last = min(g.T, (int)(blockIdx.y + 1) * R);
  for (int k0 = 0; k0 < last; k0 += BK) {
    __syncthreads();
    load_rows<T, D>(base + g.C, rs, k0, BK, g, Ks);
    __syncthreads();
    float s[BK];
    float mt = m;
#pragma unroll
    for (int jj = 0; jj < BK; jj++) {
      const float v = row_sum<D>(dot_part<D>(q, Ks + jj * D, lane)) * g.scale;
      const int j = k0 + jj;
      s[jj] = (j <= i && j < g.T) ? v : -INFINITY;
      mt = fmaxf(mt, s[jj]);
    }
    l *= expf(m - mt);
#pragma unroll
    for (int jj = 0; jj < BK; jj++) l += expf(s[jj] - mt);
    m = mt;
  }
  const float ls = m + logf(l);
  // D_i = dy_i . y_i
  load_mine<T, D>(y + yo, g.C, i, lane, g, a);
  float dO[16], di = 0.f;
  load_mine<T, D>(dy + yo, g.C, i, lane, g, dO);
#pragma unroll
  for (int k = 0; k < 16; k++) {
    di += dO[k] * a[k];
    a[k] = 0.f;
  }
  di = row_sum<D>(di);
  // Pass 2: dq = scale sum_j p_ij (dp_ij - D_i) k_j, into a.
  for (int k0 = 0; k0 < last; k0 += BK) {
    __syncthreads();
    load_rows<T, D>(base + g.C, rs, k0, BK, g, Ks);
    load_rows<T, D>(base + 2 * g.C, rs, k0, BK, g, Vs);
    __syncthreads();
    for (int jj = 0; jj < BK; jj++) {
      const float s = row_sum<D>(dot_part<D>(q, Ks + jj * D, lane)) * g.scale;
      const float dp = row_sum<D>(dot_part<D>(dO, Vs + jj * D, lane));
      const int j = k0 + jj;
      const float p = (j <= i && j < g.T) ? expf(s - ls) : 0.f;
      axpy<D>(a, p * (dp - di), Ks + jj * D, lane);
    }
  }
  store_mine<T, D>(dqkv + (size_t)b * g.T * rs + (size_t)h * g.hd, rs, i, lane, g, a, g.scale);
  if (lane == 0 && i < g.T) {
    const size_t at = (size_t)blockIdx.x * g.T + i;
    lse[at] = ls;
    dvec[at] = di;
  }
}

template <typename T, int D>
__device__ void attn_bwd_kv(const T* qkv, const T* dy, T* dqkv, const float* lse, const float* dvec,
                            Geo g) {
  constexpr int BQ = 32;
  __shared__ __align__(16) float Qs[BQ * D];
  __shared__ __align__(16) float Ds[BQ * D];
  __shared__ float Ls[BQ], Di[BQ];
  const int b = blockIdx.x / g.H, h = blockIdx.x % g.H;
  const int lane = threadIdx.x % (D / 16), j = blockIdx.y * R + threadIdx.x / (D / 16);
  const size_t rs = 3 * (size_t)g.C;
  const T* base = qkv + (size_t)b * g.T * rs + (size_t)h * g.hd;
  const T* dyb = dy + (size_t)b * g.T * g.C + (size_t)h * g.hd;
  const float* lu = lse + (size_t)blockIdx.x * g.T;
  const float* du = dvec + (size_t)blockIdx.x * g.T;
  float k[16], v[16], dk[16], dv[16];
  load_mine<T, D>(base + g.C, rs, j, lane, g, k);
  load_mine<T, D>(base + 2 * g.C, rs, j, lane, g, v);
#pragma unroll
  for (int c = 0; c < 16; c++) dk[c] = dv[c] = 0.f;
  for (int q0 = blockIdx.y * R; q0 < g.T; q0 += BQ) {
    __syncthreads();
    load_rows<T, D>(base, rs, q0, BQ, g, Qs);
    load_rows<T, D>(dyb, g.C, q0, BQ, g, Ds);
    for (int e = threadIdx.x; e < BQ; e += blockDim.x) {
      const bool in = q0 + e < g.T;
      Ls[e] = in ? lu[q0 + e] : 0.f;
      Di[e] = in ? du[q0 + e] : 0.f;
    }
    __syncthreads();
    for (int ii = 0; ii < BQ; ii++) {
      const int i = q0 + ii;
      const float s = row_sum<D>(dot_part<D>(k, Qs + ii * D, lane)) * g.scale;
      const float p = (j <= i && i < g.T && j < g.T) ? expf(s - Ls[ii]) : 0.f;
      axpy<D>(dv, p, Ds + ii * D, lane);
      const float dp = row_sum<D>(dot_part<D>(v, Ds + ii * D, lane));
      axpy<D>(dk, p * (dp - Di[ii]) * g.scale, Qs + ii * D, lane);
    }
  }
  T* out = dqkv + (size_t)b * g.T * rs + (size_t)h * g.hd;
  store_mine<T, D>(out + g.C, rs, j, lane, g, dk, 1.f);
  store_mine<T, D>(out + 2 * g.C, rs, j, lane, g, dv, 1.f);
}

#define ATTN_D(S, T, D) ATTN_ENTRIES(attn, 4 * D, S, T, D)
#define ATTN(S, T) ATTN_D(S, T, 32) ATTN_D(S, T, 64) ATTN_D(S, T, 128)
EACH_TYPE(ATTN)
