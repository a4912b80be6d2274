// Many tensors cast from one element type to another, each optionally times a factor, in one
// launch (table.cuh): a model's gradients into f32 (unscaled under loss scaling), clipping's
// scaling of them, the f32 masters into the model's parameters. Each value is widened to f32,
// multiplied and rounded to f32 as candle's `affine` rounds (x k + 0), then rounded once to
// the output type, as the per-tensor casts and products did. An item's buffers: p[0] the
// source, p[1] the destination (a fresh buffer or a parameter written in place).
// `add_f32_S`: gradient accumulation over micro-batches, each f32 sum so far plus the next
// gradient (type S) widened, into a new f32 sum: p[0] the sum, p[1] the gradient, p[2] the new
// sum (candle's f32 addition, rounded once).
#include "table.cuh"

template <typename S, typename D> __device__ void cast(const Item* items, int count, float k, int scaled) {
  ITEM_LOOP(items, count, it, i) {
    float v = load_f(reinterpret_cast<const S*>(it.p[0])[i]);
    if (scaled) v = __fadd_rn(__fmul_rn(v, k), 0.f);
    reinterpret_cast<D*>(it.p[1])[i] = store_f<D>(v);
  }
}

#define CAST_TO(SS, S, DS, D)                                                                  \
  extern "C" __global__ void cast_##SS##_##DS(const Item* items, int count, float k, int scaled) { \
    cast<S, D>(items, count, k, scaled);                                                       \
  }
#define CAST_FROM(SS, S) CAST_TO(SS, S, f32, float) CAST_TO(SS, S, bf16, bf16) CAST_TO(SS, S, f16, f16)
EACH_TYPE(CAST_FROM)

template <typename S> __device__ void add_to(const Item* items, int count) {
  ITEM_LOOP(items, count, it, i) {
    const float a = reinterpret_cast<const float*>(it.p[0])[i];
    reinterpret_cast<float*>(it.p[2])[i] = __fadd_rn(a, load_f(reinterpret_cast<const S*>(it.p[1])[i]));
  }
}

#define ADD(SS, S)                                                                              \
  extern "C" __global__ void add_f32_##SS(const Item* items, int count) { add_to<S>(items, count); }
EACH_TYPE(ADD)
