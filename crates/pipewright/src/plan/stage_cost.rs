//! A model stage's costs for one micro-batch under a candidate's tp, cp, ep and sequence
//! parallelism: each layer costed by its shapes on the device's curve (or by its measured
//! fits), summed per stage, and the units balanced over the stages by that time. Part of
//! [`super::estimate()`]; what a search's candidates share of it is kept by [`super::memo`].

use super::after_schedule::StageCost;
use super::balance::{balance_cost, even_blocks};
use super::balance_ranks::balance_v;
use super::candidate::Candidate;
use super::cluster::Cluster;
use super::context_parallel as cp_cost;
use super::profile::{Fit, Profile};
use super::rank_memory::StageBytes;
use super::shapes::ShapeCost;
use crate::distributed::topology::Layout;
use crate::Result;

/// Each layer's cost by shape for a micro-batch of `rows` under `cand` (`None` for a measured
/// layer), costed once per distinct layer: a model's blocks are alike.
fn shape_costs(p: &Profile, c: &Cluster, cand: &Candidate, rows: usize) -> Vec<Option<ShapeCost>> {
    let Layout { tp, cp, .. } = cand.parallel.layout;
    let sp = cand.parallel.splits_sequence();
    let curve = c.hardware.gemm(p.dtype_bytes == 2);
    let mut out: Vec<Option<ShapeCost>> = Vec::with_capacity(p.layers.len());
    for (i, l) in p.layers.iter().enumerate() {
        let alike = i > 0 && {
            let prev = &p.layers[i - 1];
            prev.shapes == l.shapes && prev.attention == l.attention && prev.tp_split == l.tp_split
        };
        let k = if alike {
            out[i - 1]
        } else {
            l.shapes.as_ref().map(|shapes| {
                shapes.cost(
                    l.attention.as_ref(),
                    &curve,
                    c.hardware.memory_bandwidth_bytes_per_s,
                    rows,
                    if l.tp_split { tp } else { 1 },
                    cp,
                    sp,
                )
            })
        };
        out.push(k);
    }
    out
}

/// The costs of model stage layers `layers` for one micro-batch of `rows` under `cand`'s tp,
/// cp and sequence parallelism (see [`super::context_parallel`]); `shaped` holds each layer's cost by
/// shape ([`shape_costs`]).
fn stage_cost(
    p: &Profile,
    c: &Cluster,
    cand: &Candidate,
    rows: usize,
    units: std::ops::Range<usize>,
    shaped: &[Option<ShapeCost>],
) -> StageCost {
    let Layout { tp, cp, ep, .. } = cand.parallel.layout;
    let sp = cand.parallel.splits_sequence();
    let layers = p.unit_layers(units);
    let tp_link = c.link(tp);
    let ring_link = c.link(tp * cp);
    // An expert group: ep neighbouring replicas, tp * cp ranks apart.
    let ep_link = c.link(tp * cp * ep);
    // This rank's share of every token-wise cost, and of what crosses a cut.
    let share = cp_cost::share(cp);
    let cut = share / if sp { tp as f64 } else { 1.0 };
    let threads = c.thread_ratio(p.threads);
    let slow = threads * share;
    let mut s = StageCost {
        compute: 0.0,
        memory: 0.0,
        comm_by: [0.0; 3],
        forward: 0.0,
        backward: 0.0,
        backward_input: 0.0,
        backward_weight: 0.0,
        params: 0.0,
        bytes: StageBytes::new(if layers.start == 0 {
            0.0
        } else {
            p.layers[layers.start - 1].output_bytes_per_sample * rows as f64 * cut
        }),
        output: p.layers[layers.end - 1].output_bytes_per_sample * rows as f64 * cut,
        busy: match tp {
            1 => [1.0; 2],
            _ => p.busy_share(tp, rows, layers.clone()).unwrap_or([1.0; 2]),
        },
    };
    for (l, shape) in p.layers[layers.clone()].iter().zip(&shaped[layers]) {
        let r = rows as f64;
        let t = if l.tp_split { tp as f64 } else { 1.0 };
        let before = s.params;
        // Sequence parallelism's reduce-scatter and all-gather move an all-reduce's bytes.
        let comm = if l.tp_split && tp > 1 {
            tp_link.all_reduce(tp, l.tp_all_reduce_bytes_per_sample * r * share)
        } else {
            0.0
        };
        // A shard measured at this tp size (a measured profile's), else the layer's own costs.
        let measured = l
            .split
            .iter()
            .find(|m| m.tp == tp)
            .filter(|_| shape.is_none());
        if let Some(m) = measured {
            // Measured at this tp size: the shard's own times, its collectives included.
            s.forward += m.forward.at(rows) * slow;
            s.backward += m.backward.at(rows) * slow;
            s.backward_input += m.backward_input.at(rows) * slow;
            s.backward_weight += m.backward_weight.at(rows) * slow;
            s.params += m.params as f64;
            s.compute += (m.forward.at(rows) + m.backward.at(rows)) * slow;
        } else {
            // Forward, full backward, its input and weight parts, and of forward and backward
            // the seconds at the ceiling and bound by memory: from the shapes (costed at this
            // tp, cp and micro-batch on the device's curve) or the fitted times.
            let (f, b, i, w, compute, memory) = match shape {
                Some(k) => {
                    let (i, w) = (k.backward_input * threads, k.backward_weight * threads);
                    let f = k.forward * threads;
                    (f, i + w, i, w, k.compute * threads, k.memory * threads)
                }
                None => {
                    let b = l.backward.at(rows);
                    let part = |f: Option<Fit>| f.map_or(b / 2.0, |f| f.at(rows)) / t * slow;
                    let (f, b) = (l.forward.at(rows) / t * slow, b / t * slow);
                    let (i, w) = (part(l.backward_input), part(l.backward_weight));
                    (f, b, i, w, f + b, 0.0)
                }
            };
            s.forward += f + comm;
            s.backward += b + comm;
            s.backward_input += i + comm;
            s.backward_weight += w;
            s.compute += compute;
            s.memory += memory;
            s.comm_by[0] += 2.0 * comm;
            s.params += l.params as f64 / t;
        }
        if let Some(x) = &l.experts {
            // This rank holds 1/ep of the experts, and exchanges its tokens' rows with the
            // group's ranks in the forward and again in the backward.
            s.params -= x.params / t * (1.0 - 1.0 / ep as f64);
            let a2a = 2.0 * ep_link.all_to_all(ep, x.all_to_all * r * share / 2.0);
            s.forward += a2a;
            s.backward += a2a;
            s.backward_input += a2a;
            s.comm_by[2] += 2.0 * a2a;
        }
        s.bytes.largest = s.bytes.largest.max(s.params - before);
        if let Some(a) = &l.attention {
            let (f, b) = cp_cost::ring_seconds(a, rows, tp, cp, ring_link);
            s.forward += f;
            s.backward += b;
            s.backward_input += b;
            s.comm_by[1] += f + b;
            s.bytes.working =
                s.bytes
                    .working
                    .max(cp_cost::working_bytes(a, rows, tp, cp, p.dtype_bytes));
        }
        let measured = l.split.iter().find(|m| m.tp == tp);
        s.bytes.add(l, measured, tp, sp, r * share);
    }
    s
}

/// The model's units balanced over `stages` model stages by their time (a V's by its ranks'
/// summed time; or in even blocks, as the runtime asks), with each stage's costs for a
/// micro-batch of `rows`.
pub(super) fn balanced_stages(
    profile: &Profile,
    cluster: &Cluster,
    cand: &Candidate,
    rows: usize,
    stages: usize,
) -> Result<(Vec<usize>, Vec<StageCost>)> {
    let units = profile.units();
    let shaped = shape_costs(profile, cluster, cand, rows);
    let unit_time: Vec<f64> = (0..units)
        .map(|u| {
            let s = stage_cost(profile, cluster, cand, rows, u..u + 1, &shaped);
            s.forward + s.backward
        })
        .collect();
    let balance = if cluster.runtime.even_blocks {
        even_blocks(units, stages)?
    } else if cand.schedule.kind.is_v() {
        balance_v(&unit_time, stages / 2)?
    } else {
        balance_cost(&unit_time, stages)?
    };
    let mut start = 0;
    let costs: Vec<StageCost> = balance
        .iter()
        .map(|&n| {
            let c = stage_cost(profile, cluster, cand, rows, start..start + n, &shaped);
            start += n;
            c
        })
        .collect();
    Ok((balance, costs))
}
