//! The NCCL backend (feature `nccl`). Without CUDA (CI, this project's machines) making a
//! communicator is a clear error, never a panic; where a GPU and NCCL are present, the same
//! test runs the conformance suite on one rank (the GPU smoke test:
//! `cargo test --release -p pipewright --features nccl --test nccl_probe`), with CPU tensors,
//! and again with tensors on the GPU when `PW_TEST_DEVICE=cuda` (a `cuda` build, where they
//! take the device path).
#![cfg(feature = "nccl")]

use pipewright::distributed::comm::nccl::{probe, NcclComm};
use pipewright::distributed::comm::{conformance, local};

#[test]
fn nccl_is_a_clear_error_without_cuda_or_passes_the_suite_with_it() {
    let available = probe();
    let outcome = local::run(1, |cpu| {
        Ok(match NcclComm::new(Box::new(cpu), 0) {
            Ok(nccl) => {
                let on_host = conformance::run_all(&nccl)?;
                let dev = pipewright::runtime::device::test_device()?;
                let on_device = if dev.is_cpu() {
                    0
                } else {
                    conformance::run_all_on(&nccl, &dev)?
                };
                println!("{on_host} passed with CPU tensors, {on_device} on {dev:?}");
                Ok(on_host + on_device)
            }
            Err(e) => Err(e.to_string()),
        })
    })
    .expect("no rank panics");
    match (available, &outcome[0]) {
        (Err(why), Err(msg)) => {
            assert_eq!(msg, &why.to_string());
            assert!(msg.contains("libcuda") || msg.contains("libnccl"), "{msg}");
            assert!(
                msg.contains("local or mpi backend") || msg.contains("LD_LIBRARY_PATH"),
                "{msg}"
            );
        }
        (Ok(()), Ok(passed)) => {
            assert!(*passed > 100, "{passed} checks");
            println!("{passed} passed, 0 failed (NCCL, one rank)");
        }
        (a, o) => panic!("probe says {a:?} but making the communicator gave {o:?}"),
    }
}
