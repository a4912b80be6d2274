// AdamW over f32 parameters, every parameter of a step in one launch (table.cuh), as the CPU
// twin (kernels/adamw.rs): each line one of the composed update's tensor ops, rounded as they
// round (the _rn intrinsics: no fused multiply-adds, IEEE square root and division), so the
// GPU's trajectory is the CPU's bit for bit. An item's buffers: p[0] the parameter (updated in
// place), p[1] its f32 gradient, p[2] and p[3] the moments before, p[4] and p[5] the new ones
// (p[2] may be p[4] and p[3] p[5], zeroed, before the first step); k its decay factor, applied
// when flag is set.
#include "table.cuh"

struct Coeffs {
  float b1, c1, b2, c2, inv, eps, step;
};

extern "C" __global__ void adamw_f32(const Item* items, int count, Coeffs c) {
  ITEM_LOOP(items, count, it, i) {
    float* p = reinterpret_cast<float*>(it.p[0]);
    const float gi = reinterpret_cast<const float*>(it.p[1])[i];
    const float m0 = reinterpret_cast<const float*>(it.p[2])[i];
    const float v0 = reinterpret_cast<const float*>(it.p[3])[i];
    float x = p[i];
    if (it.flag) x = __fadd_rn(__fmul_rn(x, it.k), 0.f);
    const float m = __fadd_rn(__fadd_rn(__fmul_rn(m0, c.b1), 0.f), __fadd_rn(__fmul_rn(gi, c.c1), 0.f));
    const float v = __fadd_rn(__fadd_rn(__fmul_rn(v0, c.b2), 0.f),
                              __fadd_rn(__fmul_rn(__fmul_rn(gi, gi), c.c2), 0.f));
    const float denom = __fadd_rn(__fmul_rn(__fadd_rn(__fmul_rn(__fsqrt_rn(v), c.inv), 0.f), 1.f), c.eps);
    p[i] = __fsub_rn(x, __fadd_rn(__fmul_rn(__fdiv_rn(m, denom), c.step), 0.f));
    reinterpret_cast<float*>(it.p[4])[i] = m;
    reinterpret_cast<float*>(it.p[5])[i] = v;
  }
}
