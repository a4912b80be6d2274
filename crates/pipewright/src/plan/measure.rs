//! A [`Profile`] measured on this machine: every layer of a model timed at a few micro-batch
//! sizes (and tensor-parallel sizes, each on as many threads as ranks), fitted as fixed +
//! per-sample seconds, with its parameter, output, kept and deferred bytes.

use super::action_cost::ActionTrace;
use super::crowding::crowded_efficiency;
use super::layer_cost::{median, profile_stage, LayerCost};
use super::optimizer_cost::{time_accumulate, time_optimizer, Before};
use super::profile::{Fit, LayerProfile, Profile, SplitCost, Timing, Transient};
use crate::distributed::comm::local;
use crate::distributed::comm::Group;
use crate::model::batch::Batch;
use crate::model::{Build, Sequential};
use crate::parallel::loss::{Loss, SharedLoss};
use crate::parallel::pipeline::partition::unit_bounds;
use crate::{invalid, Result};

/// Rounds of timings: each round times every layer at every size once, in turn, and each
/// timing's median over the rounds is kept. Rounds rather than repeats of one layer at a time:
/// on a shared machine a slow stretch of a few milliseconds then lands on one timing of many
/// layers instead of on every timing of one (measured here: five repeats in a row left two
/// identical GPT blocks' backwards 35 % apart, and profiles taken minutes apart predicted the
/// same layout 10 % apart). A profile of the README's GPT takes 1.4 s here.
const ROUNDS: usize = 21;

/// Every layer of `model` (built once) timed at each size of `batches`, [`ROUNDS`] rounds in
/// turn after one untimed round (which allocates what the first passes would): per size, each
/// layer's costs with every time the median over the rounds.
fn profile_rounds(
    model: &Sequential,
    build: &Build,
    batches: &[Batch],
    loss: Option<&dyn Loss>,
) -> Result<Vec<Vec<LayerCost>>> {
    let stage = model.build(build)?;
    let mut rounds = Vec::with_capacity(ROUNDS);
    for round in 0..=ROUNDS {
        let costs = batches
            .iter()
            .map(|b| profile_stage(&stage, b, 1, loss))
            .collect::<Result<Vec<_>>>()?;
        if round > 0 {
            rounds.push(costs);
        }
    }
    let mut out = rounds[ROUNDS - 1].clone();
    for (s, size) in out.iter_mut().enumerate() {
        for (i, c) in size.iter_mut().enumerate() {
            let of =
                |f: fn(&LayerCost) -> f64| median(rounds.iter().map(|r| f(&r[s][i])).collect());
            c.forward_s = of(|c| c.forward_s);
            c.backward_s = of(|c| c.backward_s);
            c.backward_input_s = of(|c| c.backward_input_s);
            c.backward_weight_s = of(|c| c.backward_weight_s);
            let cpus: Vec<f64> = rounds.iter().filter_map(|r| r[s][i].cpu_s).collect();
            c.cpu_s = (!cpus.is_empty()).then(|| median(cpus));
        }
    }
    Ok(out)
}

/// What `c`'s backward holds at its peak per sample of `rows`, if the allocator counted it.
fn transient(c: &LayerCost, rows: f64) -> Option<Transient> {
    let ((whole, whole_kept), (input, input_kept)) =
        (c.backward_transient_bytes?, c.input_transient_bytes?);
    Some(Transient {
        backward_bytes_per_sample: whole as f64 / rows,
        backward_kept_bytes_per_sample: whole_kept as f64 / rows,
        input_bytes_per_sample: input as f64 / rows,
        input_kept_bytes_per_sample: input_kept as f64 / rows,
    })
}

/// The least-squares lines of `field` of layer `i` over `runs` (one per size). A timing far
/// off the line (a busy spell of the machine) is said on stderr: planned from, one such point
/// made predictions 16-30 times too slow.
fn fit(sizes: &[usize], runs: &[Vec<LayerCost>], i: usize, field: fn(&LayerCost) -> f64) -> Fit {
    let points: Vec<(f64, f64)> = sizes
        .iter()
        .zip(runs)
        .map(|(&rows, r)| (rows as f64, field(&r[i])))
        .collect();
    let line = Fit::through(&points);
    if let Some((ratio, rows)) = off_line(&points) {
        let name = runs.first().map_or("?", |r| r[i].name.as_str());
        eprintln!(
            "note: profile: layer `{name}` timed {ratio:.1}x off the line through its other \
             sizes at {rows} rows: the machine was busy while it measured; profile again on a \
             quiet machine before planning from it"
        );
    }
    line
}

/// The point of `points` (rows, seconds) farthest off the line through the others, as
/// (ratio, rows), when it is more than [`NOISY`] times off and there are points enough to
/// tell (three or more). Points under 10 microseconds are left out: such a layer is too cheap
/// to time either way.
fn off_line(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    if points.len() < 3 {
        return None;
    }
    let worst = (0..points.len())
        .filter(|&j| points[j].1 >= 1e-5)
        .map(|j| {
            let others: Vec<(f64, f64)> = (0..points.len())
                .filter(|&k| k != j)
                .map(|k| points[k])
                .collect();
            let (rows, t) = points[j];
            let on = Fit::through(&others).at(rows as usize).max(1e-9);
            ((t / on).max(on / t.max(1e-9)), rows)
        })
        .fold((1.0, 0.0), |w, x| if x.0 > w.0 { x } else { w });
    (worst.0 > NOISY).then_some(worst)
}

/// How far (as a ratio) a timing may lie off its layer's line before it is said to be noise.
const NOISY: f64 = 3.0;

/// The share of layer `i`'s forward and backward time over `runs` (one per size) that its
/// thread computed, where the CPU clock was read: the rest it waited in its collectives.
fn busy_share(runs: &[Vec<LayerCost>], i: usize) -> Option<f64> {
    let (mut cpu, mut wall) = (0.0, 0.0);
    for r in runs {
        cpu += r[i].cpu_s?;
        wall += r[i].forward_s + r[i].backward_s;
    }
    (wall > 0.0).then(|| (cpu / wall).clamp(0.0, 1.0))
}

/// Every layer profiled on `tp` ranks as threads of a tensor-parallel group at each size:
/// per size, rank 0's costs (its shard; every rank runs the same collectives).
fn profile_split(
    model: &Sequential,
    build: &Build,
    batches: &[Batch],
    tp: usize,
    loss: Option<&dyn Loss>,
) -> Result<Vec<Vec<LayerCost>>> {
    let mut per_rank = local::run(tp, |c| {
        let build = build.clone().with_tp(Group::new(Box::new(c)));
        profile_rounds(model, &build, batches, loss)
    })?;
    Ok(per_rank.swap_remove(0))
}

/// Layer `i`'s profile from its timings `runs` at each of `sizes` (one per size; `splits` the
/// same at each measured tp size), with its bytes per sample from the largest size.
fn layer_profile(
    i: usize,
    sizes: &[usize],
    runs: &[Vec<LayerCost>],
    splits: &[(usize, Vec<Vec<LayerCost>>)],
    dtype_bytes: usize,
) -> LayerProfile {
    let measured: Vec<Timing> = sizes
        .iter()
        .zip(runs)
        .map(|(&rows, r)| Timing {
            rows,
            forward_s: r[i].forward_s,
            backward_s: r[i].backward_s,
            backward_input_s: r[i].backward_input_s,
            backward_weight_s: r[i].backward_weight_s,
        })
        .collect();
    let (last, big) = (runs.len() - 1, *sizes.last().expect("not empty") as f64);
    let l = &runs[last][i];
    let output = l.activation_bytes as f64 / big;
    let kept = l.kept_bytes as f64 / big;
    let split = l.param_bytes > 0;
    LayerProfile {
        name: l.name.clone(),
        params: (l.param_bytes / dtype_bytes) as u64,
        tp_split: split,
        forward: fit(sizes, runs, i, |c| c.forward_s),
        backward: fit(sizes, runs, i, |c| c.backward_s),
        backward_input: Some(fit(sizes, runs, i, |c| c.backward_input_s)),
        backward_weight: Some(fit(sizes, runs, i, |c| c.backward_weight_s)),
        output_bytes_per_sample: output,
        kept_bytes_per_sample: kept,
        deferred_bytes_per_sample: l.deferred_bytes as f64 / big,
        split_kept_bytes_per_sample: Some(l.split_kept_bytes as f64 / big),
        kept_whole_bytes_per_sample: if split { kept.min(2.0 * output) } else { kept },
        transient: transient(l, big),
        tp_all_reduce_bytes_per_sample: if split { 2.0 * output } else { 0.0 },
        experts: None,
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
                split_kept_bytes_per_sample: Some(r[last][i].split_kept_bytes as f64 / big),
                transient: transient(&r[last][i], big),
                busy_share: busy_share(r, i),
            })
            .collect(),
        measured,
        attention: None,
        shapes: None,
    }
}

/// What [`measure`] times: micro-batch sizes, tensor-parallel sizes, how many copies run at
/// once, and the loss the last stage computes.
#[derive(Clone)]
pub struct Sizes {
    /// Micro-batch sizes (rows).
    pub rows: Vec<usize>,
    /// Tensor-parallel sizes timed as such (1 is the unsplit layer).
    pub tp: Vec<usize>,
    /// Copies of the profile run at once (ranks computing at once on this machine).
    pub concurrent: usize,
    /// The loss after the model's last layer (the last stage's work beyond its layers, timed
    /// with the last layer), if any.
    pub loss: Option<SharedLoss>,
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
        loss: shared_loss,
    } = sizes;
    let loss = shared_loss.as_deref();
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
    // The executor's cost an action, with ranks one thread each as the copies are: traced in
    // three bursts, before, amid and after the layers' timings, so that its actions and the
    // layers they are compared with meet the same speeds of the machine (one trial after
    // the profile gave a backward 29-122 us in five profiles in a row: a slow spell of the
    // machine fell on it and not on the profile's rounds, or the other way).
    let trace_actions = |a: &mut Option<ActionTrace>| -> Result<()> {
        let (2.., Some(loss)) = (concurrent, shared_loss) else {
            return Ok(());
        };
        let mid = &batches[batches.len() / 2];
        match (
            a.as_mut(),
            ActionTrace::burst(model, build, mid, loss.clone())?,
        ) {
            (Some(a), Some(b)) => a.extend(b),
            (None, b) => *a = b,
            (Some(_), None) => {}
        }
        Ok(())
    };
    let mut actions = None;
    trace_actions(&mut actions)?;
    // The update and the gradient sum are timed beside the layers, by as many copies at once.
    let profile_all = || {
        let runs = profile_rounds(model, build, &batches, loss)?;
        // After a pass at the middle size, as a step updates after its schedule.
        let before = Before {
            batch: &batches[batches.len() / 2],
            loss,
        };
        let update = time_optimizer(model, build, ROUNDS, &before)?;
        Ok((runs, (update, time_accumulate(model, build, ROUNDS)?)))
    };
    let (runs, (optimizer, accumulate)) = if concurrent > 1 {
        local::run(concurrent, |_| profile_all())?.swap_remove(0)
    } else {
        profile_all()?
    };
    // Crowding: twice as many copies as ranks computing at once, at the middle size.
    let crowded = match concurrent {
        1 => None,
        n => Some(crowded_efficiency(
            model,
            build,
            &batches[batches.len() / 2],
            loss,
            n,
        )?),
    };
    trace_actions(&mut actions)?;
    let mut splits = Vec::new();
    for &tp in tp_sizes.iter().filter(|&&t| t > 1) {
        splits.push((tp, profile_split(model, build, &batches, tp, loss)?));
    }
    trace_actions(&mut actions)?;
    let dtype_bytes = model
        .build(build)?
        .layers()
        .iter()
        .flat_map(|l| l.params())
        .map(|(_, v)| v.dtype().size_in_bytes())
        .next()
        .unwrap_or(4);
    let layers: Vec<LayerProfile> = (0..runs[0].len())
        .map(|i| layer_profile(i, sizes, &runs, &splits, dtype_bytes))
        .collect();
    let params: Vec<u64> = layers.iter().map(|l| l.params).collect();
    let action_overhead = actions.map(|a| a.overhead(&params, accumulate));
    Ok(Profile {
        source,
        dtype_bytes,
        layers,
        bounds: unit_bounds(model),
        tp_divides,
        threads: candle_core::utils::get_num_threads(),
        optimizer: Some(optimizer),
        accumulate: Some(accumulate),
        crowded_efficiency: crowded,
        action_overhead,
    })
}

#[cfg(test)]
mod tests {
    use super::off_line;

    #[test]
    fn a_timing_far_off_its_layers_line_is_found() {
        let clean: Vec<(f64, f64)> = [1.0, 2.0, 4.0, 8.0]
            .iter()
            .map(|&r| (r, 1e-3 + 2e-4 * r))
            .collect();
        assert_eq!(off_line(&clean), None);
        let mut busy = clean.clone();
        busy[1].1 *= 30.0;
        let (ratio, rows) = off_line(&busy).unwrap();
        assert!(ratio > 3.0 && rows == 2.0, "{ratio} at {rows}");
    }
}
