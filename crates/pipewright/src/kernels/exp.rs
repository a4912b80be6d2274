//! `exp` over a slice, vectorised: the scalar `expf` of libm was the largest cost of the
//! softmax, attention, cross-entropy and GELU kernels. Two branch-free polynomials the
//! compiler vectorises, each compiled for AVX-512 and AVX2 as well as the baseline and chosen
//! at run time: Cephes' single-precision one (about 1 ulp) for softmax-like sums, and one
//! evaluated in f64 and rounded once (as exact as libm's `expf`) for GELU, whose small
//! outputs feed weight gradients where Adam turns a one-ulp difference into a visible one.

/// `x[i] = exp(x[i])` for every element (f32: vectorised polynomials; f64: libm).
pub(crate) trait ExpSlice: Sized {
    /// About 1 ulp.
    fn exp_slice(x: &mut [Self]);
    /// Correctly rounded but for rare ties (f32 through f64).
    fn exp_slice_exact(x: &mut [Self]);
}

impl ExpSlice for f64 {
    fn exp_slice(x: &mut [f64]) {
        x.iter_mut().for_each(|v| *v = v.exp());
    }

    fn exp_slice_exact(x: &mut [f64]) {
        Self::exp_slice(x)
    }
}

macro_rules! multiversion {
    ($name:ident, $body:ident) => {
        fn $name(x: &mut [f32]) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn avx512(x: &mut [f32]) {
                    $body(x)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2(x: &mut [f32]) {
                    $body(x)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has AVX-512F.
                    return unsafe { avx512(x) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the CPU has AVX2 and FMA.
                    return unsafe { avx2(x) };
                }
            }
            $body(x)
        }
    };
}

multiversion!(exp_fast, exp_all);
multiversion!(exp_exact, exp_all_exact);

#[inline(always)]
fn exp_all_exact(x: &mut [f32]) {
    for v in x.iter_mut() {
        *v = exp_via_f64(*v);
    }
}

/// e^x evaluated in f64 (relative error below 1e-11) and rounded to f32 once; inputs clamped
/// to [-87.3, 88.7] as [`exp`]'s.
#[inline(always)]
pub(crate) fn exp_via_f64(x: f32) -> f32 {
    const ROUND: f64 = 6_755_399_441_055_744.0; // 1.5 * 2^52
    let x = x.clamp(-87.3, 88.7) as f64;
    let n = (x * std::f64::consts::LOG2_E + ROUND) - ROUND;
    let r = x - n * std::f64::consts::LN_2;
    // Taylor to r^9: |r| <= ln(2) / 2 leaves a relative error below 1e-11, far under half an
    // f32 ulp (3e-8), so the one rounding to f32 is almost always libm's.
    let mut p = 1.0 / 362_880.0;
    for c in [
        1.0 / 40_320.0,
        1.0 / 5_040.0,
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = p * r + c;
    }
    // SAFETY: n is an integer in [-126, 128] (x was clamped). Unchecked, the conversion
    // vectorises (`as` saturates, lane by lane); through i32, as AVX-512F converts f64 lanes to
    // i32 ones (to i64 needs AVX-512DQ).
    let n = unsafe { n.to_int_unchecked::<i32>() };
    (p * f64::from_bits(((n + 1023) as u64) << 52)) as f32
}

impl ExpSlice for f32 {
    fn exp_slice(x: &mut [f32]) {
        exp_fast(x)
    }

    fn exp_slice_exact(x: &mut [f32]) {
        exp_exact(x)
    }
}

#[inline(always)]
fn exp_all(x: &mut [f32]) {
    for v in x.iter_mut() {
        *v = exp(*v);
    }
}

/// e^x, within about 1 ulp for x in [-87.3, 88.7]; inputs outside are clamped there (so tiny
/// results are about 1e-38 rather than 0, and huge ones about 3e38 rather than infinity).
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.3, 88.7);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = x - n * C1 - n * C2;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // SAFETY: n is an integer in [-126, 128] (x was clamped); unchecked, the conversion
    // vectorises (`as` saturates, lane by lane).
    let n = unsafe { n.to_int_unchecked::<i32>() };
    y * f32::from_bits(((n + 127) as u32) << 23)
}

#[cfg(test)]
mod tests {
    #[test]
    fn within_two_ulp_of_libm() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (got, want) = (super::exp(x), x.exp());
            worst = worst.max(((got - want) / want).abs() as f64);
            x += 0.013;
        }
        assert!(worst < 2.0 * f32::EPSILON as f64, "relative error {worst}");
    }

    #[test]
    fn the_exact_one_is_libm_but_for_rare_ties() {
        let (mut differ, mut n) = (0, 0);
        let mut x = -87.0f32;
        while x < 88.0 {
            let (got, want) = (super::exp_via_f64(x), x.exp());
            assert!(
                ((got - want) / want).abs() <= f32::EPSILON,
                "exp({x}) = {got}, libm {want}"
            );
            differ += usize::from(got != want);
            n += 1;
            x += 0.0013;
        }
        assert!(differ * 1000 < n, "{differ} of {n} differ from libm");
    }
}
