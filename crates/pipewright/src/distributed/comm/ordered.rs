//! Reductions in one defined order, whatever the backend, the machine, the message size or
//! the number of ranks.
//!
//! Floating-point addition is not associative: in f32, `((1e8 + 1) + -1e8) + 1` is 1 and
//! `(1e8 + 1) + (-1e8 + 1)` is 0. MPI and NCCL pick a reduction algorithm (ring, recursive
//! doubling, tree, ...) by message size, rank count and the CPU's vector units, and each adds in
//! its own order: the same run summed its gradients over four replicas to other bits under
//! `mpirun` than as threads, on one kind of CPU and not on another. So no backend uses a
//! library's reduction. Every backend reduces by one definition, [`combine`]:
//!
//! - element `i` of a sum is `((x_0[i] + x_1[i]) + x_2[i]) + ...`, in rank order;
//! - f16 and bf16 are summed in f32 and rounded to their dtype once, at the end;
//! - an average is that sum times `1 / n` (candle's `affine`), then rounded to the dtype;
//! - a maximum is taken in rank order too (it is exact in any order).
//!
//! The backends differ only in how the parts travel. Local threads hand every rank every
//! tensor. MPI and NCCL send each rank only the parts it reduces: rank `r` reduces [`share`]
//! `r` of all_reduce's elements (its rows of reduce_scatter), so each rank receives what a
//! ring's reduce-scatter would, and all_reduce then gathers the reduced shares. Splitting the
//! elements changes no bit: each element is added on its own.

use std::ops::Range;

use candle_core::{DType, Device, Storage, Tensor, WithDType};

use super::ReduceOp;
use crate::Result;

/// The reduction of `parts` (one per rank, in rank order; same shape and dtype) by `op`, by
/// the definition above; the result has the parts' dtype.
pub fn combine(parts: &[Tensor], op: ReduceOp) -> Result<Tensor> {
    let Some(first) = parts.first() else {
        return Err(crate::Error::Comm("a reduction over no ranks".into()));
    };
    let dt = first.dtype();
    if op != ReduceOp::Max {
        let fast = match dt {
            DType::F32 => on_cpu::<f32>(parts, op)?,
            DType::F64 => on_cpu::<f64>(parts, op)?,
            _ => None,
        };
        if let Some(t) = fast {
            return Ok(t);
        }
    }
    let wide = |t: &Tensor| -> Result<Tensor> {
        let t = t.to_device(first.device())?;
        Ok(match dt {
            DType::F16 | DType::BF16 => t.to_dtype(DType::F32)?,
            _ => t,
        })
    };
    let mut acc = wide(first)?;
    for t in &parts[1..] {
        let t = wide(t)?;
        acc = match op {
            ReduceOp::Sum | ReduceOp::Avg => (acc + t)?,
            ReduceOp::Max => acc.maximum(&t)?,
        };
    }
    if op == ReduceOp::Avg {
        acc = acc.affine(1.0 / parts.len() as f64, 0.0)?;
    }
    Ok(acc.to_dtype(dt)?)
}

/// [`combine`]'s sum or average of f32 or f64 parts in host memory by plain loops, the same
/// additions in the same order (candle's elementwise add took 25 times a loop's time here: 0.6
/// ms for 128 K elements, which made MPI's 1 MiB all-reduce 0.03 of Open MPI's own); `None`
/// when a part is not a contiguous CPU tensor.
fn on_cpu<T: WithDType>(parts: &[Tensor], op: ReduceOp) -> Result<Option<Tensor>> {
    let mut acc: Vec<T> = Vec::new();
    for (i, p) in parts.iter().enumerate() {
        let (storage, layout) = p.storage_and_layout();
        let (Storage::Cpu(cpu), Some((a, b))) = (&*storage, layout.contiguous_offsets()) else {
            return Ok(None);
        };
        let v = &cpu.as_slice::<T>()?[a..b];
        if i == 0 {
            acc = v.to_vec();
        } else {
            for (o, x) in acc.iter_mut().zip(v) {
                *o += *x;
            }
        }
    }
    if op == ReduceOp::Avg {
        // What candle's `affine(1 / n, 0)` computes, element by element.
        let (mul, add) = (T::from_f64(1.0 / parts.len() as f64), T::from_f64(0.0));
        for o in &mut acc {
            *o = *o * mul + add;
        }
    }
    Ok(Some(Tensor::from_vec(acc, parts[0].dims(), &Device::Cpu)?))
}

/// The elements `[start, end)` of a flat tensor of `n` that member `rank` of `size` reduces
/// in an all_reduce: `size` contiguous shares, the first `n % size` one element longer.
pub fn share(n: usize, size: usize, rank: usize) -> Range<usize> {
    let (base, extra) = (n / size, n % size);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

/// The value every backend must give for a sum of the f32 `values` (one per rank, in rank
/// order), worked out with plain f32 arithmetic: the conformance suite's oracle.
pub fn sum_in_rank_order(values: &[f32]) -> f32 {
    values.iter().skip(1).fold(values[0], |acc, v| acc + v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn shares_cover_every_element_once_in_order() {
        for n in [0, 1, 5, 7, 12, 13] {
            for size in 1..6 {
                let all: Vec<usize> = (0..size).flat_map(|r| share(n, size, r)).collect();
                assert_eq!(all, (0..n).collect::<Vec<_>>(), "n {n} size {size}");
            }
        }
    }

    #[test]
    fn the_loop_and_candle_give_the_same_bits() -> Result<()> {
        // Sums, averages and signed zeros of parts in host memory (the loop) and of the same
        // parts as strided views (candle's ops).
        let vals = [1e8f32, 1.0, -1e8, 1.0, -0.0, 3.0e-39, 7.5];
        let parts: Vec<Tensor> = (0..5)
            .map(|r| {
                let v: Vec<f32> = (0..7).map(|i| vals[(i + r) % 7]).collect();
                Tensor::new(v.as_slice(), &Device::Cpu)
            })
            .collect::<candle_core::Result<_>>()?;
        let strided: Vec<Tensor> = parts
            .iter()
            .map(|p| Ok(Tensor::stack(&[p, p], 1)?.narrow(1, 0, 1)?.squeeze(1)?))
            .collect::<Result<_>>()?;
        assert!(!strided[0].is_contiguous());
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            let fast = combine(&parts, op)?.to_vec1::<f32>()?;
            let slow = combine(&strided, op)?.to_vec1::<f32>()?;
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&fast), bits(&slow), "{op:?}");
        }
        Ok(())
    }

    #[test]
    fn combine_adds_in_rank_order_and_rounds_once() -> Result<()> {
        let vals = [1e8f32, 1.0, -1e8, 1.0];
        // A pairwise tree gives another answer: the order is what this checks.
        assert_eq!((vals[0] + vals[1]) + (vals[2] + vals[3]), 0.0);
        assert_eq!(sum_in_rank_order(&vals), 1.0);
        let parts: Vec<Tensor> = vals
            .iter()
            .map(|v| Tensor::new(&[*v], &Device::Cpu))
            .collect::<candle_core::Result<_>>()?;
        let got = combine(&parts, ReduceOp::Sum)?.to_vec1::<f32>()?;
        assert_eq!(got, vec![1.0]);
        let avg = combine(&parts, ReduceOp::Avg)?.to_vec1::<f32>()?;
        assert_eq!(avg, vec![0.25]);
        // bf16: 256 + 1 + 1 rounds to 256 at every step in bf16, to 258 in f32 then once.
        let parts: Vec<Tensor> = [256f32, 1.0, 1.0]
            .iter()
            .map(|v| Tensor::new(&[*v], &Device::Cpu)?.to_dtype(DType::BF16))
            .collect::<candle_core::Result<_>>()?;
        let got = combine(&parts, ReduceOp::Sum)?.to_dtype(DType::F32)?;
        assert_eq!(got.to_vec1::<f32>()?, vec![258.0]);
        Ok(())
    }
}
