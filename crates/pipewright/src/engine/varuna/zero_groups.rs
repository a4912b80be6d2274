//! ZeRO beside expert parallelism: the experts' parameters are held by fewer ranks than the
//! rest (the ranks holding the same experts, [`crate::distributed::topology::Axis::ExpertReplica`]),
//! so they are sharded over that group and everything else over every replica, as DeepSpeed
//! shards its expert and non-expert parameter groups apart. [`ZeroGroups`] is the two
//! [`ZeroShards`] (one when there is no expert parallelism) behind one face, each moving over
//! its own communicator ([`Replicas`]).

use std::ops::Range;
use std::sync::Arc;

use candle_core::{Tensor, Var};

use crate::distributed::comm::Communicator;
use crate::model::grads::Grads;
use crate::model::nn::optim::StateDict;
use crate::model::LayerParams;
use crate::parallel::pipeline::GradSink;
use crate::parallel::zero::{LayerGather, ShardedGrads, Zero, ZeroShards};
use crate::Result;

/// The communicators the groups move over: every replica, and the ranks holding the same
/// experts (the same communicator without expert parallelism).
#[derive(Clone, Copy)]
pub(super) struct Replicas<'a> {
    pub dense: &'a dyn Communicator,
    pub experts: &'a dyn Communicator,
}

impl<'a> Replicas<'a> {
    /// Over every replica `dp` and, under expert parallelism, the expert replicas `expert_dp`.
    pub fn of(dp: &'a dyn Communicator, expert_dp: Option<&'a dyn Communicator>) -> Self {
        Self {
            dense: dp,
            experts: expert_dp.unwrap_or(dp),
        }
    }
}

/// A rank's ZeRO state: the parameters shared by every replica, and (under expert
/// parallelism) the experts, each sharded over its own group.
pub(super) struct ZeroGroups {
    pub dense: ZeroShards,
    pub experts: Option<ZeroShards>,
}

impl ZeroGroups {
    fn each(&self) -> impl Iterator<Item = &ZeroShards> {
        std::iter::once(&self.dense).chain(&self.experts)
    }

    /// The groups with the communicator each moves over.
    fn with<'a>(&'a self, c: Replicas<'a>) -> Vec<(&'a ZeroShards, &'a dyn Communicator)> {
        let mut v = vec![(&self.dense, c.dense)];
        v.extend(self.experts.iter().map(|e| (e, c.experts)));
        v
    }

    /// The ZeRO stage.
    pub fn stage(&self) -> Zero {
        self.dense.stage()
    }

    /// The f32 master pieces of both groups: what the optimizer updates.
    pub fn pieces(&self) -> Vec<(String, Var)> {
        self.each().flat_map(|z| z.pieces().to_vec()).collect()
    }

    /// Where this member's pieces lie in their parameters, both groups'.
    pub fn plan_pieces(&self) -> Vec<crate::parallel::zero::Piece> {
        self.each()
            .flat_map(|z| z.plan().pieces().to_vec())
            .collect()
    }

    /// This member's pieces of whole (summed) gradients (ZeRO-1).
    pub fn cut_grads(&self, whole: &Grads) -> Result<Grads> {
        let mut out = Grads::new();
        for z in self.each() {
            for (n, g) in z.cut_grads(whole)?.iter() {
                out.insert(n.clone(), g.clone());
            }
        }
        Ok(out)
    }

    /// Gives every member's updated pieces to the model's weights (collective over each
    /// group).
    pub fn publish(&self, c: Replicas<'_>) -> Result<()> {
        self.with(c).into_iter().try_for_each(|(z, c)| z.publish(c))
    }

    /// The whole f32 master weights of both groups (collective over each).
    pub fn whole_masters(&self, c: Replicas<'_>) -> Result<Vec<(String, Var)>> {
        let mut out = Vec::new();
        for (z, c) in self.with(c) {
            out.extend(z.whole_masters(c)?);
        }
        Ok(out)
    }

    /// The optimizer's state over whole parameters (collective over each group).
    pub fn whole_state(&self, c: Replicas<'_>, state: &StateDict) -> Result<StateDict> {
        let mut out = StateDict::new();
        for (z, c) in self.with(c) {
            out.extend(z.whole_state(c, state)?);
        }
        Ok(out)
    }

    /// This member's pieces of a whole optimizer state (a checkpoint's).
    pub fn cut_state(&self, whole: &StateDict) -> Result<StateDict> {
        let mut out = StateDict::new();
        for z in self.each() {
            out.extend(z.cut_state(whole)?);
        }
        Ok(out)
    }

    /// Sets the master pieces (and the model's weights) from whole f32 masters.
    pub fn load_masters(&self, whole: &[(String, Var)]) -> Result<()> {
        self.each().try_for_each(|z| z.load_masters(whole))
    }

    /// Every parameter whole in its compute type under ZeRO-3 (collective over each group),
    /// `None` when the layers hold their weights.
    pub fn gather_all(&self) -> Result<Option<Vec<(String, Tensor)>>> {
        let mut out = Vec::new();
        for z in self.each() {
            match z.gather() {
                Some(g) => out.extend(g.gather_all()?),
                None => return Ok(None),
            }
        }
        Ok(Some(out))
    }

    /// ZeRO-2/3's sink of one step's gradients (loss scale `scale`; by layer under ZeRO-3;
    /// reduce-scatters kept in flight with `overlap`): the experts' reduce-scattered over
    /// their group, the rest over every replica.
    pub fn sink<'a>(
        &'a self,
        c: Replicas<'a>,
        (scale, overlap): (f64, bool),
        experts: &'a [String],
    ) -> Sink<'a> {
        let how = (self.stage() == Zero::Parameters, overlap);
        Sink {
            dense: ShardedGrads::new(self.dense.plan(), c.dense, scale, how),
            experts: self
                .experts
                .as_ref()
                .map(|z| ShardedGrads::new(z.plan(), c.experts, scale, how)),
            names: experts,
        }
    }
}

/// [`ZeroGroups::sink`]: each group's running shard sums.
pub(super) struct Sink<'a> {
    dense: ShardedGrads<'a>,
    experts: Option<ShardedGrads<'a>>,
    names: &'a [String],
}

impl Sink<'_> {
    /// This member's pieces of every gradient of the step (`after`: what the pipeline summed
    /// itself, tied weights).
    pub fn finish(self, after: &Grads) -> Result<Grads> {
        let mut out = self.dense.finish(after)?;
        if let Some(e) = self.experts {
            for (n, g) in e.finish(&Grads::new())?.iter() {
                out.insert(n.clone(), g.clone());
            }
        }
        Ok(out)
    }
}

impl GradSink for Sink<'_> {
    fn take(&mut self, k: usize, layers: Range<usize>, grads: Grads) -> Result<Grads> {
        let Some(experts) = self.experts.as_mut() else {
            return self.dense.take(k, layers, grads);
        };
        let (mut mine, mut rest) = (Grads::new(), Grads::new());
        for (n, g) in grads.iter() {
            match self.names.contains(n) {
                true => mine.insert(n.clone(), g.clone()),
                false => rest.insert(n.clone(), g.clone()),
            }
        }
        // Experts are never tied: nothing is left for after the pipeline.
        experts.take(k, layers.clone(), mine)?;
        self.dense.take(k, layers, rest)
    }
}

/// ZeRO-3's two gatherers as the layers see one: each layer's dense weights and experts
/// fetched and released together.
pub(super) struct BothGather(pub Arc<LayerGather>, pub Arc<LayerGather>);

impl LayerParams for BothGather {
    fn fetch(&self, layer: usize) -> Result<()> {
        self.0.fetch(layer)?;
        self.1.fetch(layer)
    }

    fn release(&self, layer: usize) -> Result<()> {
        self.0.release(layer)?;
        self.1.release(layer)
    }
}
