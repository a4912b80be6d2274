//! Collectives of the local (threads) backend against references computed on one thread.

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use pipewright::distributed::comm::local::{run, run_with_timeout};
use pipewright::distributed::comm::progress::Progress;
use pipewright::distributed::comm::{conformance, Communicator, Pending, ReduceOp};

#[test]
fn conformance_suite_for_worlds_of_1_to_8() {
    for world in 1..=8 {
        let passed = run(world, |c| conformance::run_all(&c)).unwrap();
        assert!(
            passed.iter().all(|&p| p == passed[0] && p > 100),
            "world {world}: {passed:?}"
        );
    }
}

#[test]
fn reductions_are_bit_identical_on_every_rank() {
    let res = run(5, |c| {
        let v: Vec<f32> = (0..1000)
            .map(|i| ((i * 31 + c.rank() * 17) as f32).sin() * 1e-3)
            .collect();
        let t = Tensor::from_vec(v, 1000, &Device::Cpu)?;
        Ok(c.all_reduce(&t, ReduceOp::Sum)?
            .to_vec1::<f32>()?
            .iter()
            .map(|x| x.to_bits())
            .collect::<Vec<_>>())
    })
    .unwrap();
    assert!(res.windows(2).all(|w| w[0] == w[1]));
}

#[test]
fn parameters_are_copied_not_shared() {
    run(2, |c| {
        if c.rank() == 0 {
            let v = candle_core::Var::new(&[1f32, 2.0], &Device::Cpu)?;
            c.send(v.as_tensor(), 1, 0)?;
            v.set(&Tensor::new(&[9f32, 9.0], &Device::Cpu)?)?;
            c.barrier()?;
        } else {
            let t = c.recv(0, 0)?;
            c.barrier()?;
            assert_eq!(t.to_vec1::<f32>()?, vec![1.0, 2.0]);
        }
        Ok(())
    })
    .unwrap();
}

fn err_of<T>(r: pipewright::Result<T>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_ranks_and_tags_are_errors() {
    run(2, |c| {
        let t = Tensor::zeros(1, DType::F32, &Device::Cpu)?;
        assert!(err_of(c.send(&t, 2, 0)).contains("outside this group of 2 ranks"));
        assert!(err_of(c.recv(7, 0)).contains("names rank 7"));
        assert!(err_of(c.send(&t, 1, u64::MAX)).contains("too large"));
        assert!(err_of(c.split(&[1, 1])).contains("distinct"));
        assert!(
            c.split(&[1 - c.rank()]).is_err(),
            "a rank outside the members"
        );
        assert!(err_of(
            c.reduce_scatter(&Tensor::zeros(3, DType::F32, &Device::Cpu)?, ReduceOp::Sum)
        )
        .contains("does not split into 2"));
        Ok(())
    })
    .unwrap();
}

#[test]
fn a_dead_peer_fails_every_waiting_rank_quickly() {
    let start = Instant::now();
    let e = run(4, |c| {
        if c.rank() == 1 {
            return Err(pipewright::Error::Invalid("out of data".into()));
        }
        if c.rank() == 3 {
            c.recv(1, 0)?; // waits for a message rank 1 never sends
        }
        c.barrier()?;
        Ok(())
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("rank 1 failed: out of data"), "{e}");
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "took {:?}",
        start.elapsed()
    );
    // A panic is a failure too.
    let e = run(2, |c| {
        if c.rank() == 0 {
            panic!("boom");
        }
        c.barrier()
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("rank 0 failed: panicked: boom"), "{e}");
}

#[test]
fn a_silent_peer_times_out_naming_it() {
    let start = Instant::now();
    let errs = run_with_timeout(2, Duration::from_millis(300), |c| {
        Ok(if c.rank() == 0 {
            Some(err_of(c.recv(1, 3)))
        } else {
            None
        })
    })
    .unwrap();
    let e = errs[0].as_ref().unwrap();
    assert!(e.contains("rank 0: recv from rank 1 timed out"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(5));
}

/// The local backend with every call passed on but all_to_all, which takes the trait's
/// default (through all_gather): the path of backends without a native exchange (NCCL).
struct Gathering(Box<dyn Communicator>);

impl Communicator for Gathering {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn size(&self) -> usize {
        self.0.size()
    }
    fn backend(&self) -> &'static str {
        "gathering"
    }
    fn send(&self, t: &Tensor, dst: usize, tag: u64) -> pipewright::Result<()> {
        self.0.send(t, dst, tag)
    }
    fn recv(&self, src: usize, tag: u64) -> pipewright::Result<Tensor> {
        self.0.recv(src, tag)
    }
    fn isend(&self, t: &Tensor, dst: usize, tag: u64) -> pipewright::Result<Pending<()>> {
        self.0.isend(t, dst, tag)
    }
    fn irecv(&self, src: usize, tag: u64) -> pipewright::Result<Pending<Tensor>> {
        self.0.irecv(src, tag)
    }
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> pipewright::Result<Tensor> {
        self.0.all_reduce(t, op)
    }
    fn all_gather(&self, t: &Tensor) -> pipewright::Result<Vec<Tensor>> {
        self.0.all_gather(t)
    }
    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> pipewright::Result<Tensor> {
        self.0.reduce_scatter(t, op)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> pipewright::Result<Tensor> {
        self.0.broadcast(t, root)
    }
    fn barrier(&self) -> pipewright::Result<()> {
        self.0.barrier()
    }
    fn split(&self, members: &[usize]) -> pipewright::Result<Box<dyn Communicator>> {
        Ok(Box::new(Gathering(self.0.split(members)?)))
    }
}

#[test]
fn all_to_all_through_all_gather_passes_the_suite() {
    for world in [1, 2, 3, 5] {
        let passed = run(world, |c| conformance::run_all(&Gathering(Box::new(c)))).unwrap();
        assert!(
            passed.iter().all(|&p| p == passed[0] && p > 100),
            "world {world}: {passed:?}"
        );
    }
}

/// The local backend with its non-blocking collectives on a communication thread
/// ([`Progress`], as Open MPI's run): the engine MPI uses, checked here without MPI.
struct Threaded {
    comm: Box<dyn Communicator>,
    progress: Progress,
}

impl Threaded {
    fn new(comm: Box<dyn Communicator>) -> pipewright::Result<Self> {
        let own = comm.split(&(0..comm.size()).collect::<Vec<_>>())?;
        Ok(Self {
            comm,
            progress: Progress::new(own)?,
        })
    }
}

impl Communicator for Threaded {
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn size(&self) -> usize {
        self.comm.size()
    }
    fn backend(&self) -> &'static str {
        "local with a communication thread"
    }
    fn send(&self, t: &Tensor, dst: usize, tag: u64) -> pipewright::Result<()> {
        self.comm.send(t, dst, tag)
    }
    fn recv(&self, src: usize, tag: u64) -> pipewright::Result<Tensor> {
        self.comm.recv(src, tag)
    }
    fn isend(&self, t: &Tensor, dst: usize, tag: u64) -> pipewright::Result<Pending<()>> {
        self.comm.isend(t, dst, tag)
    }
    fn irecv(&self, src: usize, tag: u64) -> pipewright::Result<Pending<Tensor>> {
        self.comm.irecv(src, tag)
    }
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> pipewright::Result<Tensor> {
        self.comm.all_reduce(t, op)
    }
    fn iall_reduce(&self, t: &Tensor, op: ReduceOp) -> pipewright::Result<Pending<Tensor>> {
        self.progress.all_reduce(t, op)
    }
    fn all_gather(&self, t: &Tensor) -> pipewright::Result<Vec<Tensor>> {
        self.comm.all_gather(t)
    }
    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> pipewright::Result<Tensor> {
        self.comm.reduce_scatter(t, op)
    }
    fn ireduce_scatter(&self, t: &Tensor, op: ReduceOp) -> pipewright::Result<Pending<Tensor>> {
        self.progress.reduce_scatter(t, op)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> pipewright::Result<Tensor> {
        self.comm.broadcast(t, root)
    }
    fn barrier(&self) -> pipewright::Result<()> {
        self.comm.barrier()
    }
    fn split(&self, members: &[usize]) -> pipewright::Result<Box<dyn Communicator>> {
        Ok(Box::new(Threaded::new(self.comm.split(members)?)?))
    }
}

#[test]
fn collectives_on_a_communication_thread_pass_the_suite() {
    for world in [1, 2, 3, 5] {
        let passed = run(world, |c| {
            conformance::run_all(&Threaded::new(Box::new(c))?)
        })
        .unwrap();
        assert!(
            passed.iter().all(|&p| p == passed[0] && p > 100),
            "world {world}: {passed:?}"
        );
    }
}

/// A non-blocking sum started before a rank computes for a while returns while the others
/// wait on theirs: several in flight, waited on in any order, each the blocking sum's bits.
#[test]
fn non_blocking_sums_waited_out_of_order_are_the_blocking_sums() {
    run(3, |c| {
        let t = |k: usize| -> pipewright::Result<Tensor> {
            let v: Vec<f32> = (0..999)
                .map(|i| ((i * 13 + c.rank() * 7 + k) as f32).sin() * 1e-3)
                .collect();
            Ok(Tensor::from_vec(v, 999, &Device::Cpu)?)
        };
        let started = (0..4)
            .map(|k| c.iall_reduce(&t(k)?, ReduceOp::Sum))
            .collect::<pipewright::Result<Vec<_>>>()?;
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(50));
        }
        for (k, h) in started.into_iter().enumerate().rev() {
            let blocking = c.all_reduce(&t(k)?, ReduceOp::Sum)?.to_vec1::<f32>()?;
            let got = h.wait()?.to_vec1::<f32>()?;
            let same = got
                .iter()
                .zip(&blocking)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "rank {}: sum {k} differs from the blocking one",
                c.rank()
            );
        }
        Ok(())
    })
    .unwrap();
}
