//! Context parallelism (sequences split over a ring of ranks, ring attention) and sequence
//! parallelism against serial training ([`pipewright_models::parity`]): the losses and
//! gradient norms of 5 clipped AdamW steps and the final parameters agree within 1e-5, as for
//! every other layout (with a ring: see [`CONTEXT_PARALLEL_TOLERANCE`]).

use pipewright::distributed::comm::local;
use pipewright::distributed::topology::Layout;
use pipewright::engine::varuna::VarunaOptions;
use pipewright_models::parity::{
    worst_difference, ParityRun, RankResult, CONTEXT_PARALLEL_TOLERANCE,
};

/// Every rank's result of `run` with `opts` on local threads.
fn parallel(run: &ParityRun, opts: VarunaOptions) -> Vec<RankResult> {
    let world = opts.topology().unwrap().world();
    local::run(world, |comm| run.rank(Box::new(comm), opts.clone())).unwrap()
}

fn layout(pp: usize, tp: usize, cp: usize, dp: usize) -> Layout {
    Layout::new(pp, tp, dp).unwrap().with_cp(cp).unwrap()
}

fn check(run: &ParityRun, opts: VarunaOptions, tol: f64) {
    let want = run.serial().unwrap();
    let l = opts.topology().unwrap().layout();
    for (rank, got) in parallel(run, opts).iter().enumerate() {
        let worst = worst_difference(got, &want).unwrap();
        assert!(worst < tol, "{l} rank {rank}: off by {worst:e}");
    }
}

const CP_TOL: f64 = CONTEXT_PARALLEL_TOLERANCE;

#[test]
fn context_parallel_layouts_train_as_serial() {
    let run = ParityRun::for_context_parallel();
    for l in [
        layout(1, 1, 2, 1),
        layout(2, 1, 2, 1),
        layout(2, 1, 2, 2),
        layout(1, 1, 4, 1),
    ] {
        check(&run, run.options(l), CP_TOL);
    }
}

#[test]
fn context_parallel_composes_with_tensor_and_data_parallel() {
    let run = ParityRun::for_context_parallel();
    check(&run, run.options(layout(1, 2, 2, 2)), CP_TOL);
}

#[test]
fn sequence_parallelism_trains_as_serial() {
    // With dropout (0.1): each rank draws its part of the serial run's masks.
    let run = ParityRun::default();
    for l in [layout(1, 2, 1, 1), layout(2, 2, 1, 1), layout(1, 2, 1, 2)] {
        let opts = run
            .options(l)
            .with_spec(|s| s.parallel.sequence_parallel = true);
        check(&run, opts, 1e-5);
    }
    // With a context-parallel ring: each rank's slice split again over tp.
    let run = ParityRun::for_context_parallel();
    let opts = run
        .options(layout(1, 2, 2, 1))
        .with_spec(|s| s.parallel.sequence_parallel = true);
    check(&run, opts, CP_TOL);
}
