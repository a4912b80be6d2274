//! Expert parallelism: the `ep` ranks of an expert group ([`crate::distributed::topology::Axis::Expert`])
//! each hold `1/ep` of a mixture's experts (rank `r` experts `r*E/ep ..`) and send each other
//! the tokens routed to them, as torchtitan's and Megatron's token dispatchers do:
//!
//! 1. every rank shares how many of its rows go to each expert (an all-gather of `E` counts,
//!    which is also what the load statistics need);
//! 2. *dispatch*: an all-to-all sends each rank the rows for its experts; the rows it gets
//!    (member by member, each member's expert by expert) are regrouped expert by expert, so
//!    that each expert computes all its rows as one product;
//! 3. *combine*: the outputs go back the same way, each row to the rank and place it came
//!    from.
//!
//! Both exchanges are autograd ops whose backward is the reverse exchange, so gradients reach
//! the rank and row each token came from; every member runs them in the same order, forward
//! and backward (each mixture runs one dispatch and one combine per pass, on every rank,
//! whether or not any row is routed to it). In a group of one [`Dispatch::run`] is the plain
//! loop over the experts and runs no collective.
//!
//! The experts' gradients are then summed over the ranks holding the same experts
//! ([`crate::distributed::topology::Axis::ExpertReplica`]), everything else over the replicas
//! ([`crate::model::Layer::experts`] names which parameters are experts).

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use candle_core::Tensor;

use crate::distributed::comm::{precomputed, Communicator, Group};
use crate::{invalid, Result};

/// Nanoseconds every rank of this process spent in expert exchanges.
static EXCHANGE_NS: AtomicU64 = AtomicU64::new(0);

/// Seconds the ranks of this process spent in the experts' exchanges (dispatch and combine,
/// forward and backward, waits for the other members included) since it started, summed
/// over its ranks: the all-to-all's share of a step, for benchmarks.
pub fn exchange_seconds() -> f64 {
    EXCHANGE_NS.load(Ordering::Relaxed) as f64 * 1e-9
}

/// `parts` exchanged over `comm`, the time counted in [`exchange_seconds`].
fn timed_all_to_all(comm: &dyn Communicator, parts: &[Tensor]) -> Result<Vec<Tensor>> {
    let start = Instant::now();
    let got = comm.all_to_all(parts);
    EXCHANGE_NS.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    got
}

/// The experts of `n_experts` that member `rank` of an expert group of `size` holds: a
/// contiguous `n_experts / size` of them. Fails when `size` does not divide the experts.
pub fn local_experts(n_experts: usize, rank: usize, size: usize) -> Result<Range<usize>> {
    if size == 0 || !n_experts.is_multiple_of(size) {
        return Err(invalid!(
            "--ep {size} does not divide the {n_experts} experts of a mixture: choose an \
             expert-parallel size that divides --n-experts"
        ));
    }
    let per = n_experts / size;
    Ok(rank * per..(rank + 1) * per)
}

/// One mixture pass's routing over an expert group: how many rows each member sends each
/// expert.
pub struct Dispatch {
    group: Group,
    /// This member's experts.
    mine: Range<usize>,
    /// `loads[m][e]`: rows member `m` routes to expert `e`.
    loads: Vec<Vec<usize>>,
}

impl Dispatch {
    /// The routing of rows `load[e]` to each expert `e` on every member of `group` (collective:
    /// an all-gather of the counts; nothing in a group of one).
    pub fn new(load: &[usize], group: &Group) -> Result<Self> {
        let mine = local_experts(load.len(), group.rank(), group.size())?;
        let loads = if group.size() == 1 {
            vec![load.to_vec()]
        } else {
            let counts: Vec<u32> = load.iter().map(|c| *c as u32).collect();
            let all =
                group.all_gather(&Tensor::new(counts.as_slice(), &candle_core::Device::Cpu)?)?;
            all.iter()
                .map(|t| {
                    Ok(t.to_vec1::<u32>()?
                        .into_iter()
                        .map(|c| c as usize)
                        .collect())
                })
                .collect::<Result<_>>()?
        };
        if loads.iter().any(|l: &Vec<usize>| l.len() != load.len()) {
            return Err(invalid!(
                "the members of an expert group route to different numbers of experts"
            ));
        }
        Ok(Self {
            group: group.clone(),
            mine,
            loads,
        })
    }

    /// Every member's rows per expert, summed: the whole group's load.
    pub fn total_load(&self) -> Vec<usize> {
        let mut out = vec![0; self.loads[0].len()];
        for l in &self.loads {
            out.iter_mut().zip(l).for_each(|(o, c)| *o += c);
        }
        out
    }

    /// `expert(j, rows)` (local expert `j`, from 0, on all the group's rows routed to it) for
    /// this member's rows `x` sorted by expert (`load[e]` rows for each expert `e` in order, as
    /// given to [`Dispatch::new`]): the outputs in `x`'s row order. An expert no row is routed
    /// to is not run.
    pub fn run(
        &self,
        x: &Tensor,
        mut expert: impl FnMut(usize, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        // The received rows' expert-major order, once for the dispatch and the combine.
        let order = match self.group.size() {
            1 => Vec::new(),
            _ => self.expert_major(),
        };
        let (input, counts) = self.dispatch(x, &order)?;
        let mut outs = Vec::new();
        let mut at = 0;
        for (j, n) in counts.iter().enumerate() {
            if *n > 0 {
                outs.push(expert(j, &input.narrow(0, at, *n)?)?);
            }
            at += n;
        }
        // No row here: the (empty) input stands for the output, keeping the combine in the
        // graph, so that its backward exchange runs on this member as on the others.
        let y = if outs.is_empty() {
            input
        } else {
            Tensor::cat(&outs, 0)?
        };
        self.combine(&y, &order)
    }

    /// Rows from member `s` for local expert `j`: where they start among the rows received
    /// (member by member, expert by expert), and how many.
    fn block(&self, s: usize, j: usize) -> (usize, usize) {
        let before: usize = self.loads[..s]
            .iter()
            .map(|l| l[self.mine.clone()].iter().sum::<usize>())
            .sum();
        let within: usize = self.loads[s][self.mine.start..self.mine.start + j]
            .iter()
            .sum();
        (before + within, self.loads[s][self.mine.start + j])
    }

    /// The received rows in expert-major order: for each local expert, each member's rows.
    fn expert_major(&self) -> Vec<u32> {
        let mut order = Vec::new();
        for j in 0..self.mine.len() {
            for s in 0..self.loads.len() {
                let (start, n) = self.block(s, j);
                order.extend((start..start + n).map(|i| i as u32));
            }
        }
        order
    }

    /// Rows member `m` sends (the rows of `m`'s experts) when member `from` sends them.
    fn sends(&self, from: usize) -> Vec<usize> {
        let per = self.mine.len();
        (0..self.loads.len())
            .map(|m| self.loads[from][m * per..(m + 1) * per].iter().sum())
            .collect()
    }

    /// This member's rows for its experts, expert by expert (the received rows taken in
    /// `order`), and each expert's row count.
    fn dispatch(&self, x: &Tensor, order: &[u32]) -> Result<(Tensor, Vec<usize>)> {
        let counts: Vec<usize> = self
            .mine
            .clone()
            .map(|e| self.loads.iter().map(|l| l[e]).sum())
            .collect();
        if self.group.size() == 1 {
            return Ok((x.clone(), counts));
        }
        let got = exchange(x, &self.sends(self.group.rank()), &self.group)?;
        if order.is_empty() {
            return Ok((got, counts));
        }
        let order = Tensor::new(order, x.device())?;
        Ok((got.index_select(&order, 0)?, counts))
    }

    /// The experts' outputs `y` (expert-major, as [`Dispatch::dispatch`] gave the rows in
    /// `order`) back on the members the rows came from, in their order.
    fn combine(&self, y: &Tensor, order: &[u32]) -> Result<Tensor> {
        if self.group.size() == 1 {
            return Ok(y.clone());
        }
        let y = if order.is_empty() {
            y.clone()
        } else {
            let mut back = vec![0u32; order.len()];
            for (i, o) in order.iter().enumerate() {
                back[*o as usize] = i as u32;
            }
            y.index_select(&Tensor::new(back.as_slice(), y.device())?, 0)?
        };
        let me = self.group.rank();
        let sends: Vec<usize> = (0..self.loads.len()).map(|s| self.sends(s)[me]).collect();
        exchange(&y, &sends, &self.group)
    }
}

/// `x`'s rows, `send[m]` of them (in order) for each member `m`, exchanged over `group`: the
/// rows every member sent this one, joined in member order. An autograd op whose backward is
/// the reverse exchange (collective, in the same order on every member).
fn exchange(x: &Tensor, send: &[usize], group: &Group) -> Result<Tensor> {
    let comm = group
        .comm()
        .ok_or_else(|| invalid!("an expert exchange needs a group of more than one rank"))?;
    let got = timed_all_to_all(comm, &split_rows(&x.detach(), send)?)?;
    let recv: Vec<usize> = got
        .iter()
        .map(|t| t.dim(0))
        .collect::<candle_core::Result<_>>()?;
    let value = join_rows(&got, x)?;
    let (g, send) = (group.clone(), send.to_vec());
    precomputed(x, value, "expert-exchange", move |grad| {
        let comm = g.comm().expect("a group of more than one rank");
        let back = timed_all_to_all(comm, &split_rows(grad, &recv)?)?;
        let out = join_rows(&back, grad)?;
        if out.dim(0)? != send.iter().sum::<usize>() {
            return Err(invalid!(
                "an expert exchange's backward got {} rows for the {} it sent",
                out.dim(0)?,
                send.iter().sum::<usize>()
            ));
        }
        Ok(out)
    })
}

/// `x`'s rows cut into consecutive parts of `rows[m]` rows, each contiguous.
fn split_rows(x: &Tensor, rows: &[usize]) -> Result<Vec<Tensor>> {
    let total: usize = rows.iter().sum();
    if x.dim(0)? != total {
        return Err(invalid!(
            "an expert exchange sends {total} rows but has {}",
            x.dim(0)?
        ));
    }
    let mut at = 0;
    rows.iter()
        .map(|n| {
            let p = x.narrow(0, at, *n)?.contiguous()?;
            at += n;
            Ok(p)
        })
        .collect()
}

/// `parts` joined along their rows on `like`'s device (empty parts skipped; none at all: zero
/// rows of `like`'s row shape and dtype).
fn join_rows(parts: &[Tensor], like: &Tensor) -> Result<Tensor> {
    let parts: Vec<Tensor> = parts
        .iter()
        .filter(|p| p.dim(0).is_ok_and(|n| n > 0))
        .map(|p| p.to_device(like.device()))
        .collect::<candle_core::Result<_>>()?;
    match parts.len() {
        0 => {
            let mut dims = like.dims().to_vec();
            dims[0] = 0;
            Ok(Tensor::zeros(dims, like.dtype(), like.device())?)
        }
        1 => Ok(parts[0].clone()),
        _ => Ok(Tensor::cat(&parts, 0)?),
    }
}

/// Every member's `named` tensors (its experts), members in order (collective over `group`):
/// members hold as many as each other, of the same shapes in the same order (their own
/// experts of each mixture), under their own names.
pub fn gather_named(named: &[(String, Tensor)], group: &Group) -> Result<Vec<(String, Tensor)>> {
    let Some(comm) = group.comm() else {
        return Ok(named.to_vec());
    };
    let names: Vec<u8> = named
        .iter()
        .map(|(n, _)| n.as_str())
        .collect::<Vec<_>>()
        .join("\n")
        .into_bytes();
    let names = Tensor::new(names.as_slice(), &candle_core::Device::Cpu)?;
    let all_names = comm.all_to_all(&vec![names; comm.size()])?;
    let mut values: Vec<Vec<Tensor>> = vec![Vec::new(); comm.size()];
    for (_, t) in named {
        for (m, v) in comm.all_gather(&t.contiguous()?)?.into_iter().enumerate() {
            values[m].push(v.to_device(t.device())?);
        }
    }
    let mut out = Vec::new();
    for (m, (names, values)) in all_names.iter().zip(values).enumerate() {
        let names = String::from_utf8(names.to_vec1::<u8>()?)
            .map_err(|_| invalid!("member {m} of an expert group sent a name that is not UTF-8"))?;
        let names: Vec<&str> = names.split('\n').filter(|n| !n.is_empty()).collect();
        if names.len() != values.len() {
            return Err(invalid!(
                "member {m} of an expert group names {} experts' tensors but holds {}",
                names.len(),
                values.len()
            ));
        }
        out.extend(names.into_iter().map(String::from).zip(values));
    }
    Ok(out)
}

/// How unevenly rows fell on the experts: the most rows an expert took over the mean (1 when
/// even, or when there were none).
pub fn imbalance(load: &[usize]) -> f64 {
    let total: usize = load.iter().sum();
    if total == 0 || load.is_empty() {
        return 1.0;
    }
    let mean = total as f64 / load.len() as f64;
    *load.iter().max().expect("non-empty") as f64 / mean
}
