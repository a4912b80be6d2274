//! Collectives of the local (threads) backend against references computed on one thread.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use pipewright::comm::local::{run, run_with_timeout};
use pipewright::comm::{axis_group, Communicator, ReduceOp};
use pipewright::topology::{Axis, Layout, Topology};

const DTYPES: [DType; 5] = [DType::F32, DType::F16, DType::BF16, DType::I64, DType::U32];
const SHAPES: [&[usize]; 6] = [&[], &[0], &[3, 0], &[5], &[7, 3], &[2, 3, 5]];

/// Small integers (exact in every dtype, also summed over 8 ranks): rank r's tensor.
fn values(rank: usize, salt: usize, n: usize) -> Vec<f64> {
    (0..n)
        .map(|i| ((i * 7 + rank * 3 + salt) % 8) as f64)
        .collect()
}

fn tensor(v: &[f64], shape: &[usize], dt: DType) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dt)
        .unwrap()
}

fn as_f64(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

#[test]
fn all_reduce_every_world_dtype_and_shape() {
    for world in 1..=8 {
        run(world, |c| {
            for (s, shape) in SHAPES.iter().enumerate() {
                let n: usize = shape.iter().product();
                for dt in DTYPES {
                    for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg] {
                        let mine = tensor(&values(c.rank(), s, n), shape, dt);
                        let got = c.all_reduce(&mine, op);
                        let is_int = matches!(dt, DType::I64 | DType::U32);
                        if op == ReduceOp::Avg && is_int {
                            assert!(got.is_err(), "average of integers must be refused");
                            continue;
                        }
                        let got = got?;
                        assert_eq!(got.dims(), *shape);
                        assert_eq!(got.dtype(), dt);
                        let want: Vec<f64> = (0..n)
                            .map(|i| {
                                let col = (0..world).map(|r| values(r, s, n)[i]);
                                match op {
                                    ReduceOp::Sum => col.sum(),
                                    ReduceOp::Max => col.fold(f64::MIN, f64::max),
                                    ReduceOp::Avg => col.sum::<f64>() / world as f64,
                                }
                            })
                            .collect();
                        let g = as_f64(&got);
                        // Sums and maxima of small integers are exact; an average rounds once in the dtype.
                        let tol = match (op, dt) {
                            (ReduceOp::Avg, DType::F16 | DType::BF16) => 1e-2,
                            (ReduceOp::Avg, _) => 1e-6,
                            _ => 0.0,
                        };
                        for (a, b) in g.iter().zip(&want) {
                            assert!(
                                (a - b).abs() <= tol * b.abs(),
                                "world {world} {dt:?} {op:?} {shape:?}: {g:?} vs {want:?}"
                            );
                        }
                    }
                }
            }
            Ok(())
        })
        .unwrap();
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
fn all_gather_reduce_scatter_broadcast_barrier() {
    for world in 1..=8 {
        let entered = AtomicUsize::new(0);
        run(world, |c| {
            for dt in DTYPES {
                // all_gather: shapes may differ by rank.
                let shape = [c.rank() % 3, 2];
                let mine = tensor(&values(c.rank(), 1, shape[0] * 2), &shape, dt);
                let all = c.all_gather(&mine)?;
                assert_eq!(all.len(), world);
                for (r, t) in all.iter().enumerate() {
                    assert_eq!(t.dims(), &[r % 3, 2]);
                    assert_eq!(as_f64(t), values(r, 1, (r % 3) * 2));
                }
                // reduce_scatter: rank r keeps rows [2r, 2r+2) of the sum.
                let rows = 2 * world;
                let mine = tensor(&values(c.rank(), 2, rows * 3), &[rows, 3], dt);
                let part = c.reduce_scatter(&mine, ReduceOp::Sum)?;
                assert_eq!(part.dims(), &[2, 3]);
                let want: Vec<f64> = (c.rank() * 6..c.rank() * 6 + 6)
                    .map(|i| (0..world).map(|r| values(r, 2, rows * 3)[i]).sum())
                    .collect();
                assert_eq!(as_f64(&part), want);
                // broadcast from the last rank; others pass a same-shaped placeholder.
                let root = world - 1;
                let mine = tensor(&values(c.rank(), 3, 6), &[2, 3], dt);
                let got = c.broadcast(&mine, root)?;
                assert_eq!(as_f64(&got), values(root, 3, 6));
                assert_eq!(got.dtype(), dt);
            }
            entered.fetch_add(1, Ordering::SeqCst);
            c.barrier()?;
            assert_eq!(
                entered.load(Ordering::SeqCst),
                world,
                "barrier let a rank through early"
            );
            assert_eq!(c.is_master(), c.rank() == 0);
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn point_to_point_ring_in_every_dtype() {
    for world in 1..=8 {
        run(world, |c| {
            let (next, prev) = ((c.rank() + 1) % world, (c.rank() + world - 1) % world);
            for (k, dt) in DTYPES.iter().enumerate() {
                for shape in SHAPES {
                    let n: usize = shape.iter().product();
                    let t = tensor(&values(c.rank(), k, n), shape, *dt);
                    c.send(&t, next, k as u64)?;
                    let got = c.recv(prev, k as u64)?;
                    assert_eq!(got.dims(), shape);
                    assert_eq!(got.dtype(), *dt);
                    assert_eq!(as_f64(&got), values(prev, k, n));
                }
            }
            // Non-blocking: post the receive first, then send, then wait.
            let h = c.irecv(prev, 99)?;
            let s = c.isend(&Tensor::new(&[c.rank() as f32], &Device::Cpu)?, next, 99)?;
            assert_eq!(h.wait()?.to_vec1::<f32>()?, vec![prev as f32]);
            s.wait()?;
            Ok(())
        })
        .unwrap();
    }
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

#[test]
fn sub_groups_of_a_2x2x2_layout() {
    let topo = Topology::new(Layout::new(2, 2, 2).unwrap());
    let per_rank: Vec<f64> = (0..8).map(|r| (r * r + 1) as f64).collect();
    run(8, |c| {
        for axis in [Axis::Pipeline, Axis::Tensor, Axis::Data] {
            let g = axis_group(&c, &topo, axis)?;
            let members = topo.group(c.rank(), axis)?;
            assert_eq!(g.size(), 2);
            assert_eq!(members[g.rank()], c.rank());
            let t = Tensor::new(&[per_rank[c.rank()]], &Device::Cpu)?;
            let sum = g.all_reduce(&t, ReduceOp::Sum)?.to_vec1::<f64>()?[0];
            assert_eq!(
                sum,
                members.iter().map(|&m| per_rank[m]).sum::<f64>(),
                "{axis:?}"
            );
            let all = g.all_gather(&t)?;
            let got: Vec<f64> = all.iter().map(|t| t.to_vec1::<f64>().unwrap()[0]).collect();
            assert_eq!(
                got,
                members.iter().map(|&m| per_rank[m]).collect::<Vec<_>>()
            );
            // Point to point inside the group uses group ranks.
            let other = 1 - g.rank();
            g.send(&t, other, 5)?;
            assert_eq!(
                g.recv(other, 5)?.to_vec1::<f64>()?[0],
                per_rank[members[other]]
            );
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
fn mismatched_shapes_or_dtypes_name_the_ranks_on_every_rank() {
    let seen = run(3, |c| {
        let shape: &[usize] = if c.rank() == 2 { &[4] } else { &[3] };
        let t = Tensor::zeros(shape, DType::F32, &Device::Cpu)?;
        let e = err_of(c.all_reduce(&t, ReduceOp::Sum));
        let dt = if c.rank() == 1 {
            DType::F16
        } else {
            DType::F32
        };
        let e2 = err_of(c.all_reduce(&Tensor::zeros(3, dt, &Device::Cpu)?, ReduceOp::Sum));
        let e3 = err_of(c.broadcast(&Tensor::zeros(shape, DType::F32, &Device::Cpu)?, 0));
        Ok((e, e2, e3))
    })
    .unwrap();
    for (e, e2, e3) in seen {
        assert!(
            e.contains("rank 2 passed [4] F32 but rank 0 passed [3] F32"),
            "{e}"
        );
        assert!(e2.contains("rank 1 passed [3] F16"), "{e2}");
        assert!(
            e3.contains("rank 2 expects [4] F32 but root 0 sends [3] F32"),
            "{e3}"
        );
    }
}

#[test]
fn bad_ranks_and_tags_are_errors() {
    run(2, |c| {
        let t = Tensor::zeros(1, DType::F32, &Device::Cpu)?;
        assert!(err_of(c.send(&t, 2, 0)).contains("outside this group of 2 ranks"));
        assert!(err_of(c.recv(7, 0)).contains("names rank 7"));
        assert!(err_of(c.send(&t, 1, u64::MAX)).contains("reserved"));
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
