//! A [`Profile`] measured on this machine: every layer of a model timed at a few micro-batch
//! sizes (and tensor-parallel sizes, each on as many threads as ranks), fitted as fixed +
//! per-sample seconds, with its parameter, output, kept and deferred bytes.

use super::layer_cost::{profile_layers, LayerCost};
use super::optimizer_cost::time_optimizer;
use super::profile::{Fit, LayerProfile, Profile, SplitCost, Timing};
use crate::batch::Batch;
use crate::comm::local;
use crate::comm::TpGroup;
use crate::model::{Build, Sequential};
use crate::pipeline::partition::unit_bounds;
use crate::{invalid, Result};

/// Timings of each layer at each size, their median kept.
const REPEATS: usize = 5;

/// The least-squares lines of `field` of layer `i` over `runs` (one per size).
fn fit(sizes: &[usize], runs: &[Vec<LayerCost>], i: usize, field: fn(&LayerCost) -> f64) -> Fit {
    let points: Vec<(f64, f64)> = sizes
        .iter()
        .zip(runs)
        .map(|(&rows, r)| (rows as f64, field(&r[i])))
        .collect();
    Fit::through(&points)
}

/// Every layer profiled on `tp` ranks as threads of a tensor-parallel group at each size:
/// per size, rank 0's costs (its shard; every rank runs the same collectives).
fn profile_split(
    model: &Sequential,
    build: &Build,
    batches: &[Batch],
    tp: usize,
) -> Result<Vec<Vec<LayerCost>>> {
    batches
        .iter()
        .map(|b| {
            let mut per_rank = local::run(tp, |c| {
                let build = build.clone().with_tp(TpGroup::new(Box::new(c)));
                profile_layers(model, &build, b, REPEATS)
            })?;
            Ok(per_rank.swap_remove(0))
        })
        .collect()
}

/// What [`measure`] times: micro-batch sizes, tensor-parallel sizes and how many copies run
/// at once.
#[derive(Clone, Debug)]
pub struct Sizes {
    /// Micro-batch sizes (rows).
    pub rows: Vec<usize>,
    /// Tensor-parallel sizes timed as such (1 is the unsplit layer).
    pub tp: Vec<usize>,
    /// Copies of the profile run at once (ranks computing at once on this machine).
    pub concurrent: usize,
}

/// A [`Profile`] of `model` measured here (with candle's pool as sized now: set
/// `RAYON_NUM_THREADS` to the threads each rank of the planned runs will have): every layer
/// timed at each micro-batch size of `sizes.rows` (`batch(rows)` makes one), its forward, backward
/// and split backward fitted as fixed + per-sample seconds; its output, kept and deferred bytes
/// per sample from the largest size. Each tensor-parallel size of `sizes.tp` beyond 1 is
/// timed too, its ranks as threads of this process with their collectives (rank 0's shard;
/// its times, parameters, kept and deferred bytes).
/// `tp_divides` are what a tensor-parallel size must divide (heads, vocabulary), `source`
/// says where it ran. With `sizes.concurrent` above 1, that many copies of the profile run at once
/// as threads and the first one's timings are kept: ranks that share a machine compute
/// slower together than alone (its caches and memory bandwidth are shared; measured here: two
/// one-thread runs at once each take 1.1-1.2 times as long as alone).
///
/// A tp size not measured is modelled as Megatron's blocks split: a layer with parameters
/// divides its time, parameters and kept bytes by tp except its input and output (kept
/// whole), and all-reduces twice its output per forward and per backward.
pub fn measure(
    model: &Sequential,
    build: &Build,
    batch: &dyn Fn(usize) -> Result<Batch>,
    sizes: &Sizes,
    tp_divides: Vec<usize>,
    source: String,
) -> Result<Profile> {
    let Sizes {
        rows: sizes,
        tp: tp_sizes,
        concurrent,
    } = sizes;
    let concurrent = *concurrent;
    if sizes.is_empty() || sizes.contains(&0) || tp_sizes.contains(&0) || concurrent == 0 {
        return Err(invalid!(
            "profile sizes, tensor-parallel sizes and --concurrent must be positive"
        ));
    }
    let batches = sizes
        .iter()
        .map(|&r| batch(r))
        .collect::<Result<Vec<_>>>()?;
    // The update is timed beside the layers, by as many copies at once.
    let profile_all = || {
        let runs = batches
            .iter()
            .map(|b| profile_layers(model, build, b, REPEATS))
            .collect::<Result<Vec<_>>>()?;
        Ok((runs, time_optimizer(model, build, REPEATS)?))
    };
    let (runs, optimizer) = if concurrent > 1 {
        local::run(concurrent, |_| profile_all())?.swap_remove(0)
    } else {
        profile_all()?
    };
    let mut splits = Vec::new();
    for &tp in tp_sizes.iter().filter(|&&t| t > 1) {
        splits.push((tp, profile_split(model, build, &batches, tp)?));
    }
    let (last, big) = (runs.len() - 1, *sizes.last().expect("not empty") as f64);
    let dtype_bytes = model
        .build(build)?
        .layers()
        .iter()
        .flat_map(|l| l.params())
        .map(|(_, v)| v.dtype().size_in_bytes())
        .next()
        .unwrap_or(4);
    let layers = (0..runs[0].len())
        .map(|i| {
            let measured: Vec<Timing> = sizes
                .iter()
                .zip(&runs)
                .map(|(&rows, r)| Timing {
                    rows,
                    forward_s: r[i].forward_s,
                    backward_s: r[i].backward_s,
                    backward_input_s: r[i].backward_input_s,
                    backward_weight_s: r[i].backward_weight_s,
                })
                .collect();
            let l = &runs[last][i];
            let output = l.activation_bytes as f64 / big;
            let kept = l.kept_bytes as f64 / big;
            let split = l.param_bytes > 0;
            LayerProfile {
                name: l.name.clone(),
                params: (l.param_bytes / dtype_bytes) as u64,
                tp_split: split,
                forward: fit(sizes, &runs, i, |c| c.forward_s),
                backward: fit(sizes, &runs, i, |c| c.backward_s),
                backward_input: Some(fit(sizes, &runs, i, |c| c.backward_input_s)),
                backward_weight: Some(fit(sizes, &runs, i, |c| c.backward_weight_s)),
                output_bytes_per_sample: output,
                kept_bytes_per_sample: kept,
                deferred_bytes_per_sample: l.deferred_bytes as f64 / big,
                kept_whole_bytes_per_sample: if split { kept.min(2.0 * output) } else { kept },
                tp_all_reduce_bytes_per_sample: if split { 2.0 * output } else { 0.0 },
                split: splits
                    .iter()
                    .map(|(tp, r)| SplitCost {
                        tp: *tp,
                        params: (r[last][i].param_bytes / dtype_bytes) as u64,
                        forward: fit(sizes, r, i, |c| c.forward_s),
                        backward: fit(sizes, r, i, |c| c.backward_s),
                        backward_input: fit(sizes, r, i, |c| c.backward_input_s),
                        backward_weight: fit(sizes, r, i, |c| c.backward_weight_s),
                        kept_bytes_per_sample: Some(r[last][i].kept_bytes as f64 / big),
                        deferred_bytes_per_sample: Some(r[last][i].deferred_bytes as f64 / big),
                    })
                    .collect(),
                measured,
                attention: None,
                shapes: None,
            }
        })
        .collect();
    Ok(Profile {
        source,
        dtype_bytes,
        layers,
        bounds: unit_bounds(model),
        tp_divides,
        threads: candle_core::utils::get_num_threads(),
        optimizer: Some(optimizer),
    })
}
