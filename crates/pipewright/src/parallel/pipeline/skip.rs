//! Skip connections across stages (torchgpipe's `skip`): a layer stashes a tensor
//! ([`Cx::stash`]) that a later layer pops ([`Cx::pop`]). When both ends sit on one stage the
//! stash carries it; when they sit on different stages the pipeline routes it: the stashing
//! stage sends it on after its forward, the popping stage receives it before its own, and its
//! gradient travels back the same way.

use std::ops::Range;

use candle_core::{Tensor, Var};

use super::segments::Cuts;
use crate::model::{Activation, Cx, Sequential, Stage};
use crate::{invalid, Result};

/// A skip connection whose ends sit on different model stages.
#[derive(Clone, Debug)]
pub struct Route {
    /// The skip's name.
    pub name: String,
    /// Model stage that stashes it.
    pub from: usize,
    /// Model stage that pops it.
    pub to: usize,
}

/// The routes of a partitioned model, and running a stage with its skips.
#[derive(Clone, Debug)]
pub struct Skips {
    routes: Vec<Route>,
}

impl Skips {
    /// The skips of `model` (checked by [`Sequential::skips`]) whose ends fall into different
    /// stages of `ranges`.
    pub fn new(model: &Sequential, ranges: &[Range<usize>]) -> Result<Self> {
        let stage_of = |layer: usize| ranges.iter().position(|r| r.contains(&layer)).unwrap_or(0);
        let routes = model
            .skips()?
            .into_iter()
            .map(|s| Route {
                from: stage_of(s.from),
                to: stage_of(s.to),
                name: s.name,
            })
            .filter(|r| r.from != r.to)
            .collect();
        Ok(Self { routes })
    }

    /// Every route, indexed as the tags index them.
    pub fn routes(&self) -> &[Route] {
        &self.routes
    }

    /// The routes (index, route) that end at model stage `k`.
    pub fn into_stage(&self, k: usize) -> impl Iterator<Item = (usize, &Route)> {
        self.routes
            .iter()
            .enumerate()
            .filter(move |(_, r)| r.to == k)
    }

    /// Runs model stage `k` on `x`: stashes the skips `imports` received from earlier stages,
    /// runs the layers, and pops the skips that later stages pop (returned as exports). A
    /// stash nobody pops is an error, and so is an output that crosses a cut (`last` false)
    /// without the input's rows on dim 0. With `cuts`, the forward is cut into one graph per
    /// layer there ([`Cuts`]).
    pub fn run(
        &self,
        stage: &Stage,
        (k, last): (usize, bool),
        x: Activation,
        imports: &[(usize, Var)],
        cx: &mut Cx,
        cuts: Option<&mut Cuts>,
    ) -> Result<(Activation, Vec<(usize, Tensor)>)> {
        let here = format!("model stage {k}");
        for (i, v) in imports {
            cx.stash(&here, &self.routes[*i].name, v.as_tensor().clone())?;
        }
        let rows = x.batch_size()?;
        let out = match cuts {
            Some(c) => stage.forward_each(x, cx, &mut |i, y, cx| c.cut(i, y, cx))?,
            None => stage.forward(x, cx)?,
        };
        if !last {
            if let Some(bad) = out
                .tensors()
                .iter()
                .find(|t| t.dims().first() != Some(&rows))
            {
                let layer = stage.range().end - 1;
                return Err(invalid!(
                    "layer {layer} ends model stage {k} with an output of shape {:?} for a \
                     micro-batch of {rows} rows: what crosses a cut point must keep the batch \
                     on dim 0",
                    bad.dims()
                ));
            }
        }
        let exports = self
            .routes
            .iter()
            .enumerate()
            .filter(|(_, r)| r.from == k)
            .map(|(i, r)| Ok((i, cx.pop(&here, &r.name)?)))
            .collect::<Result<Vec<_>>>()?;
        let left = cx.stashed();
        if !left.is_empty() {
            return Err(invalid!(
                "{here}: skip connections {left:?} were stashed but nothing pops them: declare \
                 them with LayerSpec::stashes and LayerSpec::pops"
            ));
        }
        Ok((out, exports))
    }
}
