//! The checks every [`Communicator`] backend must pass, run by every rank of a world (the
//! local backend's tests, `mpirun` in CI, the NCCL smoke test). Each rank computes the expected
//! result of every collective itself, from the formula that made every rank's input, and
//! compares. [`run_all_on`] runs them on tensors on a GPU, where the result of every collective
//! must come back on that GPU.

use candle_core::{DType, Device, Tensor};

mod non_blocking;

use non_blocking::non_blocking;

use super::{Communicator, ReduceOp};
use crate::distributed::topology::{Axis, Layout, Topology};
use crate::{Error, Result};

/// Every dtype a backend must carry.
pub const DTYPES: [DType; 5] = [DType::F32, DType::F16, DType::BF16, DType::I64, DType::U32];
/// Odd shapes, 0-d and empty ones included.
pub const SHAPES: [&[usize]; 6] = [&[], &[0], &[3, 0], &[5], &[7, 3], &[2, 3, 5]];

/// Small integers, exact in every dtype even summed over many ranks: rank `rank`'s input.
pub fn values(rank: usize, salt: usize, n: usize) -> Vec<f64> {
    (0..n)
        .map(|i| ((i * 7 + rank * 3 + salt) % 8) as f64)
        .collect()
}

/// Values read back on the host (the comparison is no test of the device's casts).
pub(super) fn as_f64(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_device(&Device::Cpu)?
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()?)
}

pub(super) struct Count<'a> {
    pub(super) rank: usize,
    passed: usize,
    failed: Vec<String>,
    pub(super) comm: &'a dyn Communicator,
    device: &'a Device,
    /// The shapes tested: [`SHAPES`], less the empty ones where the device cannot hold an
    /// empty tensor (candle's CUDA storage allocates no zero-byte buffers).
    shapes: Vec<&'static [usize]>,
}

impl Count<'_> {
    pub(super) fn check(&mut self, ok: bool, what: impl FnOnce() -> String) {
        if ok {
            self.passed += 1;
        } else {
            self.failed.push(format!("rank {}: {}", self.rank, what()));
        }
    }

    /// `v` as a tensor of `shape` and `dt` on the device under test.
    pub(super) fn tensor(&self, v: &[f64], shape: &[usize], dt: DType) -> Result<Tensor> {
        Ok(Tensor::from_vec(v.to_vec(), shape, &Device::Cpu)?
            .to_dtype(dt)?
            .to_device(self.device)?)
    }

    /// Whether a collective's result is on the device under test.
    pub(super) fn here(&self, t: &Tensor) -> bool {
        t.device().same_device(self.device)
    }
}

/// Runs every check on this rank with CPU tensors; returns how many passed, or an error
/// listing the failures.
pub fn run_all(comm: &dyn Communicator) -> Result<usize> {
    run_all_on(comm, &Device::Cpu)
}

/// [`run_all`] with every tensor on `device` (a GPU, for the NCCL backend's device path).
/// Empty shapes are left out where the device cannot hold an empty tensor (CUDA in candle).
pub fn run_all_on(comm: &dyn Communicator, device: &Device) -> Result<usize> {
    let holds_empty = Tensor::zeros(0, DType::F32, &Device::Cpu)?
        .to_device(device)
        .is_ok();
    let shapes = SHAPES
        .into_iter()
        .filter(|s| holds_empty || s.iter().product::<usize>() > 0)
        .collect();
    let mut c = Count {
        rank: comm.rank(),
        passed: 0,
        failed: Vec::new(),
        comm,
        device,
        shapes,
    };
    type Part = fn(&mut Count) -> Result<()>;
    let parts: [(&str, Part); 8] = [
        ("all_reduce", all_reduce),
        ("non-blocking", non_blocking),
        ("order of addition", order_of_addition),
        ("gather, scatter and broadcast", gather_scatter_broadcast),
        ("all_to_all", all_to_all),
        ("point to point", point_to_point),
        ("sub-groups", sub_groups),
        ("mismatches", mismatches),
    ];
    for (name, part) in parts {
        // An error out of a part (not a wrong value) names the part it broke.
        part(&mut c).map_err(|e| Error::Comm(format!("conformance, {name}: {e}")))?;
    }
    c.comm.barrier()?;
    if c.failed.is_empty() {
        Ok(c.passed)
    } else {
        Err(Error::Comm(format!(
            "{} checks failed:\n{}",
            c.failed.len(),
            c.failed.join("\n")
        )))
    }
}

fn all_reduce(c: &mut Count) -> Result<()> {
    let world = c.comm.size();
    for (s, shape) in c.shapes.clone().into_iter().enumerate() {
        let n: usize = shape.iter().product();
        for dt in DTYPES {
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg] {
                let what = || format!("all_reduce {op:?} {dt:?} {shape:?}");
                let got = c
                    .tensor(&values(c.rank, s, n), shape, dt)
                    .and_then(|mine| c.comm.all_reduce(&mine, op));
                if op == ReduceOp::Avg && dt.is_int() {
                    c.check(got.is_err(), || {
                        format!("average of {dt:?} was not refused")
                    });
                    continue;
                }
                // An error is this case's failure, named, and the suite goes on.
                let (got, g) = match got.and_then(|t| Ok((as_f64(&t)?, t))) {
                    Ok((g, t)) => (t, g),
                    Err(e) => {
                        c.check(false, || format!("{}: {e}", what()));
                        continue;
                    }
                };
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
                // Sums and maxima of small integers are exact; an average rounds once.
                let tol = match (op, dt) {
                    (ReduceOp::Avg, DType::F16 | DType::BF16) => 1e-2,
                    (ReduceOp::Avg, _) => 1e-6,
                    _ => 0.0,
                };
                let ok = got.dims() == shape
                    && got.dtype() == dt
                    && c.here(&got)
                    && g.iter()
                        .zip(&want)
                        .all(|(a, b)| (a - b).abs() <= tol * b.abs());
                c.check(ok, || format!("{}: {g:?}, want {want:?}", what()));
            }
        }
    }
    Ok(())
}

/// Rank `rank`'s input at element `i` for the checks of the order of addition: in f32, `1e8 + 1` loses the
/// 1, so a sum over three or more ranks depends on the order of the additions; in f16 and bf16,
/// `256 + 1 + 1` does at every step and not in f32.
pub fn order_sensitive(rank: usize, i: usize, dt: DType) -> f32 {
    const WIDE: [f32; 4] = [1e8, 1.0, -1e8, 1.0];
    const HALF: [f32; 4] = [256.0, 1.0, 1.0, 3.0];
    let p = if dt == DType::F32 { WIDE } else { HALF };
    p[(rank + i) % 4]
}

/// all_reduce, reduce and reduce_scatter give, bit for bit, the sum in rank order (f16 and bf16
/// summed in f32 and rounded once) and that sum times 1 / size for an average, on inputs where
/// any other order gives other bits ([`super::ordered`]).
fn order_of_addition(c: &mut Count) -> Result<()> {
    let world = c.comm.size();
    let rows = 2 * world + 1;
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let round = |v: f32| match dt {
            DType::BF16 => half::bf16::from_f32(v).to_f64(),
            DType::F16 => half::f16::from_f32(v).to_f64(),
            _ => v as f64,
        };
        let col =
            |i: usize| -> Vec<f32> { (0..world).map(|r| order_sensitive(r, i, dt)).collect() };
        let mine: Vec<f64> = (0..rows * 3)
            .map(|i| order_sensitive(c.rank, i, dt) as f64)
            .collect();
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            let scale = if op == ReduceOp::Avg {
                (1.0 / world as f64) as f32
            } else {
                1.0
            };
            let want = |i: usize| round(super::ordered::sum_in_rank_order(&col(i)) * scale + 0.0);
            // An odd length: the shares MPI and NCCL split it into differ by an element.
            let t = c.tensor(&mine, &[rows, 3], dt)?;
            let all: Vec<f64> = (0..rows * 3).map(want).collect();
            let got = as_f64(&c.comm.all_reduce(&t, op)?)?;
            c.check(got == all, || {
                format!("all_reduce {op:?} {dt:?} in rank order: {got:?}, want {all:?}")
            });
            let root = world / 2;
            let got = c
                .comm
                .reduce(&t, op, root)?
                .map(|t| as_f64(&t))
                .transpose()?;
            let ok = match &got {
                Some(g) => c.rank == root && *g == all,
                None => c.rank != root,
            };
            c.check(ok, || format!("reduce {op:?} {dt:?} to {root}: {got:?}"));
            let t = t.narrow(0, 0, rows - 1)?;
            let part = as_f64(&c.comm.reduce_scatter(&t, op)?)?;
            let want: Vec<f64> = (c.rank * 6..c.rank * 6 + 6).map(want).collect();
            c.check(part == want, || {
                format!("reduce_scatter {op:?} {dt:?} in rank order: {part:?}, want {want:?}")
            });
        }
    }
    Ok(())
}

fn gather_scatter_broadcast(c: &mut Count) -> Result<()> {
    let world = c.comm.size();
    for dt in DTYPES {
        // all_gather: shapes may differ by rank.
        let rows = |r: usize| r % 3;
        let mine = c.tensor(&values(c.rank, 1, rows(c.rank) * 2), &[rows(c.rank), 2], dt)?;
        let all = c.comm.all_gather(&mine)?;
        let mut ok = all.len() == world;
        for (r, t) in all.iter().enumerate() {
            ok &= t.dims() == [rows(r), 2]
                && t.dtype() == dt
                && c.here(t)
                && as_f64(t)? == values(r, 1, rows(r) * 2);
        }
        c.check(ok, || format!("all_gather {dt:?}"));
        // reduce_scatter: rank r keeps rows [2r, 2r + 2) of the sum.
        let n = 2 * world * 3;
        let mine = c.tensor(&values(c.rank, 2, n), &[2 * world, 3], dt)?;
        let part = c.comm.reduce_scatter(&mine, ReduceOp::Sum)?;
        let want: Vec<f64> = (c.rank * 6..c.rank * 6 + 6)
            .map(|i| (0..world).map(|r| values(r, 2, n)[i]).sum())
            .collect();
        let got = as_f64(&part)?;
        c.check(
            part.dims() == [2, 3] && c.here(&part) && got == want,
            || format!("reduce_scatter {dt:?}: {got:?}, want {want:?}"),
        );
        // broadcast from the last rank; the others pass a placeholder of the same shape.
        let root = world - 1;
        let got = c
            .comm
            .broadcast(&c.tensor(&values(c.rank, 3, 6), &[2, 3], dt)?, root)?;
        c.check(
            got.dtype() == dt && c.here(&got) && as_f64(&got)? == values(root, 3, 6),
            || format!("broadcast {dt:?}"),
        );
    }
    c.comm.barrier()?;
    c.check(c.comm.is_master() == (c.rank == 0), || "is_master".into());
    Ok(())
}

/// all_to_all with uneven parts: rank `src` sends rank `dst` `(src + 2 dst) % 3` rows of 2
/// (empty parts too, where the device holds them), values that tell (src, dst) apart; then a
/// member passing too few parts, or rows of another width, is refused alike on every member.
fn all_to_all(c: &mut Count) -> Result<()> {
    let world = c.comm.size();
    let empty_ok = c.shapes.iter().any(|s| s.iter().product::<usize>() == 0);
    let rows = |src: usize, dst: usize| (src + 2 * dst) % 3 + usize::from(!empty_ok);
    let salt = |dst: usize| 5 * dst + 1;
    for dt in DTYPES {
        let parts = (0..world)
            .map(|dst| {
                let n = rows(c.rank, dst);
                c.tensor(&values(c.rank, salt(dst), n * 2), &[n, 2], dt)
            })
            .collect::<Result<Vec<_>>>()?;
        let got = c.comm.all_to_all(&parts)?;
        let mut ok = got.len() == world;
        for (src, t) in got.iter().enumerate() {
            let n = rows(src, c.rank);
            ok &= t.dims() == [n, 2]
                && t.dtype() == dt
                && c.here(t)
                && as_f64(t)? == values(src, salt(c.rank), n * 2);
        }
        c.check(ok, || format!("all_to_all {dt:?}"));
    }
    if world < 2 {
        return Ok(());
    }
    let odd = world - 1;
    let part = |cols: usize| Tensor::zeros((1, cols), DType::F32, c.device);
    let few = if c.rank == odd { odd } else { world };
    let e = c.comm.all_to_all(
        &(0..few)
            .map(|_| part(2))
            .collect::<candle_core::Result<Vec<_>>>()?,
    );
    let want = format!("rank {odd} passed {odd} parts for a group of {world} ranks");
    c.check(
        matches!(&e, Err(e) if e.to_string().contains(&want)),
        || format!("all_to_all with too few parts: {:?}", e.err()),
    );
    let cols = if c.rank == odd { 3 } else { 2 };
    let e = c.comm.all_to_all(
        &(0..world)
            .map(|_| part(cols))
            .collect::<candle_core::Result<Vec<_>>>()?,
    );
    let want = format!("rank {odd} passed rows of [3] F32 but rank 0 passed rows of [2] F32");
    c.check(
        matches!(&e, Err(e) if e.to_string().contains(&want)),
        || format!("all_to_all with rows of another width: {:?}", e.err()),
    );
    Ok(())
}

fn point_to_point(c: &mut Count) -> Result<()> {
    let world = c.comm.size();
    let (next, prev) = ((c.rank + 1) % world, (c.rank + world - 1) % world);
    for (k, dt) in DTYPES.iter().enumerate() {
        for shape in c.shapes.clone() {
            let n: usize = shape.iter().product();
            let t = c.tensor(&values(c.rank, k, n), shape, *dt)?;
            // Even ranks send first, odd ranks receive first: no rank waits on a send.
            let got = if c.rank.is_multiple_of(2) || world == 1 {
                let h = c.comm.irecv(prev, k as u64)?;
                c.comm.send(&t, next, k as u64)?;
                h.wait()?
            } else {
                let got = c.comm.recv(prev, k as u64)?;
                c.comm.send(&t, next, k as u64)?;
                got
            };
            let ok =
                got.dims() == shape && got.dtype() == *dt && as_f64(&got)? == values(prev, k, n);
            c.check(ok, || format!("ring send/recv {dt:?} {shape:?}"));
        }
    }
    // Non-blocking both ways at once.
    let h = c.comm.irecv(prev, 99)?;
    let s = c
        .comm
        .isend(&c.tensor(&[c.rank as f64], &[1], DType::F32)?, next, 99)?;
    let got = h.wait()?.to_vec1::<f32>()?;
    s.wait()?;
    c.check(got == vec![prev as f32], || {
        format!("isend/irecv got {got:?}")
    });
    Ok(())
}

fn sub_groups(c: &mut Count) -> Result<()> {
    let world = c.comm.size();
    let layout = match world {
        8 => Layout::new(2, 2, 2)?,
        4 => Layout::new(2, 2, 1)?,
        w => Layout::new(1, 1, w)?,
    };
    let topo = Topology::new(layout);
    let per_rank = |r: usize| (r * r + 1) as f64;
    for axis in [Axis::Pipeline, Axis::Tensor, Axis::Data] {
        let g = super::axis_group(c.comm, &topo, axis)?;
        let members = topo.group(c.rank, axis)?;
        let t = c.tensor(&[per_rank(c.rank)], &[1], DType::F64)?;
        let sum = as_f64(&g.all_reduce(&t, ReduceOp::Sum)?)?[0];
        let want: f64 = members.iter().map(|&m| per_rank(m)).sum();
        c.check(members[g.rank()] == c.rank && sum == want, || {
            format!("{axis:?} group sum {sum}, want {want}")
        });
        let all: Vec<f64> = g
            .all_gather(&t)?
            .iter()
            .map(|t| as_f64(t).map(|v| v[0]))
            .collect::<std::result::Result<_, _>>()?;
        c.check(
            all == members.iter().map(|&m| per_rank(m)).collect::<Vec<_>>(),
            || format!("{axis:?} group gather"),
        );
    }
    Ok(())
}

fn mismatches(c: &mut Count) -> Result<()> {
    let world = c.comm.size();
    if world < 2 {
        return Ok(());
    }
    let odd = world - 1;
    let shape: &[usize] = if c.rank == odd { &[4] } else { &[3] };
    let e = c
        .comm
        .all_reduce(&Tensor::zeros(shape, DType::F32, c.device)?, ReduceOp::Sum);
    let want = format!("rank {odd} passed [4] F32 but rank 0 passed [3] F32");
    c.check(
        matches!(&e, Err(e) if e.to_string().contains(&want)),
        || format!("shape mismatch: {:?}", e.err()),
    );
    let dt = if c.rank == odd {
        DType::F16
    } else {
        DType::F32
    };
    let e = c
        .comm
        .all_reduce(&Tensor::zeros(3, dt, c.device)?, ReduceOp::Sum);
    let want = format!("rank {odd} passed [3] F16");
    c.check(
        matches!(&e, Err(e) if e.to_string().contains(&want)),
        || format!("dtype mismatch: {:?}", e.err()),
    );
    let e = c
        .comm
        .broadcast(&Tensor::zeros(shape, DType::F32, c.device)?, 0);
    let want = format!("rank {odd} expects [4] F32 but root 0 sends [3] F32");
    c.check(
        matches!(&e, Err(e) if e.to_string().contains(&want)),
        || format!("broadcast mismatch: {:?}", e.err()),
    );
    let t = Tensor::zeros(1, DType::F32, c.device)?;
    c.check(c.comm.send(&t, world, 0).is_err(), || {
        "send outside the world was accepted".into()
    });
    c.check(c.comm.send(&t, 0, u64::MAX).is_err(), || {
        "a reserved tag was accepted".into()
    });
    Ok(())
}
