// AdamW over one f32 parameter in one pass, as the CPU twin (kernels/adamw.rs): each line one
// of the composed update's tensor ops, rounded as they round (the _rn intrinsics: no fused
// multiply-adds, IEEE square root and division), so the GPU's trajectory is the CPU's bit for
// bit. The parameter is updated in place; the new moments go to fresh buffers m1 and v1
// (m0 and v0 may be those same buffers, zeroed, before the first step).
#include "common.cuh"

struct Coeffs {
  float decay, b1, c1, b2, c2, inv, eps, step;
  int has_decay;
};

extern "C" __global__ void adamw_f32(float* p, const float* g, const float* m0, const float* v0,
                                     float* m1, float* v1, size_t n, Coeffs c) {
  GRID_STRIDE(i, n) {
    float x = p[i];
    if (c.has_decay) x = __fadd_rn(__fmul_rn(x, c.decay), 0.f);
    const float gi = g[i];
    const float m = __fadd_rn(__fadd_rn(__fmul_rn(m0[i], c.b1), 0.f), __fadd_rn(__fmul_rn(gi, c.c1), 0.f));
    const float v = __fadd_rn(__fadd_rn(__fmul_rn(v0[i], c.b2), 0.f),
                              __fadd_rn(__fmul_rn(__fmul_rn(gi, gi), c.c2), 0.f));
    const float denom = __fadd_rn(__fmul_rn(__fadd_rn(__fmul_rn(__fsqrt_rn(v), c.inv), 0.f), 1.f), c.eps);
    p[i] = __fsub_rn(x, __fadd_rn(__fmul_rn(__fdiv_rn(m, denom), c.step), 0.f));
    m1[i] = m;
    v1[i] = v;
  }
}
