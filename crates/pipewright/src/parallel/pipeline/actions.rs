//! One batch through one rank's actions: the step's state (its micro-batches, the activations
//! saved for the backward, the sends in flight, the gradients so far) and one method per
//! action. [`super::executor::Pipeline::loss_and_grads_into`] builds it, runs the rank's list
//! through [`StepState::run`], then completes the sends and sums the tied pairs.

use std::collections::HashMap;
use std::ops::Range;

use candle_core::{DType, Tensor};

use super::backward::{Saved, Step};
use super::io::check_arity;
use super::schedule::Action;
use super::sink::GradSink;
use super::stage::PipelineStage;
use super::transfer::send_activation;
use crate::distributed::comm::Pending;
use crate::model::batch::Batch;
use crate::model::nn::Grads;
use crate::{invalid, Result};

/// Activations (a stage's forward graph, per micro-batch) and stage inputs a rank holds now,
/// and the most it held during the step.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Held {
    pub activations: usize,
    pub peak_activations: usize,
    pub inputs: usize,
    pub peak_inputs: usize,
}

/// One batch's state while a rank runs its actions.
pub(super) struct StepState<'a, 's> {
    pub stage: &'a PipelineStage,
    /// Micro-batches of the batch (the schedule's count).
    pub mbs: Vec<Batch>,
    /// The global batch's loss count and the loss scale.
    pub denominator: usize,
    pub loss_scale: f64,
    /// What each (micro-batch, stage) forward saved for its backward.
    saved: HashMap<(usize, usize), Saved>,
    pub sends: Vec<Pending<()>>,
    pub grads: Grads,
    /// Under a split backward: whether a micro-batch's activations wait for its weight pass.
    awaiting_weight: HashMap<(usize, usize), bool>,
    /// A sink's micro-batch gradients until complete (their weight part comes later under a
    /// split backward).
    partial: HashMap<(usize, usize), Grads>,
    arity: HashMap<usize, (usize, usize, bool)>,
    /// The sum of the last stage's micro-batch losses, in f64 where they were computed (read
    /// once a step: a read per micro-batch waited for the device each time).
    pub loss: Option<Tensor>,
    sink: Option<&'s mut dyn GradSink>,
    pub held: Held,
}

impl<'a, 's> StepState<'a, 's> {
    /// The start of a step of `mbs` on `stage`.
    pub fn new(
        stage: &'a PipelineStage,
        mbs: Vec<Batch>,
        denominator: usize,
        loss_scale: f64,
        sink: Option<&'s mut dyn GradSink>,
    ) -> Self {
        Self {
            stage,
            mbs,
            denominator,
            loss_scale,
            saved: HashMap::new(),
            sends: Vec::new(),
            grads: Grads::new(),
            awaiting_weight: HashMap::new(),
            partial: HashMap::new(),
            arity: HashMap::new(),
            loss: None,
            sink,
            held: Held::default(),
        }
    }

    /// Runs action `a`; whether its backward recomputed the forward.
    pub fn run(&mut self, a: Action) -> Result<bool> {
        let (mb, k) = (a.mb(), a.stage());
        match a {
            Action::Forward { .. } => self.forward(k, mb).map(|()| false),
            Action::Backward { .. } => self.backward(k, mb, false),
            Action::BackwardInput { .. } => self.backward(k, mb, true),
            Action::BackwardWeight { .. } => self.backward_weight(k, mb).map(|()| false),
        }
    }

    /// The forward of micro-batch `mb` on model stage `k`: its output sent on (or its loss
    /// added), what its backward needs saved.
    fn forward(&mut self, k: usize, mb: usize) -> Result<()> {
        let stage = self.stage;
        let input = stage.stage_input(k, mb, &self.mbs[mb])?;
        let imports = stage.import_skips(k, mb)?;
        let x = input.activation.clone();
        let (out, exports, cuts) = stage.train_forward(
            (k, mb),
            x,
            &imports,
            &self.mbs[mb],
            (self.denominator, self.loss_scale),
            false,
        )?;
        stage.export_skips(mb, &exports, &mut self.sends)?;
        if k + 1 == stage.stage_count() {
            let l = out.tensors()[0].detach().to_dtype(DType::F64)?;
            self.loss = Some(match self.loss.take() {
                Some(sum) => (sum + l)?,
                None => l,
            });
        } else {
            check_arity(&mut self.arity, k, mb, &out)?;
            let (to, msg) = (stage.rank_of(k + 1), stage.tags.activation(mb, k, false));
            self.sends
                .extend(send_activation(stage.comm.as_ref(), &out, to, msg)?);
        }
        let keep = stage.opts.spec.schedule.recompute.keeps(mb, self.mbs.len());
        // Dropping the output drops the graph behind it: only the input stays.
        self.saved.insert(
            (mb, k),
            Saved {
                input: input.activation,
                vars: input.vars,
                output: keep.then_some(out),
                imports,
                exports: keep.then_some(exports),
                cuts: cuts.filter(|_| keep),
            },
        );
        let h = &mut self.held;
        if keep {
            h.activations += 1;
            h.peak_activations = h.peak_activations.max(h.activations);
        }
        h.inputs += 1;
        h.peak_inputs = h.peak_inputs.max(h.inputs);
        Ok(())
    }

    /// The backward of micro-batch `mb` on model stage `k`, whole or (`split`) its input
    /// gradients only; whether it recomputed the forward.
    fn backward(&mut self, k: usize, mb: usize, split: bool) -> Result<bool> {
        let s = self.saved.remove(&(mb, k)).ok_or_else(|| {
            invalid!("stage {k}: backward of micro-batch {mb} before its forward")
        })?;
        let kept = s.output.is_some();
        let ctx = Step {
            batch: &self.mbs[mb],
            denominator: self.denominator,
            loss_scale: self.loss_scale,
        };
        let mut mine = Grads::new();
        let (sink, grads) = (&mut self.sink, &mut self.grads);
        // Each layer's (or the stage's) gradients as the backward gives them: to the sink at
        // once, unless their weight part is still to come.
        let mut give = |layers: Range<usize>, g: Grads| -> Result<()> {
            match sink.as_deref_mut() {
                Some(sink) if !split => grads.accumulate(sink.take(k, layers, g)?),
                Some(_) => mine.accumulate(g),
                None => grads.accumulate(g),
            }
        };
        let recomputed = self
            .stage
            .backward(s, (k, mb), &ctx, &mut give, &mut self.sends)?;
        if split && self.sink.is_some() {
            self.partial.insert((mb, k), mine);
        }
        // Under a split backward the activations stay until the weight gradient.
        if split {
            self.awaiting_weight.insert((mb, k), kept);
        } else if kept {
            self.held.activations -= 1;
        }
        self.held.inputs -= 1;
        Ok(recomputed)
    }

    /// The queued weight gradients of micro-batch `mb` on model stage `k` (a split backward's
    /// second part).
    fn backward_weight(&mut self, k: usize, mb: usize) -> Result<()> {
        let stage = self.stage;
        let queue = stage.weight_queue(k, mb).ok_or_else(|| {
            invalid!("stage {k}: the weight gradient of micro-batch {mb} without its input pass")
        })?;
        let weights = queue.weight_grads(mb + stage.mb_offset)?;
        match self.sink.as_deref_mut() {
            Some(sink) => {
                let mut mine = self.partial.remove(&(mb, k)).unwrap_or_default();
                mine.accumulate(weights)?;
                let layers = stage.ranges[k].clone();
                self.grads.accumulate(sink.take(k, layers, mine)?)?;
            }
            None => self.grads.accumulate(weights)?,
        }
        if self.awaiting_weight.remove(&(mb, k)) == Some(true) {
            self.held.activations -= 1;
        }
        Ok(())
    }
}
