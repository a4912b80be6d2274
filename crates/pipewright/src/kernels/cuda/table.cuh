// One launch over many tensors (the optimizer's phase of a step, where a launch per parameter
// cost more host time than the GPU's work): the host gives a table of items, each one tensor's
// buffers, its length and the first of the consecutive blocks it is given
// (kernels/gpu_table.rs); a block finds its item by binary search and walks that tensor's
// elements at the stride of the item's blocks, as a grid-stride loop over that tensor alone
// would. Items hold at least one element; their first blocks rise.
#pragma once
#include "common.cuh"

struct Item {
  unsigned long long p[6];   // the tensor's buffers, as each kernel says
  unsigned long long n;      // its elements
  unsigned long long first;  // its first block
  float k;                   // a number of the item's own (AdamW: its decay factor)
  int flag;                  // a switch of the item's own (AdamW: whether it decays)
};

// The item of block b: the last whose first block is at most b.
__device__ __forceinline__ int item_of(const Item* items, int count, unsigned long long b) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (items[mid].first <= b) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// The blocks item `at` is given (up to the next item's first, or the grid's end).
__device__ __forceinline__ unsigned long long item_blocks(const Item* items, int count, int at) {
  return (at + 1 < count ? items[at + 1].first : (unsigned long long)gridDim.x) - items[at].first;
}

// `for` each element index `i` of this block's share of its item `it` (a `const Item&`).
#define ITEM_LOOP(items, count, it, i)                                                          \
  const int it##_at = item_of(items, count, blockIdx.x);                                      \
  const Item& it = items[it##_at];                                                              \
  const unsigned long long it##_stride = item_blocks(items, count, it##_at) * blockDim.x;      \
  for (unsigned long long i = (blockIdx.x - it.first) * blockDim.x + threadIdx.x; i < it.n;   \
       i += it##_stride)
