//! Layers split over a tensor-parallel group (TorchShard's `ParallelLinear` and
//! `ParallelEmbedding`, Megatron's column- and row-parallel linears).
//!
//! Each rank builds the whole parameter from the name-keyed stream a serial run draws from and
//! keeps only its part, so a split model starts from exactly the serial weights.

use candle_core::{DType, Tensor, Var};

use super::attr::register_parallel_attribute;
use super::ops::{
    copy_to_group, gather_from_group, gather_sequence, reduce_from_group, reduce_scatter_sequence,
    scatter_to_group,
};
use super::part;
use crate::distributed::comm::Group;
use crate::model::init::Init;
use crate::model::nn::{join, Embedding, Linear, Module};
use crate::model::WeightLayout;
use crate::model::{Cx, Shard};
use crate::{invalid, Error, Result};

/// Which features of a linear layer are split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParallelDim {
    /// Output features (TorchShard's dim `-1` or `1`): each rank computes some outputs.
    Column,
    /// Input features (TorchShard's dim `0`): each rank multiplies its part of the input, the
    /// partial outputs are summed over the group.
    Row,
}

impl ParallelDim {
    /// From TorchShard's `dim` argument (`None` is a replicated layer).
    pub fn from_torchshard(dim: Option<i64>) -> Result<Option<Self>> {
        match dim {
            None => Ok(None),
            Some(-1 | 1) => Ok(Some(ParallelDim::Column)),
            Some(0) => Ok(Some(ParallelDim::Row)),
            Some(d) => Err(invalid!(
                "parallel dim {d}: use -1 or 1 (split outputs), 0 (split inputs) or none"
            )),
        }
    }

    /// TorchShard's value: `-1` or `0`.
    pub fn torchshard(self) -> i64 {
        match self {
            ParallelDim::Column => -1,
            ParallelDim::Row => 0,
        }
    }
}

/// A linear layer whose weight is split over the tensor-parallel group of its [`Init`].
///
/// - replicated (`None`): every rank holds the whole layer;
/// - [`ParallelDim::Column`]: the input is copied to the group, each rank computes its output
///   features; the output stays split (marked parallel on the last dim in the [`Cx`]) unless
///   [`ParallelLinear::gather_output`] asks for the whole;
/// - [`ParallelDim::Row`]: each rank multiplies its input features (the input is split first
///   unless it already is), the partial outputs are all-reduced, then the whole bias is added.
#[derive(Clone, Debug)]
pub struct ParallelLinear {
    name: String,
    dim: Option<ParallelDim>,
    /// This rank's part (with the bias, except for row-parallel layers).
    local: Linear,
    /// A row-parallel layer's bias, added after the reduction.
    row_bias: Option<Var>,
    group: Group,
    stride: usize,
    gather_output: bool,
    input_is_parallel: bool,
    /// Megatron's sequence parallelism: a column-parallel layer all-gathers its input along
    /// the sequence (instead of copying it), a row-parallel one reduce-scatters its output
    /// along it (instead of all-reducing).
    sequence_parallel: bool,
    shards: Vec<(String, Shard)>,
}

impl ParallelLinear {
    /// TorchShard's `ParallelLinear(in, out, bias, dim)`: PyTorch's initialisation, weight
    /// stored `(out, in)`; `dim` is TorchShard's (`None`, `-1`/`1`, `0`).
    pub fn new(
        init: &Init,
        group: &Group,
        name: &str,
        inp: usize,
        out: usize,
        bias: bool,
        dim: Option<i64>,
    ) -> Result<Self> {
        let whole = Linear::new(init, name, inp, out, bias)?;
        Self::from_whole(whole, ParallelDim::from_torchshard(dim)?, 1, group)
    }

    /// This rank's part of `whole` split on `dim` over `group`. `stride` > 1 splits the output
    /// features as that many blocks (GPT's fused q|k|v: each rank gets its heads of each).
    pub fn from_whole(
        whole: Linear,
        dim: Option<ParallelDim>,
        stride: usize,
        group: &Group,
    ) -> Result<Self> {
        let name = whole.name().to_string();
        let layout = whole.layout();
        let (inp, out) = (whole.in_features(), whole.out_features());
        let err = |e: Error| Error::Layer {
            layer: name.clone(),
            msg: format!(
                "cannot split {inp} inputs x {out} outputs over {} tensor-parallel ranks: {e}",
                group.size()
            ),
        };
        if dim == Some(ParallelDim::Row) && stride != 1 {
            return Err(err(invalid!(
                "a strided split applies to output features only"
            )));
        }
        let mut shards = Vec::new();
        // In a group of one nothing is split.
        let split = if group.size() == 1 { None } else { dim };
        let (local, row_bias) = match split {
            None => (whole, None),
            Some(d) => {
                let w = whole.weight().as_tensor();
                let ws =
                    register_parallel_attribute(w.dims(), d.torchshard(), layout, stride, group)
                        .map_err(err)?;
                let wpart = part(w, ws.axis, stride, ws.index, ws.count)?.contiguous()?;
                shards.push((join(&name, "weight"), ws));
                let (bias, row_bias) = match (whole.bias(), d) {
                    (None, _) => (None, None),
                    (Some(b), ParallelDim::Row) => (None, Some(b.clone())),
                    (Some(b), ParallelDim::Column) => {
                        let bs = register_parallel_attribute(b.dims(), -1, layout, stride, group)
                            .map_err(err)?;
                        let bpart = part(b.as_tensor(), 0, stride, bs.index, bs.count)?;
                        shards.push((join(&name, "bias"), bs));
                        (Some(Var::from_tensor(&bpart.contiguous()?)?), None)
                    }
                };
                let local = Linear::from_vars(&name, Var::from_tensor(&wpart)?, bias, layout)?;
                (local, row_bias)
            }
        };
        Ok(Self {
            name,
            dim,
            local,
            row_bias,
            group: group.clone(),
            stride,
            gather_output: false,
            input_is_parallel: false,
            sequence_parallel: false,
            shards,
        })
    }

    /// A column-parallel layer returns the whole output on every rank (an all-gather).
    pub fn gather_output(mut self, on: bool) -> Self {
        self.gather_output = on;
        self
    }

    /// A row-parallel layer takes its input already split (Megatron's `input_is_parallel`);
    /// otherwise it splits a whole input itself unless the [`Cx`] marks it split.
    pub fn input_is_parallel(mut self, on: bool) -> Self {
        self.input_is_parallel = on;
        self
    }

    /// How the layer is split (`None`: replicated).
    pub fn dim(&self) -> Option<ParallelDim> {
        self.dim
    }

    /// This rank's part as a plain linear layer.
    pub fn local(&self) -> &Linear {
        &self.local
    }

    /// Changes this rank's part (for example to declare [`Linear::inert_bias`]).
    pub fn map_local(mut self, f: impl FnOnce(Linear) -> Linear) -> Self {
        self.local = f(self.local);
        self
    }

    /// The layer on `x`, with the collectives its split needs.
    pub fn forward(&self, x: &Tensor, cx: &mut Cx) -> Result<Tensor> {
        let g = &self.group;
        match self.dim {
            None => self.local.forward_cx(x, cx),
            Some(ParallelDim::Column) => {
                let x = if self.sequence_parallel {
                    gather_sequence(x, g)?
                } else {
                    copy_to_group(x, g)?
                };
                self.column_output(self.local.forward_cx(&x, cx)?, cx)
            }
            Some(ParallelDim::Row) => {
                let x = if g.size() == 1 || self.input_is_parallel || cx.parallel_dim(x) == Some(-1)
                {
                    x.clone()
                } else {
                    scatter_to_group(x, g, x.rank().saturating_sub(1), 1)?
                };
                let y = self.local.forward_cx(&x, cx)?;
                let (y, b) = match (&self.row_bias, self.sequence_parallel) {
                    // The bias meets only this rank's positions: its gradient is summed.
                    (Some(b), true) => (
                        reduce_scatter_sequence(&y, g)?,
                        Some(copy_to_group(b.as_tensor(), g)?),
                    ),
                    (None, true) => (reduce_scatter_sequence(&y, g)?, None),
                    (b, false) => (
                        reduce_from_group(&y, g)?,
                        b.as_ref().map(|b| b.as_tensor().clone()),
                    ),
                };
                match b {
                    Some(b) => crate::model::nn::linear::add_bias(&y, &b),
                    None => Ok(y),
                }
            }
        }
    }

    /// A column-parallel layer's forward of an input already whole on every rank of the group
    /// and already routed into it (the output of [`crate::parallel::tensor_parallel::SequenceParallel::gather`],
    /// shared by several layers that read the same input: Llama's q, k and v): no collective
    /// on the input.
    pub fn forward_gathered(&self, x: &Tensor, cx: &mut Cx) -> Result<Tensor> {
        if self.dim != Some(ParallelDim::Column) {
            return Err(Error::Layer {
                layer: self.name.clone(),
                msg: "only a column-parallel layer takes a gathered input".into(),
            });
        }
        self.column_output(self.local.forward_cx(x, cx)?, cx)
    }

    /// A column-parallel layer's output: gathered when asked, else marked split.
    fn column_output(&self, y: Tensor, cx: &mut Cx) -> Result<Tensor> {
        let g = &self.group;
        if self.gather_output {
            return gather_from_group(&y, g, y.rank() - 1, self.stride);
        }
        if g.size() > 1 {
            cx.set_parallel_dim(&y, Some(-1));
        }
        Ok(y)
    }

    /// The same layer under sequence parallelism when `on` (and the group has more than one
    /// rank): see [`crate::parallel::tensor_parallel::sequence`].
    pub fn sequence_parallel(mut self, on: bool) -> Self {
        self.sequence_parallel = on && self.group.size() > 1 && self.dim.is_some();
        self
    }
}

impl Module for ParallelLinear {
    fn params(&self) -> Vec<(String, Var)> {
        let mut v = self.local.params();
        if let Some(b) = &self.row_bias {
            v.push((join(&self.name, "bias"), b.clone()));
        }
        v
    }
}

impl ParallelLinear {
    /// How this layer's parameters are split over the group (none when whole).
    pub fn shards(&self) -> Vec<(String, Shard)> {
        self.shards.clone()
    }
}

/// An embedding table split by vocabulary over the tensor-parallel group (Megatron's
/// `VocabParallelEmbedding`): each rank looks up the ids in its range of rows, gives zeros for
/// the others, and the group sums.
#[derive(Clone, Debug)]
pub struct ParallelEmbedding {
    name: String,
    local: Embedding,
    num: usize,
    start: usize,
    group: Group,
    shard: Option<Shard>,
}

impl ParallelEmbedding {
    /// Normal(0, std) table of `num` rows drawn as a serial [`Embedding`] draws it, this rank's
    /// rows kept. `num` must be a multiple of the group size.
    pub fn new(
        init: &Init,
        group: &Group,
        name: &str,
        num: usize,
        dim: usize,
        std: f64,
    ) -> Result<Self> {
        let whole = Embedding::new(init, name, num, dim, std)?;
        Self::from_whole(whole, group)
    }

    /// This rank's rows of `whole`.
    pub fn from_whole(whole: Embedding, group: &Group) -> Result<Self> {
        let name = whole.name().to_string();
        let w = whole.weight().as_tensor();
        let (num, _) = w.dims2()?;
        if group.size() == 1 {
            return Ok(Self {
                name,
                local: whole,
                num,
                start: 0,
                group: group.clone(),
                shard: None,
            });
        }
        let s = register_parallel_attribute(w.dims(), 0, WeightLayout::InOut, 1, group).map_err(
            |e| Error::Layer {
                layer: name.clone(),
                msg: format!(
                    "a vocabulary of {num} rows cannot be split over {} tensor-parallel ranks ({e}); \
                     pad the vocabulary to a multiple of {}",
                    group.size(),
                    group.size()
                ),
            },
        )?;
        let rows = num / s.count;
        let local = part(w, 0, 1, s.index, s.count)?.contiguous()?;
        Ok(Self {
            local: Embedding::from_var(&name, Var::from_tensor(&local)?),
            name,
            num,
            start: s.index * rows,
            group: group.clone(),
            shard: Some(s),
        })
    }

    /// This rank's rows as a plain embedding.
    pub fn local(&self) -> &Embedding {
        &self.local
    }

    /// Looks `ids` up (any shape); ids outside the whole table are an error.
    pub fn forward(&self, ids: &Tensor, cx: &Cx) -> Result<Tensor> {
        if self.group.size() == 1 {
            return self.local.forward_cx(ids, cx);
        }
        // Read on the host copy when there is one: a read of the device's waits for its queue.
        let src = cx.host_copy(ids).unwrap_or(ids);
        let flat: Vec<u32> = src.flatten_all()?.to_dtype(DType::U32)?.to_vec1()?;
        let rows = self.num / self.group.size();
        let mut local = Vec::with_capacity(flat.len());
        let mut mask = Vec::with_capacity(flat.len());
        for &i in &flat {
            let i = i as usize;
            if i >= self.num {
                return Err(Error::Layer {
                    layer: self.name.clone(),
                    msg: format!("id {i} is outside the table of {} entries", self.num),
                });
            }
            let mine = (self.start..self.start + rows).contains(&i);
            local.push(if mine { (i - self.start) as u32 } else { 0 });
            mask.push(if mine { 1f32 } else { 0f32 });
        }
        let dev = ids.device();
        let local_host = Tensor::from_vec(local, ids.dims(), &candle_core::Device::Cpu)?;
        let local = local_host.to_device(dev)?;
        let y = self.local.forward_with_host(&local, &local_host, cx)?;
        let mut mdims = ids.dims().to_vec();
        mdims.push(1);
        let mask = Tensor::from_vec(mask, mdims, dev)?.to_dtype(y.dtype())?;
        reduce_from_group(&y.broadcast_mul(&mask)?, &self.group)
    }
}

impl Module for ParallelEmbedding {
    fn params(&self) -> Vec<(String, Var)> {
        self.local.params()
    }
}

impl ParallelEmbedding {
    /// How the table is split over the group (none when whole).
    pub fn shards(&self) -> Vec<(String, Shard)> {
        self.shard
            .iter()
            .map(|s| (join(&self.name, "weight"), s.clone()))
            .collect()
    }
}
