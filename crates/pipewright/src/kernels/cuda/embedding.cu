// Embedding lookup and its deterministic backward, as the CPU twin (kernels/embedding.rs): the
// table's gradient row v is the f32 sum, in token order, of the output gradient rows of the
// tokens whose id is v. emb_count counts each id's tokens (integer atomics: the counts do not
// depend on the order), emb_scan turns the counts into each id's first place, emb_place puts
// token j at its id's first place plus the number of earlier tokens with its id (their order
// kept), and emb_sum gives each row a block that adds its tokens' rows in that order and writes
// the row (zeros for ids no token has). Past the placing kernel's size the tokens come in chunks:
// emb_sum_on adds a chunk's tokens to the f32 sums of the chunks before, and emb_round rounds
// the sums once at the end, so the sums are the same, in the same order.
#include "common.cuh"

template <typename T>
__device__ void emb_gather(const T* w, const uint32_t* ids, T* y, size_t total, size_t dim,
                           size_t rows) {
  GRID_STRIDE(i, total) {
    const size_t id = ids[i / dim];
    y[i] = id < rows ? w[id * dim + i % dim] : store_f<T>(0.f);
  }
}

extern "C" __global__ void emb_count_u32(const uint32_t* ids, uint32_t* count, size_t n) {
  GRID_STRIDE(j, n) atomicAdd(&count[ids[j]], 1u);
}

// One block of 1024 threads: thread t scans its consecutive share of the rows, then the
// threads' totals are scanned in shared memory.
extern "C" __global__ void emb_scan_u32(const uint32_t* count, uint32_t* start, size_t rows) {
  __shared__ uint32_t totals[1024];
  const size_t per = (rows + blockDim.x - 1) / blockDim.x;
  const size_t a = min(rows, threadIdx.x * per), b = min(rows, a + per);
  uint32_t s = 0;
  for (size_t v = a; v < b; v++) s += count[v];
  totals[threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t run = 0;
    for (unsigned t = 0; t < blockDim.x; t++) {
      const uint32_t c = totals[t];
      totals[t] = run;
      run += c;
    }
  }
  __syncthreads();
  uint32_t run = totals[threadIdx.x];
  for (size_t v = a; v < b; v++) {
    start[v] = run;
    run += count[v];
  }
}

// order[start[id_j] + #{i < j : ids[i] == id_j}] = j; the earlier ids read a tile at a time
// through shared memory.
extern "C" __global__ void emb_place_u32(const uint32_t* ids, const uint32_t* start,
                                         uint32_t* order, size_t n) {
  __shared__ uint32_t tile[256];
  const size_t j = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  const uint32_t id = j < n ? ids[j] : 0u;
  uint32_t rank = 0;
  const size_t last = min(n, (size_t)(blockIdx.x + 1) * blockDim.x);
  for (size_t base = 0; base < last; base += 256) {
    __syncthreads();
    if (base + threadIdx.x < n) tile[threadIdx.x] = ids[base + threadIdx.x];
    __syncthreads();
    const size_t upto = min((size_t)256, j > base ? j - base : 0);
    for (size_t k = 0; k < upto; k++) rank += tile[k] == id;
  }
  if (j < n) order[start[id] + rank] = (uint32_t)j;
}

// Each row's sum of its tokens, in their order, from `from` (f32: 0, or the sums of earlier
// tokens when they come in chunks), written to dw (T) or back into the f32 sums.
template <typename T, typename O>
__device__ void emb_sum(const T* g, const uint32_t* start, const uint32_t* count,
                        const uint32_t* order, const float* from, O* dw, size_t rows,
                        size_t dim) {
  for (size_t v = blockIdx.x; v < rows; v += gridDim.x) {
    const uint32_t s = start[v], c = count[v];
    for (size_t col = threadIdx.x; col < dim; col += blockDim.x) {
      float acc = from ? from[v * dim + col] : 0.f;
      for (uint32_t k = 0; k < c; k++) acc += load_f(g[(size_t)order[s + k] * dim + col]);
      dw[v * dim + col] = store_f<O>(acc);
    }
  }
}

#define EMB(S, T)                                                                                \
  extern "C" __global__ void emb_gather_##S(const T* w, const uint32_t* ids, T* y, size_t total, \
                                            size_t dim, size_t rows) {                           \
    emb_gather(w, ids, y, total, dim, rows);                                                     \
  }                                                                                              \
  extern "C" __global__ void emb_sum_##S(const T* g, const uint32_t* start,                      \
                                         const uint32_t* count, const uint32_t* order, T* dw,    \
                                         size_t rows, size_t dim) {                              \
    emb_sum<T, T>(g, start, count, order, nullptr, dw, rows, dim);                               \
  }                                                                                              \
  extern "C" __global__ void emb_sum_on_##S(const T* g, const uint32_t* start,                   \
                                            const uint32_t* count, const uint32_t* order,        \
                                            float* acc, size_t rows, size_t dim) {               \
    emb_sum<T, float>(g, start, count, order, acc, acc, rows, dim);                              \
  }                                                                                              \
  extern "C" __global__ void emb_round_##S(const float* acc, T* dw, size_t n) {                  \
    GRID_STRIDE(i, n) dw[i] = store_f<T>(acc[i]);                                                \
  }
EACH_TYPE(EMB)
