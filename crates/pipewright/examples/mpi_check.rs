//! The communicator conformance suite over Open MPI: `mpirun -np N mpi_check`.
//! Rank 0 prints the total as `P passed, F failed`; a failing rank aborts the whole job.
//! With `PIPEWRIGHT_DIE_RANK=R`, rank R dies at the start (as after an error) while the others
//! wait in a collective: `tools/mpi_peer_death.sh` checks the job then ends, naming rank R.

use candle_core::{DType, Device, Tensor};
use pipewright::distributed::comm::mpi::Mpi;
use pipewright::distributed::comm::{conformance, Communicator, ReduceOp};

fn main() {
    let (_mpi, world) = match Mpi::init() {
        Ok(m) => m,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let die: Option<usize> = std::env::var("PIPEWRIGHT_DIE_RANK")
        .ok()
        .and_then(|r| r.parse().ok());
    if die == Some(world.rank()) {
        eprintln!(
            "rank {}: failing on purpose (PIPEWRIGHT_DIE_RANK)",
            world.rank()
        );
        Mpi::abort(3);
    }
    let passed = match conformance::run_all(&world) {
        Ok(n) => n,
        Err(e) => {
            eprintln!("rank {}: {e}", world.rank());
            println!("0 passed, 1 failed");
            Mpi::abort(1);
        }
    };
    let total = Tensor::new(&[passed as i64], &Device::Cpu)
        .and_then(|t| t.to_dtype(DType::I64))
        .map_err(pipewright::Error::from)
        .and_then(|t| world.all_reduce(&t, ReduceOp::Sum))
        .and_then(|t| Ok(t.to_vec1::<i64>()?[0]));
    match total {
        Ok(total) if world.is_master() => {
            println!(
                "mpi conformance on {} ranks: {passed} checks per rank",
                world.size()
            );
            println!("{total} passed, 0 failed");
        }
        Ok(_) => {}
        Err(e) => {
            eprintln!("rank {}: {e}", world.rank());
            Mpi::abort(1);
        }
    }
}
