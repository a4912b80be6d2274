//! Matrix products by shape: the roofline's two regimes against their analytic times, a
//! product's share of the peak rising with its size, the fit recovering a known curve from
//! its timings, a hardware file carrying a measured curve through a save and a load, the
//! fused attention kernel's measured rate by sequence length, and the measured built-in files
//! holding nothing but the fit of their own timings.

use pipewright::plan::shapes::ShapeCost;
use pipewright::plan::{
    gemm_grid, AttentionKernel, AttentionRate, AttentionShape, AttentionTiming, Gemm, GemmCurve,
    GemmTiming, Hardware, LayerShapes, Linear, TpSplit,
};

/// A device of 100 TFLOP/s at 1 TB/s (ridge: 100 FLOPs a byte), 5 us a product, 2-byte values.
fn curve() -> GemmCurve {
    GemmCurve::new(100e12, 1e12, 5e-6, 2)
}

#[test]
fn a_thin_product_is_bound_by_memory_and_a_large_one_by_the_ceiling() {
    let c = curve();
    // 8192 tokens through an 8192 x 8 weight: 1.07 GFLOP over 134 MB (8 FLOPs a byte).
    let thin = Gemm::new(8192, 8, 8192);
    let bytes = (8192.0 * 8192.0 + 8192.0 * 8.0 + 8192.0 * 8.0) * 2.0;
    assert!(c.memory_bound(&thin));
    assert!((c.seconds(&thin) - (5e-6 + bytes / 1e12)).abs() < 1e-15);
    // 8192^3: 1.1 TFLOP over 403 MB (2731 FLOPs a byte).
    let large = Gemm::new(8192, 8192, 8192);
    assert!(!c.memory_bound(&large));
    let flops = 2.0 * 8192f64.powi(3);
    assert!((c.seconds(&large) - (5e-6 + flops / 100e12)).abs() < 1e-15);
    // Against a 200 TFLOP/s peak: the large one runs at nearly the ceiling's half, the thin one
    // at its intensity times the bandwidth.
    assert!((c.efficiency(&large, 200e12) - 0.5).abs() < 0.001);
    let thin_share = thin.flops() / (5e-6 + bytes / 1e12) / 200e12;
    assert!((c.efficiency(&thin, 200e12) - thin_share).abs() < 1e-12);
    assert!(thin_share < 0.05);
    // Batched: eight heads cost eight times one head's work and bytes, one overhead.
    let head = Gemm::new(2048, 2048, 128);
    let heads = Gemm { batch: 8, ..head };
    assert!((heads.flops() - 8.0 * head.flops()).abs() < 1.0);
    assert!(
        (c.seconds(&heads) - 5e-6 - 8.0 * (c.seconds(&head) - 5e-6)).abs() < 1e-15,
        "{} {}",
        c.seconds(&heads),
        c.seconds(&head)
    );
}

#[test]
fn a_products_share_of_the_peak_rises_with_its_size_towards_the_ceiling() {
    let c = curve();
    let shares: Vec<f64> = [16, 64, 256, 1024, 4096, 16384]
        .iter()
        .map(|&n| c.efficiency(&Gemm::new(n, n, n), 100e12))
        .collect();
    assert!(shares.windows(2).all(|w| w[1] > w[0]), "{shares:?}");
    assert!(shares[0] < 0.01 && shares[5] > 0.99, "{shares:?}");
}

#[test]
fn the_fit_recovers_the_curve_its_timings_came_from() {
    let truth = GemmCurve::new(2e11, 1e10, 2e-6, 4);
    // The grid's products, and one so small its time is the overhead alone.
    let mut shapes = gemm_grid(1);
    shapes.push(Gemm::new(1, 1, 1));
    let timings: Vec<GemmTiming> = shapes
        .iter()
        .map(|g| GemmTiming {
            gemm: *g,
            seconds: truth.seconds(g),
        })
        .collect();
    let fit = GemmCurve::fit(&timings, 4).unwrap();
    assert!(
        (fit.ceiling_flops_per_s / 2e11 - 1.0).abs() < 1e-3,
        "{fit:?}"
    );
    assert!(
        (fit.bandwidth_bytes_per_s / 1e10 - 1.0).abs() < 1e-3,
        "{fit:?}"
    );
    // The overhead is the fastest product's time: 2 us and its 6 FLOPs' bytes at 10 GB/s.
    assert!((fit.overhead_s - truth.seconds(&Gemm::new(1, 1, 1))).abs() < 1e-15);
    assert_eq!(fit.measured.len(), timings.len());
    for t in &timings {
        assert!(
            (fit.seconds(&t.gemm) / t.seconds - 1.0).abs() < 2e-3,
            "{t:?}"
        );
    }
}

#[test]
fn too_few_or_bad_timings_are_refused() {
    let t = |s: f64| GemmTiming {
        gemm: Gemm::new(64, 64, 64),
        seconds: s,
    };
    let err = GemmCurve::fit(&[t(1e-3), t(1e-3)], 4).unwrap_err();
    assert!(err.to_string().contains("3 timings or more"), "{err}");
    let err = GemmCurve::fit(&[t(1e-3), t(0.0), t(1e-3)], 4).unwrap_err();
    assert!(err.to_string().contains("positive seconds"), "{err}");
}

#[test]
fn a_measured_curve_survives_a_save_and_a_load() {
    let base = Hardware::load("h100-node").unwrap();
    let truth = GemmCurve::new(3e11, 2e10, 1e-6, 4);
    let timings: Vec<GemmTiming> = gemm_grid(1)
        .into_iter()
        .map(|g| GemmTiming {
            gemm: g,
            seconds: truth.seconds(&g),
        })
        .collect();
    let hw = base.with_measured_gemm(&timings, None, 4, "here").unwrap();
    assert!(hw.name.contains("products measured here"), "{}", hw.name);
    let path = std::env::temp_dir().join(format!("pw-gemm-hw-{}.json", std::process::id()));
    hw.save(&path).unwrap();
    let back = Hardware::load(path.to_str().unwrap()).unwrap();
    // (JSON keeps every number to its last digit or so: serde_json's reader may round one ulp.)
    let (a, b) = (back.gemm(false), hw.gemm_f32.clone().unwrap());
    let near = |x: f64, y: f64| (x / y - 1.0).abs() < 1e-12;
    assert!(near(a.ceiling_flops_per_s, b.ceiling_flops_per_s), "{a:?}");
    assert!(
        near(a.bandwidth_bytes_per_s, b.bandwidth_bytes_per_s),
        "{a:?}"
    );
    assert!(near(a.overhead_s, b.overhead_s), "{a:?}");
    assert_eq!(a.measured.len(), b.measured.len());
    assert!(a
        .measured
        .iter()
        .zip(&b.measured)
        .all(|(x, y)| x.gemm == y.gemm && near(x.seconds, y.seconds)));
    assert_eq!(back.name, hw.name);
    // Half precision keeps the file's own curve.
    assert_eq!(back.gemm(true), base.gemm(true));
    // A curve that cannot be is named.
    let text = std::fs::read_to_string(&path).unwrap().replacen(
        "\"ceiling_flops_per_s\": 3",
        "\"ceiling_flops_per_s\": -3",
        1,
    );
    let err = Hardware::parse(&text, "bad.json").unwrap_err();
    assert!(
        err.to_string()
            .contains("bad.json: gemm_f32: ceiling_flops_per_s must be positive"),
        "{err}"
    );
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn a_file_without_a_curve_uses_its_peak_and_efficiency() {
    let mut hw = Hardware::load("h100-node").unwrap();
    hw.gemm_half = None;
    let c = hw.gemm(true);
    assert_eq!(c.ceiling_flops_per_s, 989e12 * 0.5);
    assert_eq!(c.bandwidth_bytes_per_s, hw.memory_bandwidth_bytes_per_s);
    assert_eq!((c.overhead_s, c.dtype_bytes), (0.0, 2));
}

/// Tensor parallelism thins a layer's products: at tp 8 a block of width 1024 runs each
/// product at a smaller share of the peak than at tp 1, so its per-rank time is more than an
/// eighth of tp 1's (a flat efficiency would say exactly an eighth).
#[test]
fn tensor_parallel_shards_of_a_narrow_model_cost_more_than_their_share() {
    let hw = Hardware::load("h100-node").unwrap();
    let c = hw.gemm(true);
    let d = 1024;
    let block = LayerShapes {
        tokens: 1024,
        linear: vec![
            Linear {
                inputs: d,
                outputs: 3 * d,
                split: TpSplit::Columns,
            },
            Linear {
                inputs: d,
                outputs: d,
                split: TpSplit::Rows,
            },
        ],
        attention: None::<AttentionKernel>,
        elementwise_whole_bytes: 0.0,
        elementwise_split_bytes: 0.0,
    };
    let at = |tp| block.cost(None, &c, 3e12, 1, tp, 1, false).total();
    let (one, eight) = (at(1), at(8));
    assert!(eight > one / 8.0 * 1.2, "{one} {eight}");
    // A wide model's shards keep nearer their share.
    let wide = LayerShapes {
        linear: block
            .linear
            .iter()
            .map(|l| Linear {
                inputs: l.inputs * 8,
                outputs: l.outputs * 8,
                split: l.split,
            })
            .collect(),
        ..block.clone()
    };
    let at = |tp| wide.cost(None, &c, 3e12, 1, tp, 1, false).total();
    let wide_ratio = at(8) / (at(1) / 8.0);
    assert!(wide_ratio < eight / (one / 8.0), "{wide_ratio}");
}

fn timing(seq: usize, forward_s: f64) -> AttentionTiming {
    AttentionTiming {
        pairs: 2,
        seq,
        head_dim: 32,
        forward_s,
        backward_s: 3.0 * forward_s,
    }
}

/// What a layer of nothing but fused attention (`heads` of `head_dim` over 2048 tokens, `rows`
/// of them) costs on a curve that carries `rate` (and no product overhead).
fn fused_attention_cost(
    rate: AttentionRate,
    heads: usize,
    head_dim: usize,
    rows: usize,
) -> ShapeCost {
    let mut c = GemmCurve::new(1e12, 1e11, 0.0, 2);
    c.attention = Some(rate);
    let layer = LayerShapes {
        tokens: 2048,
        linear: Vec::new(),
        attention: Some(AttentionKernel::Fused),
        elementwise_whole_bytes: 0.0,
        elementwise_split_bytes: 0.0,
    };
    let a = AttentionShape {
        heads,
        kv_heads: heads,
        head_dim,
        seq: 2048,
    };
    layer.cost(Some(&a), &c, 1e11, rows, 1, 1, false)
}

/// The fused kernel's rate is read off its timings by sequence: exact at a timed length,
/// log-log between two, flat beyond the ends; its backward the timed multiple (here the same
/// at every length).
#[test]
fn the_fused_attention_rate_is_read_off_its_timings_by_length() {
    // 2 pairs of width 32: 2 x 2 x 32 x seq^2 FLOPs; 100 GFLOP/s at 1024 tokens, 25 at 4096.
    let work = |seq: usize| 128.0 * (seq as f64).powi(2);
    let r = AttentionRate::fit(&[
        timing(4096, work(4096) / 25e9),
        timing(1024, work(1024) / 100e9),
    ])
    .unwrap();
    assert!((r.backward_ratio - 3.0).abs() < 1e-12);
    let near = |a: f64, b: f64| (a / b - 1.0).abs() < 1e-9;
    let rate = |seq| r.flops_per_s(seq, 32);
    assert!(near(rate(1024), 100e9) && near(rate(4096), 25e9));
    // Half way in log length, half way in log rate.
    assert!(near(rate(2048), 50e9), "{}", rate(2048));
    assert!(near(rate(256), 100e9) && near(rate(65536), 25e9));
    assert!(near(
        r.forward_seconds(8, 2048, 64),
        2.0 * 8.0 * 64.0 * 2048f64.powi(2) / 50e9
    ));

    // A layer's fused attention on a curve that carries the rate: forward at the rate, backward
    // the multiple.
    let k = fused_attention_cost(r.clone(), 2, 32, 3);
    assert!(
        near(k.forward, 2.0 * 6.0 * 32.0 * 2048f64.powi(2) / 50e9),
        "{k:?}"
    );
    assert!(near(k.backward_input, 3.0 * k.forward) && k.backward_weight == 0.0);

    let err = AttentionRate::fit(&[timing(1024, 0.0)]).unwrap_err();
    assert!(err.to_string().contains("positive seconds"), "{err}");
}

/// Flash attention's rates differ by head width and its backward's multiple by length (an
/// H200: 227 and 334 TFLOP/s at 1024 tokens in heads of 64 and 128; backward 4.6 times the
/// forward at 1024 tokens, 3.1 at 8192): a layer reads the timings at the timed width nearest
/// its own, forward and backward each at its own rate by length.
#[test]
fn attention_rates_are_read_at_the_nearest_head_width_forward_and_backward_apart() {
    let work = |seq: usize, d: usize| 2.0 * 8.0 * d as f64 * (seq as f64).powi(2);
    // Width 64: 200 TFLOP/s forward at 1024 tokens (backward 4x), 400 at 4096 (backward 2x);
    // width 128: 300 forward at every length, backward 3x.
    let t = |seq, d, rate: f64, ratio: f64| AttentionTiming {
        pairs: 8,
        seq,
        head_dim: d,
        forward_s: work(seq, d) / rate,
        backward_s: ratio * work(seq, d) / rate,
    };
    let r = AttentionRate::fit(&[
        t(1024, 64, 200e12, 4.0),
        t(4096, 64, 400e12, 2.0),
        t(1024, 128, 300e12, 3.0),
        t(4096, 128, 300e12, 3.0),
    ])
    .unwrap();
    let near = |a: f64, b: f64| (a / b - 1.0).abs() < 1e-9;
    // Timed widths read their own timings.
    assert!(near(r.flops_per_s(1024, 64), 200e12) && near(r.flops_per_s(1024, 128), 300e12));
    // 80 is nearer 64 (x1.25) than 128 (x1.6); 96 nearer 128 (x1.33 against x1.5); 32 and
    // 1024 take the ends.
    assert!(near(r.flops_per_s(1024, 80), 200e12) && near(r.flops_per_s(1024, 96), 300e12));
    assert!(near(r.flops_per_s(4096, 32), 400e12) && near(r.flops_per_s(4096, 1024), 300e12));
    // The backward at its own rate by length: 50 TFLOP/s at 1024, 200 at 4096, so 100 at 2048
    // (half way in log length, half way in log rate), where the forward runs at 283.
    let pairs = 8;
    assert!(near(
        r.backward_seconds(pairs, 1024, 64),
        4.0 * r.forward_seconds(pairs, 1024, 64)
    ));
    assert!(near(
        r.backward_seconds(pairs, 2048, 64),
        work(2048, 64) / 100e12
    ));
    assert!(near(
        r.forward_seconds(pairs, 2048, 64),
        work(2048, 64) / (200e12 * 400e12f64).sqrt()
    ));
    assert!(near(
        r.backward_seconds(pairs, 2048, 128),
        3.0 * r.forward_seconds(pairs, 2048, 128)
    ));
    // A layer of 8 heads of 64 over 2048 tokens (one row) costs its backward at that rate.
    let k = fused_attention_cost(r, 8, 64, 1);
    assert!(near(k.backward_input, work(2048, 64) / 100e12), "{k:?}");
}

/// The built-in files measured on a device (`h200-node` on an H200, `cpu-2core` here) carry
/// the timings their curves were fitted to; each curve and attention rate must be what the fit
/// makes of those timings (to the 3 or 4 digits `cpu-2core` was written with), so no number in them
/// was tuned by hand after measuring.
#[test]
fn measured_built_in_curves_are_the_fit_of_their_own_timings() {
    let near = |x: f64, y: f64| (x / y - 1.0).abs() < 5e-3;
    for name in ["h200-node", "cpu-2core"] {
        let hw = Hardware::load(name).unwrap();
        for curve in [hw.gemm_f32.as_ref(), hw.gemm_half.as_ref()] {
            let c = curve.unwrap_or_else(|| panic!("{name} has both curves"));
            let refit = GemmCurve::fit(&c.measured, c.dtype_bytes).unwrap();
            for (file, fit) in [
                (c.ceiling_flops_per_s, refit.ceiling_flops_per_s),
                (c.bandwidth_bytes_per_s, refit.bandwidth_bytes_per_s),
                (c.overhead_s, refit.overhead_s),
            ] {
                assert!(near(file, fit), "{name}: {file} in the file, {fit} fitted");
            }
            if let Some(a) = &c.attention {
                let refit = AttentionRate::fit(&a.measured).unwrap();
                assert!(near(a.backward_ratio, refit.backward_ratio), "{name}");
            }
        }
    }
    // The H200's half-precision curve carries flash attention's rates, at both head widths.
    let h200 = Hardware::load("h200-node").unwrap().gemm(true);
    let widths: Vec<usize> = h200
        .attention
        .unwrap()
        .measured
        .iter()
        .map(|t| t.head_dim)
        .collect();
    assert!(widths.contains(&64) && widths.contains(&128), "{widths:?}");
}
