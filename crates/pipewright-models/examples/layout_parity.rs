//! A layout under Open MPI against serial training: `mpirun -np N layout_parity PP TP DP
//! [ZERO [CP [SP]]]` (ZERO: the ZeRO stage, 0 by default; CP: context-parallel ranks, 1 by
//! default; SP: 1 for sequence parallelism). With CP > 1 or SP the run has sequences of 24
//! tokens and no dropout ([`ParityRun::for_context_parallel`]).
//! Every rank trains its part of a small GPT with the Varuna step (5 clipped AdamW steps) and
//! also trains the serial model, then compares losses, gradient norms and its parameters with
//! the serial ones. Rank 0 prints the worst relative difference and `1 passed, 0 failed` when
//! it is below 1e-5 (with CP > 1, [`CONTEXT_PARALLEL_TOLERANCE`]); any failure aborts the job.

use candle_core::{Device, Tensor};
use pipewright::distributed::comm::mpi::Mpi;
use pipewright::distributed::comm::{Communicator, ReduceOp};
use pipewright::distributed::topology::Layout;
use pipewright::parallel::zero::Zero;
use pipewright_models::parity::{worst_difference, ParityRun, CONTEXT_PARALLEL_TOLERANCE};

fn main() {
    let (_mpi, world) = match Mpi::init() {
        Ok(m) => m,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let rank = world.rank();
    let result = (|| -> pipewright::Result<Option<(f64, f64)>> {
        let usage = || pipewright::invalid!("usage: layout_parity PP TP DP [ZERO [CP [SP]]]");
        let mut args: Vec<usize> = std::env::args()
            .skip(1)
            .map(|a| a.parse().map_err(|_| usage()))
            .collect::<pipewright::Result<_>>()?;
        // ZERO 0, CP 1, SP 0 when left out.
        while (3..6).contains(&args.len()) {
            args.push([0, 1, 0][args.len() - 3]);
        }
        let [pp, tp, dp, zero, cp, sp] = args[..] else {
            return Err(usage());
        };
        let layout = Layout::new(pp, tp, dp)?.with_cp(cp)?;
        let zero = Zero::try_from(zero as u8)?;
        let run = if cp > 1 || sp == 1 {
            ParityRun::for_context_parallel()
        } else {
            ParityRun::default()
        };
        let want = run.serial()?;
        let all: Box<dyn Communicator> = world.split(&(0..world.size()).collect::<Vec<_>>())?;
        let opts = run.options(layout).with_spec(|s| {
            s.parallel.zero = zero;
            s.parallel.sequence_parallel = sp == 1;
        });
        let got = run.rank(Box::new(world), opts)?;
        let worst = worst_difference(&got, &want)?;
        let w = all.all_reduce(&Tensor::new(&[worst], &Device::Cpu)?, ReduceOp::Max)?;
        let worst = w.to_vec1::<f64>()?[0];
        let tol = if cp > 1 {
            CONTEXT_PARALLEL_TOLERANCE
        } else {
            1e-5
        };
        Ok((all.rank() == 0).then_some((worst, tol)))
    })();
    match result {
        Ok(Some((worst, tol))) if worst < tol => {
            println!("layout parity: every rank matches serial training within {worst:.2e}");
            println!("1 passed, 0 failed");
        }
        Ok(Some((worst, _))) => {
            println!("layout parity: a rank differs from serial training by {worst:.2e}");
            println!("0 passed, 1 failed");
            Mpi::abort(1);
        }
        Ok(None) => {}
        Err(e) => {
            eprintln!("error: rank {rank}: {e}");
            println!("0 passed, 1 failed");
            Mpi::abort(1);
        }
    }
}
