//! How ZeRO cuts one rank's parameters over its data-parallel group.
//!
//! Conventions, stated once:
//! - Parameters are laid end to end (flattened, in the order given) into buckets
//!   ([`crate::parallel::data_parallel::buckets`], the bucketing of plain gradient sums); a bucket never
//!   spans two groups (a group is a tag the caller gives: a model stage, or "reduced after the
//!   pipeline" for tied weights).
//! - Each bucket is padded with zeros to a multiple of the group size `n`; member `r` owns its
//!   elements `[r * len / n, (r + 1) * len / n)`: its *shard*. A reduce-scatter of the bucket
//!   leaves each member its shard's sum; an all-gather of the shards gives the bucket back.
//! - A *piece* is the part of one parameter inside this member's shard: one run of its
//!   flattened elements (a parameter lies in one bucket, so a member holds at most one piece
//!   of it). A piece keeps its parameter's rank (ones before its length), so an optimizer's
//!   rules keyed by rank (weight decay on matrices only) treat it as its parameter.
//! - Everything a plan moves is f32 (gradients, master weights, optimizer moments).

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use candle_core::{DType, Device, Tensor};

use crate::distributed::comm::{Communicator, Pending, ReduceOp};
use crate::parallel::data_parallel::buckets;
use crate::{invalid, Result};

/// A parameter as a plan is made from it.
#[derive(Clone, Debug)]
pub struct ParamSpec {
    /// The parameter's global name.
    pub name: String,
    /// Its shape.
    pub dims: Vec<usize>,
    /// Its group tag: buckets never span two groups.
    pub group: usize,
    /// The layer (global index) whose backward gives its gradient: a bucket's gradients are
    /// complete once each of its layers has given them ([`ShardPlan::bucket_layers`]).
    pub layer: usize,
}

/// The buckets and this member's pieces of a rank's parameters (see the module's conventions).
#[derive(Clone, Debug)]
pub struct ShardPlan {
    buckets: Vec<Bucket>,
    pieces: Vec<Piece>,
    /// Each parameter's group tag.
    tags: BTreeMap<String, usize>,
    rank: usize,
    size: usize,
    device: Device,
}

#[derive(Clone, Debug)]
struct Bucket {
    tag: usize,
    /// The layers its parameters belong to.
    layers: BTreeSet<usize>,
    /// (name, shape, first element in the bucket).
    params: Vec<(String, Vec<usize>, usize)>,
    /// Elements before padding.
    len: usize,
    /// Elements of each member's shard.
    shard: usize,
}

/// The part of one parameter a member owns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The parameter's global name.
    pub name: String,
    /// The parameter's shape.
    pub dims: Vec<usize>,
    /// The flattened parameter's elements this piece holds.
    pub elems: Range<usize>,
    bucket: usize,
    /// Where the piece starts in the member's shard.
    at: usize,
}

impl Piece {
    /// This piece of `whole` (its parameter, or a state of the parameter's shape named
    /// `what`), in f32.
    pub fn cut(&self, whole: &Tensor, what: &str) -> Result<Tensor> {
        if whole.elem_count() != self.dims.iter().product::<usize>() {
            return Err(crate::Error::State(format!(
                "`{what}` has shape {:?} but its parameter `{}` has {:?}",
                whole.dims(),
                self.name,
                self.dims
            )));
        }
        Ok(whole
            .to_dtype(DType::F32)?
            .flatten_all()?
            .narrow(0, self.elems.start, self.elems.len())?
            .reshape(self.shape())?)
    }

    /// The piece's shape: its parameter's rank, ones before its length.
    pub fn shape(&self) -> Vec<usize> {
        let mut s = vec![1; self.dims.len().saturating_sub(1)];
        s.push(self.elems.len());
        s
    }
}

impl ShardPlan {
    /// The plan of `params` (in order, each with its group tag) over a group of `size`
    /// members, for member `rank`, in buckets of about `bucket_bytes`, on `device`.
    pub fn new(
        params: &[ParamSpec],
        bucket_bytes: usize,
        rank: usize,
        size: usize,
        device: Device,
    ) -> Result<Self> {
        if size == 0 || rank >= size {
            return Err(invalid!(
                "a ZeRO shard plan for member {rank} of a group of {size}"
            ));
        }
        let mut out = Self {
            buckets: Vec::new(),
            pieces: Vec::new(),
            tags: params.iter().map(|p| (p.name.clone(), p.group)).collect(),
            rank,
            size,
            device,
        };
        let mut start = 0;
        while start < params.len() {
            let tag = params[start].group;
            let end = start
                + params[start..]
                    .iter()
                    .take_while(|p| p.group == tag)
                    .count();
            let run = &params[start..end];
            let sizes: Vec<usize> = run.iter().map(|p| p.dims.iter().product()).collect();
            for r in buckets(&sizes, bucket_bytes) {
                let mut at = 0;
                let mut entries = Vec::new();
                for (p, n) in run[r.clone()].iter().zip(&sizes[r.clone()]) {
                    entries.push((p.name.clone(), p.dims.clone(), at));
                    at += n;
                }
                let layers = run[r].iter().map(|p| p.layer).collect();
                out.push_bucket((tag, layers), entries, at);
            }
            start = end;
        }
        Ok(out)
    }

    fn push_bucket(
        &mut self,
        (tag, layers): (usize, BTreeSet<usize>),
        params: Vec<(String, Vec<usize>, usize)>,
        len: usize,
    ) {
        let shard = len.div_ceil(self.size);
        let mine = self.rank * shard..(self.rank + 1) * shard;
        let bucket = self.buckets.len();
        for (name, dims, first) in &params {
            let n: usize = dims.iter().product();
            let (lo, hi) = ((*first).max(mine.start), (first + n).min(mine.end));
            if lo < hi {
                self.pieces.push(Piece {
                    name: name.clone(),
                    dims: dims.clone(),
                    elems: lo - first..hi - first,
                    bucket,
                    at: lo - mine.start,
                });
            }
        }
        self.buckets.push(Bucket {
            tag,
            layers,
            params,
            len,
            shard,
        });
    }

    /// This member's pieces, in bucket order.
    pub fn pieces(&self) -> &[Piece] {
        &self.pieces
    }

    /// The members of the group.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Elements of this member's shards over all buckets (padding included): what it keeps
    /// of each f32 state.
    pub fn shard_elems(&self) -> usize {
        self.buckets.iter().map(|b| b.shard).sum()
    }

    /// The buckets of group `tag`.
    pub fn buckets_of(&self, tag: usize) -> Vec<usize> {
        (0..self.buckets.len())
            .filter(|b| self.buckets[*b].tag == tag)
            .collect()
    }

    /// The layers whose parameters bucket `b` holds.
    pub fn bucket_layers(&self, b: usize) -> &BTreeSet<usize> {
        &self.buckets[b].layers
    }

    /// Whether bucket `b` holds parameter `name`.
    pub fn bucket_holds(&self, b: usize, name: &str) -> bool {
        self.buckets[b].params.iter().any(|p| p.0 == name)
    }

    /// The number of buckets.
    pub fn bucket_count(&self) -> usize {
        self.buckets.len()
    }

    /// Whether parameter `name` belongs to group `tag`.
    pub fn in_group(&self, name: &str, tag: usize) -> bool {
        self.tags.get(name) == Some(&tag)
    }

    /// The piece of `name` this member holds, if any.
    pub fn piece(&self, name: &str) -> Option<&Piece> {
        self.pieces.iter().find(|p| p.name == name)
    }

    /// The pieces of the whole tensors `get` gives (by name; a name it has no tensor for has
    /// no piece), in f32.
    pub fn cut(&self, get: impl Fn(&str) -> Option<Tensor>) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for p in &self.pieces {
            if let Some(t) = get(&p.name) {
                out.push((p.name.clone(), p.cut(&t, &p.name)?));
            }
        }
        Ok(out)
    }

    /// Bucket `b` of the whole tensors `get` gives, flat in f32 and padded (a name without a
    /// tensor reads as zeros), reduced over the group: this member's shard of the sum, in
    /// flight ([`Communicator::ireduce_scatter`]).
    pub fn reduce_scatter(
        &self,
        b: usize,
        comm: &dyn Communicator,
        get: impl Fn(&str) -> Option<Tensor>,
    ) -> Result<Pending<Tensor>> {
        let bucket = &self.buckets[b];
        let mut flat = Vec::new();
        for (name, dims, _) in &bucket.params {
            let n: usize = dims.iter().product();
            flat.push(match get(name) {
                Some(t) => t.to_dtype(DType::F32)?.flatten_all()?,
                None => Tensor::zeros(n, DType::F32, &self.device)?,
            });
        }
        let pad = bucket.shard * self.size - bucket.len;
        if pad > 0 {
            flat.push(Tensor::zeros(pad, DType::F32, &self.device)?);
        }
        comm.ireduce_scatter(&Tensor::cat(&flat, 0)?, ReduceOp::Sum)
    }

    /// The pieces of bucket `b` in this member's `shard` of it.
    pub fn split_shard(&self, b: usize, shard: &Tensor) -> Result<Vec<(String, Tensor)>> {
        self.pieces
            .iter()
            .filter(|p| p.bucket == b)
            .map(|p| {
                let t = shard.narrow(0, p.at, p.elems.len())?.reshape(p.shape())?;
                Ok((p.name.clone(), t))
            })
            .collect()
    }

    /// The whole tensors of every member's pieces (collective over the group): each member
    /// gives its pieces by name (`pieces`), and gets every parameter whole in f32. Unless
    /// `everywhere` (every parameter has a value: weights), a parameter is returned only where
    /// some member had a piece of it (optimizer state not made yet is not made up).
    pub fn gather(
        &self,
        comm: &dyn Communicator,
        pieces: &BTreeMap<String, Tensor>,
        everywhere: bool,
    ) -> Result<BTreeMap<String, Tensor>> {
        let mut out = BTreeMap::new();
        self.gather_each(comm, pieces, everywhere, |n, t| {
            out.insert(n.to_string(), t);
            Ok(())
        })?;
        Ok(out)
    }

    /// [`ShardPlan::gather`] giving each whole tensor to `take` as its bucket arrives, so that
    /// no more than one bucket is held whole at a time (the weights after a step).
    pub fn gather_each(
        &self,
        comm: &dyn Communicator,
        pieces: &BTreeMap<String, Tensor>,
        everywhere: bool,
        mut take: impl FnMut(&str, Tensor) -> Result<()>,
    ) -> Result<()> {
        let names: Vec<&String> = self
            .buckets
            .iter()
            .flat_map(|b| b.params.iter().map(|p| &p.0))
            .collect();
        let present: Vec<bool> = if everywhere || self.size == 1 {
            vec![true; names.len()]
        } else {
            let mine: Vec<u32> = names
                .iter()
                .map(|n| u32::from(pieces.contains_key(n.as_str())))
                .collect();
            let t = Tensor::new(mine.as_slice(), &Device::Cpu)?;
            let all = comm.all_reduce(&t, ReduceOp::Max)?.to_vec1::<u32>()?;
            all.iter().map(|f| *f == 1).collect()
        };
        let mut i = 0;
        for b in 0..self.buckets.len() {
            let whole = self.gather_bucket(b, comm, pieces)?;
            for (name, dims, first) in &self.buckets[b].params {
                if present[i] {
                    take(name, param_of(&whole, dims, *first)?)?;
                }
                i += 1;
            }
        }
        Ok(())
    }

    /// Bucket `b` whole, flat in f32 (collective over the group): every member's shard of it
    /// from its `pieces` (by name; a piece it lacks reads as zeros), all-gathered.
    pub fn gather_bucket(
        &self,
        b: usize,
        comm: &dyn Communicator,
        pieces: &BTreeMap<String, Tensor>,
    ) -> Result<Tensor> {
        self.start_gather_bucket(b, comm, pieces)?.wait()
    }

    /// [`ShardPlan::gather_bucket`] started: the shards travel while the caller computes
    /// ([`Communicator::iall_gather`]); the pieces are read now.
    pub fn start_gather_bucket(
        &self,
        b: usize,
        comm: &dyn Communicator,
        pieces: &BTreeMap<String, Tensor>,
    ) -> Result<Pending<Tensor>> {
        let bucket = &self.buckets[b];
        let mut shard = Vec::new();
        let mut filled = 0;
        for p in self.pieces.iter().filter(|p| p.bucket == b) {
            shard.push(match pieces.get(&p.name) {
                Some(t) => t.to_dtype(DType::F32)?.flatten_all()?,
                None => Tensor::zeros(p.elems.len(), DType::F32, &self.device)?,
            });
            filled += p.elems.len();
        }
        if filled < bucket.shard {
            shard.push(Tensor::zeros(
                bucket.shard - filled,
                DType::F32,
                &self.device,
            )?);
        }
        let parts = comm.iall_gather(&Tensor::cat(&shard, 0)?)?;
        let device = self.device.clone();
        Ok(Pending::new(move || {
            let parts: Vec<Tensor> = (parts.wait()?.into_iter())
                .map(|t| t.to_device(&device))
                .collect::<candle_core::Result<_>>()?;
            Ok(Tensor::cat(&parts, 0)?)
        }))
    }

    /// The buckets that hold any of `names`, in order.
    pub fn buckets_holding(&self, names: &[String]) -> Vec<usize> {
        (0..self.buckets.len())
            .filter(|b| self.buckets[*b].params.iter().any(|p| names.contains(&p.0)))
            .collect()
    }

    /// The parameters of bucket `b` cut from its whole value (as [`ShardPlan::gather_bucket`]
    /// gives it): (name, tensor of the parameter's shape).
    pub fn params_of_bucket(&self, b: usize, whole: &Tensor) -> Result<Vec<(String, Tensor)>> {
        self.buckets[b]
            .params
            .iter()
            .map(|(name, dims, first)| Ok((name.clone(), param_of(whole, dims, *first)?)))
            .collect()
    }
}

/// The parameter of shape `dims` that starts at element `first` of a flat bucket.
fn param_of(whole: &Tensor, dims: &[usize], first: usize) -> Result<Tensor> {
    let n: usize = dims.iter().product();
    Ok(whole.narrow(0, first, n)?.reshape(dims)?)
}
