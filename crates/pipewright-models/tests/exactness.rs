//! The parity check itself, checked: at every layout family (pp, tp, dp, ZeRO 1-3, cp, sp
//! and products of them) a run of plain SGD gives the separate serial trainer's gradients,
//! tensor by tensor and step by step, and its parameters; and the same run fed a deliberate
//! 1 % error in one small tensor's gradient (the final LayerNorm's bias, 16 numbers of the
//! model's 10k) fails the comparison. Parameters after clipped AdamW and one global norm
//! (what the layout tests compared before) barely react to such an error.

use pipewright::distributed::comm::local;
use pipewright::distributed::topology::Layout;
use pipewright::engine::varuna::VarunaOptions;
use pipewright::parallel::zero::Zero;
use pipewright_models::parity::{
    worst_difference, worst_gradient, ParityRun, RankResult, Update, CONTEXT_PARALLEL_TOLERANCE,
};

/// The small tensor the deliberate error is made in.
const SMALL: &str = "ln_f.bias";

/// A family's name, its run (the context-parallel sizes where cp or sp is in it), layout and
/// ZeRO stage and sequence parallelism.
struct Family {
    name: &'static str,
    layout: Layout,
    zero: Zero,
    sp: bool,
}

fn families() -> Vec<Family> {
    let l = |pp, tp, dp| Layout::new(pp, tp, dp).unwrap();
    let f = |name, layout, zero, sp| Family {
        name,
        layout,
        zero,
        sp,
    };
    vec![
        f("pp 2", l(2, 1, 1), Zero::Off, false),
        f("tp 2", l(1, 2, 1), Zero::Off, false),
        f("dp 2", l(1, 1, 2), Zero::Off, false),
        f("dp 2 ZeRO-1", l(1, 1, 2), Zero::OptimizerState, false),
        f("dp 2 ZeRO-2", l(1, 1, 2), Zero::Gradients, false),
        f("dp 2 ZeRO-3", l(1, 1, 2), Zero::Parameters, false),
        f("cp 2", l(1, 1, 1).with_cp(2).unwrap(), Zero::Off, false),
        f("tp 2 sp", l(1, 2, 1), Zero::Off, true),
        f("pp 2 x tp 2", l(2, 2, 1), Zero::Off, false),
        f("pp 2 x dp 2 ZeRO-2", l(2, 1, 2), Zero::Gradients, false),
        f("tp 2 x dp 2 ZeRO-3", l(1, 2, 2), Zero::Parameters, false),
        f(
            "pp 2 x cp 2",
            l(2, 1, 1).with_cp(2).unwrap(),
            Zero::Off,
            false,
        ),
    ]
}

impl Family {
    fn run(&self, perturb: Option<(String, f64)>) -> ParityRun {
        let base = if self.layout.cp > 1 || self.sp {
            ParityRun::for_context_parallel()
        } else {
            ParityRun::default()
        };
        ParityRun {
            update: Update::Sgd,
            lr: 0.1,
            steps: 3,
            perturb,
            ..base
        }
    }

    fn options(&self, run: &ParityRun) -> VarunaOptions {
        let (zero, sp) = (self.zero, self.sp);
        run.options(self.layout).with_spec(|s| {
            s.parallel.zero = zero;
            s.parallel.sequence_parallel = sp;
        })
    }

    fn tolerance(&self) -> f64 {
        if self.layout.cp > 1 {
            CONTEXT_PARALLEL_TOLERANCE
        } else {
            1e-5
        }
    }

    fn ranks(&self, run: &ParityRun) -> Vec<RankResult> {
        let opts = self.options(run);
        local::run(self.layout.world(), |c| run.rank(Box::new(c), opts.clone())).unwrap()
    }
}

#[test]
fn every_layout_family_gives_serial_gradients_tensor_by_tensor() {
    for family in families() {
        let run = family.run(None);
        let want = run.serial().unwrap();
        for (rank, got) in family.ranks(&run).iter().enumerate() {
            let worst = worst_difference(got, &want).unwrap();
            let (g, at) = worst_gradient(got, &want).unwrap();
            assert!(
                worst < family.tolerance(),
                "{} rank {rank}: off by {worst:e} (gradients {g:e} at {at})",
                family.name
            );
        }
    }
}

#[test]
fn a_one_percent_error_in_one_small_gradient_fails_every_layout_family() {
    for family in families() {
        let want = family.run(None).serial().unwrap();
        let run = family.run(Some((SMALL.into(), 1.01)));
        let ranks = family.ranks(&run);
        // The ranks that hold the tensor (its stage; under ZeRO-2/3 its pieces) see it.
        let caught: Vec<(f64, String)> = ranks
            .iter()
            .map(|got| worst_gradient(got, &want).unwrap())
            .filter(|(d, _)| *d > family.tolerance())
            .collect();
        assert!(
            !caught.is_empty(),
            "{}: a 1 % error in `{SMALL}` went unseen",
            family.name
        );
        for (d, at) in &caught {
            assert!(at.contains(SMALL), "{}: {d:e} at {at}", family.name);
            assert!(*d > 1e-3, "{}: only {d:e} at {at}", family.name);
        }
    }
}
