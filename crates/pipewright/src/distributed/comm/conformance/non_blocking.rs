//! The conformance suite's non-blocking part: collectives started, several in flight with a
//! blocking one between, waited on in reverse order.

use candle_core::DType;

use super::{as_f64, values, Count};
use crate::distributed::comm::ReduceOp;
use crate::Result;

/// Non-blocking all-reduces and reduce-scatters of three dtypes and an all-gather, seven in
/// flight at once with a blocking all-reduce run between their starts and their waits, waited
/// on in reverse order: each gives what its blocking twin gives.
pub(super) fn non_blocking(c: &mut Count) -> Result<()> {
    let world = c.comm.size();
    let n = 6 * world;
    let mut started = Vec::new();
    for (k, dt) in [DType::F32, DType::BF16, DType::I64]
        .into_iter()
        .enumerate()
    {
        let t = c.tensor(&values(c.rank, 10 + k, n), &[n], dt)?;
        for scattered in [false, true] {
            let h = match scattered {
                false => c.comm.iall_reduce(&t, ReduceOp::Sum)?,
                true => c.comm.ireduce_scatter(&t, ReduceOp::Sum)?,
            };
            started.push((k, dt, scattered, h));
        }
    }
    // A gather in flight beside them: parts of each member's own length.
    let part = c.tensor(&vec![c.rank as f64; c.rank + 1], &[c.rank + 1], DType::F32)?;
    let gathered = c.comm.iall_gather(&part)?;
    let mid = c.tensor(&[c.rank as f64], &[1], DType::F32)?;
    let mid = as_f64(&c.comm.all_reduce(&mid, ReduceOp::Sum)?)?;
    let want = (0..world).sum::<usize>() as f64;
    c.check(mid == [want], || {
        format!("all_reduce between non-blocking ones: {mid:?}, want {want}")
    });
    match gathered.wait() {
        Ok(parts) => {
            let got = (parts.iter()).map(as_f64).collect::<Result<Vec<_>>>()?;
            let want: Vec<Vec<f64>> = (0..world).map(|r| vec![r as f64; r + 1]).collect();
            c.check(got == want, || {
                format!("iall_gather: {got:?}, want {want:?}")
            });
        }
        Err(e) => c.check(false, || format!("iall_gather: {e}")),
    }
    for (k, dt, scattered, h) in started.into_iter().rev() {
        let sums: Vec<f64> = (0..n)
            .map(|i| (0..world).map(|r| values(r, 10 + k, n)[i]).sum())
            .collect();
        let part = n / world;
        let want = match scattered {
            false => sums,
            true => sums[c.rank * part..(c.rank + 1) * part].to_vec(),
        };
        let what = if scattered {
            "ireduce_scatter"
        } else {
            "iall_reduce"
        };
        match h.wait() {
            Ok(t) => {
                let ok = t.dtype() == dt && c.here(&t) && as_f64(&t)? == want;
                c.check(ok, || format!("{what} {dt:?}: {t}, want {want:?}"));
            }
            Err(e) => c.check(false, || format!("{what} {dt:?}: {e}")),
        }
    }
    Ok(())
}
