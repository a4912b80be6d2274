//! The backward of one micro-batch on one model stage: re-run the forward if it was not kept
//! ([`super::recompute`]), inject the gradients that come back from the next stage and from
//! skip connections sent on, run candle's backward (once, or once per layer when the forward
//! was cut, [`super::segments`]), and send the input's and imported skips' gradients back.

use std::ops::Range;

use candle_core::{Tensor, Var};

use super::segments::{Cuts, Leaves};
use super::stage::PipelineStage;
use super::transfer::{inject_gradients, send_gradients, Tags};
use crate::distributed::comm::Pending;
use crate::model::batch::Batch;
use crate::model::grads::Grads;
use crate::model::Activation;
use crate::{invalid, Result};

/// What a forward left for its backward.
pub(super) struct Saved {
    /// The stage input as the layers saw it (for a recomputation).
    pub input: Activation,
    /// Its received floating-point tensors as variables (their gradients go back); empty on
    /// the first stage, whose input is the batch's.
    pub vars: Vec<Option<Var>>,
    /// The stage output (to inject the incoming gradient) or, on the last stage, the loss;
    /// `None` when the forward is to be recomputed.
    pub output: Option<Activation>,
    /// Skip tensors received from earlier stages (their gradients go back there).
    pub imports: Vec<(usize, Var)>,
    /// Skip tensors sent to later stages (their gradients come back); `None` when recomputed.
    pub exports: Option<Vec<(usize, Tensor)>>,
    /// Where the kept forward was cut into one graph per layer (ZeRO-3), if it was.
    pub cuts: Option<Cuts>,
}

/// Takes the parameter gradients of a range of a stage's layers (global indices) as each
/// backward gives them: the whole stage's at once, or one layer's at a time when the forward
/// was cut.
pub(super) type GiveGrads<'a> = dyn FnMut(Range<usize>, Grads) -> Result<()> + 'a;

/// What a step's backward actions share: the micro-batch, the count the loss is divided by,
/// and the loss scale.
pub(super) struct Step<'a> {
    pub batch: &'a Batch,
    pub denominator: usize,
    pub loss_scale: f64,
}

impl PipelineStage {
    /// The backward of micro-batch `mb` on model stage `k` (chunk `c` of this rank): gives its
    /// parameter gradients to `give` and queues the sends of its input gradients. Returns
    /// whether the forward was recomputed.
    pub(super) fn backward(
        &self,
        s: Saved,
        (k, mb): (usize, usize),
        ctx: &Step<'_>,
        give: &mut GiveGrads<'_>,
        sends: &mut Vec<Pending<()>>,
    ) -> Result<bool> {
        let last = self.stage_count() - 1;
        let mut recomputed = false;
        let (output, exports, cuts) = match (s.output, s.exports) {
            (Some(o), Some(e)) => (o, e, s.cuts),
            _ => {
                recomputed = true;
                let (mb_batch, x) = (ctx.batch, s.input.clone());
                self.train_forward(
                    (k, mb),
                    x,
                    &s.imports,
                    mb_batch,
                    (ctx.denominator, ctx.loss_scale),
                    true,
                )?
            }
        };
        let recv = |src, tag| self.recv_timed(src, tag);
        // One backward for the output and every skip sent on: the gradients that
        // come back are injected as (tensor * gradient).sum().
        let mut objective = if k == last {
            let l = output.into_tensor("loss")?;
            Some(if ctx.loss_scale == 1.0 {
                l
            } else {
                (l * ctx.loss_scale)?
            })
        } else {
            let msg = self.tags.activation(mb, k, true);
            inject_gradients(&recv, &output, self.rank_of(k + 1), msg)?
        };
        for (i, t) in exports {
            let from = self.rank_of(self.skips.routes()[i].to);
            let g = recv(from, Tags::tensor(self.tags.skip(mb, i, true)))?;
            let term = (t * g.to_device(&self.device)?.detach())?.sum_all()?;
            objective = Some(match objective {
                Some(o) => (o + term)?,
                None => term,
            });
        }
        let objective = objective.ok_or_else(|| {
            invalid!(
                "model stage {k} passes no floating-point tensor on: there is no \
                 gradient to carry back through it"
            )
        })?;
        let stage = self.own_stage(k)?;
        let mut cuts = cuts.unwrap_or_default();
        let mut watched = cuts.leaves();
        watched.extend(s.vars.iter().flatten().map(|v| v.as_tensor().clone()));
        watched.extend(s.imports.iter().map(|(_, v)| v.as_tensor().clone()));
        let mut leaves = Leaves::new(watched);
        let start = |c: &Cuts| c.last_layer().map_or(stage.range().start, |l| l + 1);
        let mut layers = start(&cuts)..stage.range().end;
        let mut objective = Some(objective);
        loop {
            if let Some(o) = objective {
                // The layers' parameters whole for their own backward only (ZeRO-3).
                // (An unused parameter's zero gradient takes its shape while it is whole.)
                layers.clone().try_for_each(|l| stage.fetch(l))?;
                let params: Vec<_> = layers.clone().flat_map(|l| stage.layer_params(l)).collect();
                let store = o
                    .backward()
                    .map_err(crate::Error::from)
                    .and_then(|s| Ok((Grads::from_store(&s, &params)?, s)));
                layers.clone().try_for_each(|l| stage.release(l))?;
                let (mine, store) = store?;
                self.check_grads(&mine, k, mb)?;
                give(layers.clone(), mine)?;
                leaves.add(&store)?;
            }
            match cuts.pop_objective(&leaves)? {
                Some((layer, o)) => {
                    layers = start(&cuts)..layer + 1;
                    objective = o;
                }
                None => break,
            }
        }
        let store = leaves.into_store();
        if k > 0 {
            let (to, msg) = (self.rank_of(k - 1), self.tags.activation(mb, k - 1, true));
            sends.extend(send_gradients(
                self.comm.as_ref(),
                &s.vars,
                &store,
                to,
                msg,
            )?);
        }
        for (i, v) in &s.imports {
            let g = match store.get(v.as_tensor()) {
                Some(g) => g.clone(),
                None => v.as_tensor().zeros_like()?,
            };
            let from = self.rank_of(self.skips.routes()[*i].from);
            let tag = Tags::tensor(self.tags.skip(mb, *i, true));
            sends.push(self.comm.isend(&g, from, tag)?);
        }
        Ok(recomputed)
    }

    /// With anomaly detection on, fails when a gradient of `mine` holds a NaN or an inf.
    fn check_grads(&self, mine: &Grads, k: usize, mb: usize) -> Result<()> {
        if !self.opts.detect_anomaly {
            return Ok(());
        }
        let mut bad = Vec::new();
        for (name, g) in mine.iter() {
            if !crate::model::grads::all_finite(g)? {
                bad.push(name.as_str());
            }
        }
        if !bad.is_empty() {
            return Err(invalid!(
                "anomaly: the backward of micro-batch {} of step {} gave NaN or inf gradients \
                 to {} (model stage {k}): lower the learning rate or clip gradients",
                mb + self.mb_offset,
                self.step + 1,
                bad.join(", ")
            ));
        }
        Ok(())
    }
}
