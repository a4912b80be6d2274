//! ZeRO in the Varuna step ([`crate::parallel::zero`]): the plan of this rank's parameters over its
//! data-parallel group, and the f32 state a checkpoint reads and writes, whole or in pieces.

use std::collections::BTreeMap;
use std::sync::Arc;

use candle_core::{DType, Tensor, Var};

use super::zero_groups::{BothGather, Replicas, ZeroGroups};
use super::Varuna;
use crate::distributed::comm::Communicator;
use crate::model::precision::MasterWeights;
use crate::parallel::expert_parallel::gather_named;
use crate::parallel::pipeline::Pipeline;
use crate::parallel::zero::{LayerGather, ParamSpec, ShardPlan, Zero, ZeroShards, AFTER_PIPELINE};
use crate::Result;

/// The f32 master weights a rank updates: whole, or under ZeRO its replica's pieces.
pub(super) enum Weights {
    /// Every master weight of the rank's stages and shards.
    Whole(MasterWeights),
    /// This replica's pieces of them (the experts' over their own group).
    Sharded(Box<ZeroGroups>),
}

/// This rank's weights: under ZeRO (when `zero` shards anything) each model stage's parameters in
/// buckets of their own (their gradients are complete together; under ZeRO-3 each layer's,
/// which the layer gathers when it computes), tied weights apart (they are summed between
/// stages after the pipeline), the experts (`split_experts`: under expert parallelism) sharded
/// over the ranks holding them, the whole masters dropped once cut, ZeRO-3 holding at most
/// `live` gathered layers; else `masters` whole (without ZeRO or with one replica).
pub(super) fn weights(
    zero: Zero,
    pipeline: &mut Pipeline,
    (tied, bucket_bytes, live): (&[(String, String)], usize, usize),
    c: Replicas<'_>,
    split_experts: bool,
    masters: MasterWeights,
) -> Result<Weights> {
    if zero == Zero::Off || c.dense.size() == 1 {
        return Ok(Weights::Whole(masters));
    }
    let is_tied = |n: &str| tied.iter().any(|(a, b)| a == n || b == n);
    let experts = pipeline.experts().to_vec();
    // Index 0: every replica's parameters; 1: the experts.
    let mut specs: [Vec<ParamSpec>; 2] = Default::default();
    let mut model: [Vec<(String, Var)>; 2] = Default::default();
    let mut layers: [BTreeMap<usize, Vec<(String, Var)>>; 2] = Default::default();
    for (k, layer, params) in pipeline.params_by_layer() {
        let mut split: [Vec<(String, Var)>; 2] = Default::default();
        for (n, v) in params {
            let g = usize::from(split_experts && experts.contains(&n));
            let group = if zero == Zero::Parameters { layer } else { k };
            let tag = if is_tied(&n) { AFTER_PIPELINE } else { group };
            specs[g].push(ParamSpec {
                name: n.clone(),
                dims: v.dims().to_vec(),
                group: tag,
                layer,
            });
            model[g].push((n.clone(), v.clone()));
            split[g].push((n, v));
        }
        let [a, b] = split;
        layers[0].insert(layer, a);
        layers[1].insert(layer, b);
    }
    let device = masters.master().first().map(|(_, v)| v.device().clone());
    let device = device.unwrap_or(candle_core::Device::Cpu);
    let [specs0, specs1] = specs;
    let [model0, model1] = model;
    let [layers0, layers1] = layers;
    let make = |specs: Vec<ParamSpec>, model, layers, comm: &dyn Communicator| {
        let plan = ShardPlan::new(
            &specs,
            bucket_bytes,
            comm.rank(),
            comm.size(),
            device.clone(),
        )?;
        let z = ZeroShards::new(zero, plan.clone(), model, masters.master())?;
        if zero != Zero::Parameters {
            return Ok((z, None));
        }
        // A communicator of its own: layers gather inside the schedule, between the step's
        // other collectives over the replicas.
        let all: Vec<usize> = (0..comm.size()).collect();
        let pieces = z.pieces().to_vec();
        let gather = LayerGather::new(plan, comm.split(&all)?, pieces, (layers, live))?;
        let gather = Arc::new(gather);
        Ok::<_, crate::Error>((z.with_gather(gather.clone()), Some(gather)))
    };
    let (dense, dense_gather) = make(specs0, model0, layers0, c.dense)?;
    let experts = split_experts
        .then(|| make(specs1, model1, layers1, c.experts))
        .transpose()?;
    drop(masters);
    let expert_gather = experts.as_ref().and_then(|e| e.1.clone());
    match (dense_gather, expert_gather) {
        (Some(d), Some(e)) => pipeline.set_layer_params(Some(Arc::new(BothGather(d, e)))),
        (Some(d), None) => pipeline.set_layer_params(Some(d)),
        _ => {}
    }
    Ok(Weights::Sharded(Box::new(ZeroGroups {
        dense,
        experts: experts.map(|e| e.0),
    })))
}

impl Varuna {
    /// The communicators ZeRO's groups move over: every replica, and the ranks holding the
    /// same experts (every replica again without expert parallelism).
    pub(super) fn replicas(&self) -> Replicas<'_> {
        Replicas::of(self.dp.as_ref(), self.expert_dp.as_deref())
    }

    /// The ZeRO stage in effect: the one asked for, or [`Zero::Off`] with one replica, where
    /// there is nothing to shard.
    pub fn zero(&self) -> Zero {
        match &self.weights {
            Weights::Sharded(z) => z.stage(),
            Weights::Whole(_) => Zero::Off,
        }
    }

    /// Under ZeRO, the pieces of this rank's parameters whose masters and gradients its
    /// optimizer holds (each a run of the flattened parameter's elements); empty without
    /// ZeRO, where it holds them whole.
    pub fn zero_pieces(&self) -> Vec<crate::parallel::zero::Piece> {
        self.weights
            .sharded()
            .map(|z| z.plan_pieces())
            .unwrap_or_default()
    }

    /// The model's parameters, whole, in the compute type, by name: the values its layers
    /// compute with (collective over the data-parallel replicas under ZeRO-3, whose layers
    /// hold them only while they compute: they are gathered), with every expert of this
    /// rank's expert group (collective over it under expert parallelism).
    pub fn parameters(&self) -> Result<Vec<(String, Tensor)>> {
        let gathered = match self.weights.sharded() {
            Some(z) => z.gather_all()?,
            None => None,
        };
        let all: Vec<(String, Tensor)> = match gathered {
            Some(all) => all,
            None => self
                .pipeline
                .params()
                .iter()
                .map(|(n, v)| Ok((n.clone(), v.as_tensor().copy()?)))
                .collect::<Result<_>>()?,
        };
        if self.pipeline.ep().size() == 1 {
            return Ok(all);
        }
        let experts = self.pipeline.experts();
        let (mine, mut out): (Vec<_>, Vec<_>) =
            all.into_iter().partition(|(n, _)| experts.contains(n));
        out.extend(gather_named(&mine, self.pipeline.ep())?);
        Ok(out)
    }

    /// The parameters the optimizer is made over: the f32 masters, or under ZeRO this
    /// replica's pieces of them.
    pub(super) fn optimized(&self) -> Vec<(String, Var)> {
        match &self.weights {
            Weights::Sharded(z) => z.pieces(),
            Weights::Whole(m) => m.master().to_vec(),
        }
    }

    /// Whole f32 parameters as a checkpoint holds them (collective over the replicas under
    /// ZeRO): the masters, gathered from the pieces under ZeRO, or with `blank` new zeros to
    /// read into (and hand to [`Varuna::set_whole_masters`]).
    pub(super) fn whole_masters(&self, blank: bool) -> Result<Vec<(String, Var)>> {
        let z = match &self.weights {
            Weights::Whole(m) => return Ok(m.master().to_vec()),
            Weights::Sharded(z) => z,
        };
        if !blank {
            return z.whole_masters(self.replicas());
        }
        self.pipeline
            .params()
            .iter()
            .map(|(n, v)| Ok((n.clone(), Var::zeros(v.dims(), DType::F32, v.device())?)))
            .collect()
    }

    /// Puts whole f32 parameters read by [`Varuna::whole_masters`] in place: into the model
    /// (and under ZeRO into this replica's pieces).
    pub(super) fn set_whole_masters(&self, whole: &[(String, Var)]) -> Result<()> {
        match &self.weights {
            Weights::Sharded(z) => z.load_masters(whole),
            Weights::Whole(m) => m.sync(),
        }
    }
}

impl Weights {
    /// Puts the updated masters into the model (collective over the replicas under ZeRO: the
    /// all-gather of the pieces).
    pub(super) fn publish(&self, c: Replicas<'_>) -> Result<()> {
        match self {
            Weights::Whole(m) => m.sync(),
            Weights::Sharded(z) => z.publish(c),
        }
    }

    /// The ZeRO state, if sharded.
    pub(super) fn sharded(&self) -> Option<&ZeroGroups> {
        match self {
            Weights::Sharded(z) => Some(z),
            Weights::Whole(_) => None,
        }
    }
}
