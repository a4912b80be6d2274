//! The counting allocator against bytes known in advance: each rank's peak is what its thread
//! allocated, blocks freed elsewhere and grown in place stay charged to their maker, the
//! process counts every rank, a piece of work's own peak reads back, and what a rank receives
//! from another is its own. (One test: the counters are the process's, and tests run at once.)

use candle_core::{DType, Device, Tensor};
use pipewright::distributed::comm::local;
use pipewright::runtime::memory::{self, CountingAlloc};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

const MIB: u64 = 1 << 20;

/// Within 64 KiB of `want` (what the test harness and candle allocate beside it).
fn near(got: u64, want: u64) -> bool {
    got.abs_diff(want) < 64 * 1024
}

#[test]
fn ranks_are_charged_what_their_threads_allocate() {
    assert!(memory::installed());
    // Each of three ranks holds (rank + 1) MiB of f32 zeros, then two more MiB for a moment.
    let held = local::run(3, |c| {
        use pipewright::distributed::comm::Communicator;
        let r = c.rank() as u64;
        let before = memory::rank_peak_bytes(c.rank()).unwrap();
        let t = Tensor::zeros(((r + 1) as usize * 256, 1024), DType::F32, &Device::Cpu)?;
        let spike = vec![1u8; 2 * MIB as usize];
        drop(spike);
        c.barrier()?;
        Ok((before, memory::rank_peak_bytes(c.rank()).unwrap(), t))
    })
    .unwrap();
    for (r, (before, peak, _)) in held.iter().enumerate() {
        let want = (r as u64 + 1) * MIB + 2 * MIB;
        assert!(
            near(peak - before, want),
            "rank {r}: peak rose by {} bytes, allocated {want}",
            peak - before
        );
    }
    // The tensors were made on the ranks' threads and are freed here: their charge goes.
    let live_before = memory::live_bytes().unwrap();
    drop(held);
    let freed = live_before - memory::live_bytes().unwrap();
    assert!(
        near(freed, 6 * MIB),
        "freeing the tensors gave back {freed} bytes, not 6 MiB"
    );

    // A vector grown by reallocation on another thread stays its maker's.
    memory::set_rank(Some(7));
    let mut v: Vec<u8> = Vec::with_capacity(MIB as usize);
    v.resize(MIB as usize, 1);
    memory::reset_peaks();
    let base = memory::rank_peak_bytes(7).unwrap();
    memory::set_rank(None);
    let v = std::thread::spawn(move || {
        v.reserve_exact(3 * MIB as usize);
        v
    })
    .join()
    .unwrap();
    assert!(v.capacity() >= 4 * MIB as usize);
    let grown = memory::rank_peak_bytes(7).unwrap() - base;
    assert!(
        near(grown, 3 * MIB),
        "growing by 3 MiB charged {grown} bytes"
    );
    // Aligned blocks (candle's and the standard library's) keep their alignment.
    let layout = std::alloc::Layout::from_size_align(1000, 4096).unwrap();
    // SAFETY: a non-zero size; freed with the same layout.
    unsafe {
        let p = std::alloc::alloc(layout);
        assert_eq!(p as usize % 4096, 0);
        std::alloc::dealloc(p, layout);
    }

    // One piece of work's peak: a 2 MiB spike above what the thread held when it began.
    memory::set_rank(Some(9));
    let kept = vec![1u8; MIB as usize];
    let start = memory::reset_thread_peak().unwrap();
    drop(vec![1u8; 2 * MIB as usize]);
    let spike = memory::thread_peak_bytes().unwrap() - start;
    assert!(
        near(spike, 2 * MIB),
        "a 2 MiB spike read back as {spike} bytes"
    );
    drop(kept);
    memory::set_rank(None);

    received_tensors_are_the_receivers();
    collectives_leave_nothing_behind();
}

/// A thousand scalar all-reduces leave the ranks holding what they held before: each
/// collective's mailbox goes once its message is taken (an emptied one left behind grew the
/// world's map by an entry per message, about 70 bytes each).
fn collectives_leave_nothing_behind() {
    use pipewright::distributed::comm::{Communicator, ReduceOp};
    let grew = local::run(2, |c| {
        let one = Tensor::new(1f32, &Device::Cpu)?;
        let live = || memory::live_bytes().unwrap() as i64;
        c.all_reduce(&one, ReduceOp::Sum)?;
        c.barrier()?;
        let before = live();
        for _ in 0..1000 {
            c.all_reduce(&one, ReduceOp::Sum)?;
        }
        c.barrier()?;
        Ok(live() - before)
    })
    .unwrap();
    for (rank, g) in grew.iter().enumerate() {
        assert!(
            *g < 16 * 1024,
            "rank {rank}: the process grew by {g} bytes over 1000 all-reduces"
        );
    }
}

/// What a rank receives from another is memory of its own (a copy made in its thread), as a
/// rank of another process would hold it: a received, all-reduced or gathered tensor counts to
/// the receiver, and the sender's charge ends with its own tensor. (Shared, it stayed charged
/// to the sender, or to the rank that reduced, for as long as any rank held it.)
fn received_tensors_are_the_receivers() {
    use pipewright::distributed::comm::{Communicator, ReduceOp};
    let grew = local::run(2, |c| {
        let mib = || Tensor::ones((256, 1024), DType::F32, &Device::Cpu);
        let live = || memory::thread_live_bytes().unwrap() as i64;
        let mut grew = Vec::new();
        let before = live();
        let got = match c.rank() {
            0 => {
                c.send(&mib()?, 1, 0)?;
                None
            }
            _ => Some(c.recv(0, 0)?),
        };
        c.barrier()?;
        grew.push(live() - before);
        drop(got);
        let t = mib()?;
        let before = live();
        let sum = c.all_reduce(&t, ReduceOp::Sum)?;
        c.barrier()?;
        grew.push(live() - before);
        drop(sum);
        let before = live();
        let parts = c.all_gather(&t)?;
        c.barrier()?;
        grew.push(live() - before);
        drop(parts);
        Ok(grew)
    })
    .unwrap();
    let mib = MIB as i64;
    // Sent then received; all-reduced; all-gathered (the other rank's part).
    for (rank, want) in [(0, [0, mib, mib]), (1, [mib, mib, mib])] {
        for (what, (got, want)) in ["recv", "all_reduce", "all_gather"]
            .iter()
            .zip(grew[rank].iter().zip(want))
        {
            assert!(
                got.abs_diff(want) < 64 * 1024,
                "rank {rank} after {what}: {got} bytes more, not {want}"
            );
        }
    }
}
