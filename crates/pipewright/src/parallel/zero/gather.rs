//! [`LayerGather`]: ZeRO-3's weights between uses. Each member keeps only its f32 master
//! pieces; a layer's weights are all-gathered from them (in f32, then cast to the compute
//! type, so they are exactly what ZeRO-1/2 would have published) into the layer's own
//! variables just before it computes, and emptied just after (`storage.rs`'s `release`).
//!
//! Prefetch (FSDP's forward and backward prefetch, DeepSpeed's `stage3_max_live_parameters`):
//! when a layer is fetched, the gathers of the layers expected next start at once
//! ([`Communicator::iall_gather`]) and travel while it computes. The next layers are guessed
//! from the order of the fetches: going up (a forward), the held layers after it; going down
//! or fetching the same layer again (a backward, which starts at the forward's last layer),
//! those before it. At most `live` layers are gathered at a time, the one computing included
//! (`live` 1 gathers each layer when asked, as before). A guess that does not come is waited
//! for and dropped; every replica fetches in the same order, so every replica guesses alike and
//! their collectives stay in step. What was gathered ahead is dropped when the pieces change
//! ([`LayerGather::forget`], after each optimizer step), so a layer always computes with the
//! pieces of the moment.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::Instant;

use candle_core::{Tensor, Var};

use super::plan::ShardPlan;
use crate::distributed::comm::{waited, Communicator, Pending};
use crate::model::LayerParams;
use crate::runtime::storage::{refill, release};
use crate::{invalid, Result};

/// A rank's ZeRO-3 weights of its model stages: the plan (buckets never span two layers), the
/// master pieces (shared with the optimizer, which updates them in place) and each layer's
/// variables, fetched over a data-parallel communicator of its own.
pub struct LayerGather {
    plan: ShardPlan,
    comm: Box<dyn Communicator>,
    /// The master pieces' values by name: the optimizer and a checkpoint's load write into
    /// the same storage, so the map made once stays current.
    pieces: BTreeMap<String, Tensor>,
    layers: BTreeMap<usize, Vec<(String, Var)>>,
    /// Layers gathered at a time at most, the one computing included.
    live: usize,
    ahead: Mutex<Ahead>,
}

/// The gathers started ahead of their layers' fetches.
#[derive(Default)]
struct Ahead {
    /// The layer fetched last: the direction of the next fetches.
    last: Option<usize>,
    /// The layers expected next, in order, with their buckets' gathers in flight.
    started: VecDeque<(usize, Vec<Gathering>)>,
}

/// One bucket of a layer in flight: its index, its whole value to come, when it started.
type Gathering = (usize, Pending<Tensor>, Instant);

impl LayerGather {
    /// Over `comm` (the data-parallel group, a communicator this alone uses), with `plan`'s
    /// master `pieces` and the model's variables by layer (global index), holding at most
    /// `live` layers gathered at a time (at least 1); releases them all.
    pub fn new(
        plan: ShardPlan,
        comm: Box<dyn Communicator>,
        pieces: Vec<(String, Var)>,
        (layers, live): (BTreeMap<usize, Vec<(String, Var)>>, usize),
    ) -> Result<Self> {
        if live == 0 {
            return Err(invalid!(
                "ZeRO-3 must hold at least 1 gathered layer (the one computing); got 0"
            ));
        }
        let pieces = pieces
            .into_iter()
            .map(|(n, v)| (n, v.as_tensor().clone()))
            .collect();
        let g = Self {
            plan,
            comm,
            pieces,
            layers,
            live,
            ahead: Mutex::new(Ahead::default()),
        };
        for layer in g.layers.keys() {
            g.release(*layer)?;
        }
        Ok(g)
    }

    /// Every parameter of the rank whole, in its compute type (collective over the group).
    pub fn gather_all(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for layer in self.layers.keys() {
            for (name, t) in self.gather(*layer)? {
                out.push((name, t));
            }
        }
        Ok(out)
    }

    /// Layer `layer`'s parameters whole, in their compute type (collective over the group).
    fn gather(&self, layer: usize) -> Result<Vec<(String, Tensor)>> {
        let started = self.start(layer)?;
        self.finish(layer, started)
    }

    /// Starts the gathers of layer `layer`'s buckets.
    fn start(&self, layer: usize) -> Result<Vec<Gathering>> {
        let names: Vec<String> = self.vars(layer)?.iter().map(|(n, _)| n.clone()).collect();
        (self.plan.buckets_holding(&names).into_iter())
            .map(|b| {
                let (comm, started) = (self.comm.as_ref(), Instant::now());
                let h = waited::waiting(|| self.plan.start_gather_bucket(b, comm, &self.pieces))?;
                Ok((b, h, started))
            })
            .collect()
    }

    /// Layer `layer`'s parameters whole, in their compute type, from its buckets' gathers.
    fn finish(&self, layer: usize, started: Vec<Gathering>) -> Result<Vec<(String, Tensor)>> {
        let vars = self.vars(layer)?;
        let mut out = Vec::new();
        for (b, h, at) in started {
            let whole = waited::finish(h, at, || format!("gather layer {layer}"))?;
            for (name, t) in self.plan.params_of_bucket(b, &whole)? {
                if let Some((_, var)) = vars.iter().find(|(n, _)| *n == name) {
                    out.push((name, t.to_dtype(var.dtype())?));
                }
            }
        }
        Ok(out)
    }

    fn vars(&self, layer: usize) -> Result<&Vec<(String, Var)>> {
        self.layers
            .get(&layer)
            .ok_or_else(|| invalid!("ZeRO-3: layer {layer} is not held by this rank"))
    }

    /// The layers expected after a fetch of `layer` (see the module's header), at most
    /// `live - 1` of them, nearest first.
    fn expected_after(&self, layer: usize, last: Option<usize>) -> Vec<usize> {
        let first = self.layers.keys().next().copied();
        let down = match last {
            Some(p) if p == layer => Some(layer) != first,
            Some(p) => layer < p,
            None => false,
        };
        let n = self.live - 1;
        match down {
            true => self
                .layers
                .range(..layer)
                .rev()
                .map(|(l, _)| *l)
                .take(n)
                .collect(),
            false => (self.layers.range(layer + 1..).map(|(l, _)| *l))
                .take(n)
                .collect(),
        }
    }

    /// Drops what was gathered ahead (waiting for it: the collectives complete on every
    /// replica): the pieces changed (an optimizer step, a checkpoint's load).
    pub fn forget(&self) -> Result<()> {
        let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        let started = std::mem::take(&mut *ahead).started;
        started.into_iter().try_for_each(|(_, g)| drop_gathers(g))
    }

    /// Layer `layer`'s gathers, started ahead or now, with the next layers' started after
    /// them; guesses that did not come are waited for and dropped.
    fn gathers_for(&self, layer: usize) -> Result<Vec<Gathering>> {
        let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        let next = self.expected_after(layer, ahead.last);
        ahead.last = Some(layer);
        let mut mine = None;
        let mut kept = VecDeque::new();
        for (l, gathers) in std::mem::take(&mut ahead.started) {
            if l == layer {
                mine = Some(gathers);
            } else if next.contains(&l) {
                kept.push_back((l, gathers));
            } else {
                drop_gathers(gathers)?;
            }
        }
        let mine = match mine {
            Some(g) => g,
            None => self.start(layer)?,
        };
        for l in next {
            if !kept.iter().any(|(k, _)| *k == l) {
                kept.push_back((l, self.start(l)?));
            }
        }
        ahead.started = kept;
        Ok(mine)
    }
}

/// Waits for `gathers` (the collectives complete on every replica) and drops what they give.
fn drop_gathers(gathers: Vec<Gathering>) -> Result<()> {
    (gathers.into_iter()).try_for_each(|(_, h, _)| waited::waiting(|| h.wait()).map(drop))
}

impl LayerParams for LayerGather {
    fn fetch(&self, layer: usize) -> Result<()> {
        let started = self.gathers_for(layer)?;
        let whole = self.finish(layer, started)?;
        let vars = &self.layers[&layer];
        for (name, t) in whole {
            if let Some((_, var)) = vars.iter().find(|(n, _)| *n == name) {
                refill(var.as_tensor(), &t)?;
            }
        }
        Ok(())
    }

    fn release(&self, layer: usize) -> Result<()> {
        for (_, var) in self.layers.get(&layer).into_iter().flatten() {
            release(var.as_tensor())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};

    use super::*;
    use crate::distributed::comm::local;
    use crate::parallel::zero::ParamSpec;

    fn started(g: &LayerGather) -> Vec<usize> {
        let ahead = g.ahead.lock().unwrap();
        ahead.started.iter().map(|(l, _)| *l).collect()
    }

    /// Three layers of one parameter each over two members, two live: a forward gathers the
    /// next layer ahead, a backward the one before; each layer computes with its own whole
    /// weights; after the pieces change nothing gathered before is used.
    #[test]
    fn the_next_layer_is_gathered_while_one_computes() {
        local::run(2, |c| {
            let specs: Vec<ParamSpec> = (0..3)
                .map(|l| ParamSpec {
                    name: format!("w{l}"),
                    dims: vec![4],
                    group: l,
                    layer: l,
                })
                .collect();
            let plan = ShardPlan::new(&specs, 4, c.rank(), 2, Device::Cpu)?;
            let whole = |l: usize, v: f32| Tensor::full(v + l as f32, 4, &Device::Cpu);
            let mut layers = BTreeMap::new();
            let mut pieces = Vec::new();
            for l in 0..3 {
                let name = format!("w{l}");
                let var = Var::from_tensor(&whole(l, 10.0)?)?;
                let piece = plan.piece(&name).unwrap().cut(&whole(l, 10.0)?, &name)?;
                pieces.push((name.clone(), Var::from_tensor(&piece)?));
                layers.insert(l, vec![(name, var)]);
            }
            let vars: Vec<Var> = (0..3).map(|l| layers[&l][0].1.clone()).collect();
            let all = [0, 1];
            let g = LayerGather::new(plan, c.split(&all)?, pieces.clone(), (layers, 2))?;
            let read = |l: usize| -> Result<Vec<f32>> {
                Ok(vars[l].as_tensor().to_dtype(DType::F32)?.to_vec1()?)
            };
            let mut order = Vec::new();
            for l in [0, 1, 2, 2, 1, 0] {
                g.fetch(l)?;
                assert_eq!(read(l)?, vec![10.0 + l as f32; 4]);
                g.release(l)?;
                order.push(started(&g));
            }
            let want: Vec<Vec<usize>> = vec![vec![1], vec![2], vec![], vec![1], vec![0], vec![]];
            assert_eq!(order, want);
            // The pieces change (an optimizer step): layer 1 gathered ahead is dropped.
            g.fetch(0)?;
            g.release(0)?;
            assert_eq!(started(&g), vec![1]);
            for (_, p) in &pieces {
                p.set(&(p.as_tensor() + 1.0)?)?;
            }
            g.forget()?;
            assert!(started(&g).is_empty());
            g.fetch(1)?;
            assert_eq!(read(1)?, vec![12.0; 4], "layer 1 gathered after the change");
            Ok(())
        })
        .unwrap();
    }
}
