//! Gradient sums started during the backward (the default) give the bits of the sums after the
//! step (`--no-overlap`): the same losses, gradient norms, summed gradients and parameters, bit
//! for bit, at data-parallel layouts with pipeline and tensor parallelism, tied weights, more
//! than one micro-batch a replica, small buckets (many in flight at once), in f32 and bf16,
//! and with ZeRO-1 (whose gradients are whole too); and ZeRO-2's and ZeRO-3's reduce-scatters
//! kept in flight give the bits of waiting for each at once.

use candle_core::Tensor;
use pipewright::distributed::comm::local;
use pipewright::distributed::topology::Layout;
use pipewright::engine::varuna::VarunaOptions;
use pipewright::model::precision::Precision;
use pipewright::parallel::pipeline::ScheduleKind;
use pipewright::parallel::zero::Zero;
use pipewright_models::parity::{ParityRun, RankResult};

fn bits(t: &Tensor) -> Vec<u32> {
    let v: Vec<f32> = t
        .to_dtype(candle_core::DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    v.iter().map(|x| x.to_bits()).collect()
}

/// Every rank's result of `run` at `layout` with overlap on or off.
fn ranks(
    run: &ParityRun,
    layout: Layout,
    tweak: fn(&mut VarunaOptions),
    on: bool,
) -> Vec<RankResult> {
    let mut opts = run.options(layout);
    tweak(&mut opts);
    opts.spec.overlap.overlap = on;
    assert_eq!(opts.spec.cuts_last_forward(), on);
    local::run(layout.world(), |comm| {
        run.rank(Box::new(comm), opts.clone())
    })
    .unwrap()
}

fn same(what: &str, on: &[RankResult], off: &[RankResult]) {
    for (r, (a, b)) in on.iter().zip(off).enumerate() {
        let steps = |x: &RankResult| -> Vec<(u64, u64, bool)> {
            (x.steps.iter())
                .map(|(l, n, o)| (l.to_bits(), n.to_bits(), *o))
                .collect()
        };
        assert_eq!(
            steps(a),
            steps(b),
            "{what}, rank {r}: losses or norms differ"
        );
        for ((n, x), (m, y)) in a.params.iter().zip(&b.params) {
            assert_eq!(n, m);
            assert!(
                bits(x) == bits(y),
                "{what}, rank {r}: parameter {n} differs"
            );
        }
        for (s, (ga, gb)) in a.grads.iter().zip(&b.grads).enumerate() {
            for ((n, x), (_, y)) in ga.iter().zip(gb) {
                assert!(
                    bits(x) == bits(y),
                    "{what}, rank {r}: step {s}'s gradient of {n} differs"
                );
            }
        }
    }
}

#[test]
fn sums_during_the_backward_give_the_bits_of_sums_after_the_step() {
    let run = ParityRun {
        steps: 3,
        ..ParityRun::default()
    };
    fn plain(_: &mut VarunaOptions) {}
    // 16 KiB buckets: a dozen in flight at once.
    fn small_buckets(o: &mut VarunaOptions) {
        o.spec.overlap.bucket_bytes = 16 << 10;
    }
    fn bf16(o: &mut VarunaOptions) {
        o.spec.precision = Precision::Bf16;
        o.spec.overlap.bucket_bytes = 16 << 10;
    }
    fn zero1(o: &mut VarunaOptions) {
        o.spec.parallel.zero = Zero::OptimizerState;
    }
    fn zero2(o: &mut VarunaOptions) {
        o.spec.parallel.zero = Zero::Gradients;
        o.spec.overlap.bucket_bytes = 16 << 10;
    }
    fn zero3(o: &mut VarunaOptions) {
        o.spec.parallel.zero = Zero::Parameters;
        o.spec.overlap.bucket_bytes = 16 << 10;
    }
    fn zero2_bf16(o: &mut VarunaOptions) {
        zero2(o);
        o.spec.precision = Precision::Bf16;
    }
    type Case = (&'static str, (usize, usize, usize), fn(&mut VarunaOptions));
    let cases: [Case; 10] = [
        ("dp 2", (1, 1, 2), plain),
        ("dp 2, small buckets", (1, 1, 2), small_buckets),
        ("pp 2 x dp 2, small buckets", (2, 1, 2), small_buckets),
        ("tp 2 x dp 2", (1, 2, 2), plain),
        ("pp 2 x dp 2, bf16", (2, 1, 2), bf16),
        ("dp 2, ZeRO-1", (1, 1, 2), zero1),
        ("dp 2, ZeRO-2", (1, 1, 2), zero2),
        ("pp 2 x dp 2, ZeRO-2, bf16", (2, 1, 2), zero2_bf16),
        ("dp 2, ZeRO-3", (1, 1, 2), zero3),
        ("tp 2 x dp 2, ZeRO-3", (1, 2, 2), zero3),
    ];
    for (what, (pp, tp, dp), tweak) in cases {
        let layout = Layout::new(pp, tp, dp).unwrap();
        let on = ranks(&run, layout, tweak, true);
        let off = ranks(&run, layout, tweak, false);
        same(what, &on, &off);
    }
}

/// ZeRO-3's gathers ahead (`zero_live_layers` above 1) give the bits of gathering each layer
/// when it computes, plain and with two model stages a pipeline rank (where the guessed next
/// layer is sometimes another stage's, and is dropped).
#[test]
fn zero3_layers_gathered_ahead_give_the_bits_of_gathering_when_needed() {
    let run = ParityRun {
        steps: 3,
        ..ParityRun::default()
    };
    for (what, (pp, tp, dp), virtual_stages) in [
        ("dp 2", (1, 1, 2), 1),
        ("pp 2 x dp 2, two stages a rank", (2, 1, 2), 2),
    ] {
        let layout = Layout::new(pp, tp, dp).unwrap();
        let at = |live: usize| {
            let mut opts = run.options(layout);
            opts.spec.parallel.zero = Zero::Parameters;
            opts.spec.overlap.bucket_bytes = 16 << 10;
            if virtual_stages > 1 {
                opts.spec.pipeline.schedule.kind = ScheduleKind::Interleaved;
                opts.spec.pipeline.schedule.virtual_stages = virtual_stages;
            }
            opts.spec.overlap.zero_live_layers = live;
            local::run(layout.world(), |comm| {
                run.rank(Box::new(comm), opts.clone())
            })
            .unwrap()
        };
        let once = at(1);
        for live in [2, 3] {
            same(&format!("{what}, {live} live layers"), &at(live), &once);
        }
    }
}
