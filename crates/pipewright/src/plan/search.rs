//! AutoConfig (Varuna's, and what Megatron users do by hand): every pp x tp x cp x dp layout
//! of a world (ep, for a mixture of experts, in the divisors of dp that divide its experts; cp when the model attends over sequences that split into 2 x cp chunks of at
//! least [`MIN_CHUNK_TOKENS`]; sequence parallelism whenever tp > 1), every micro-batch size, schedule,
//! recompute mode and ZeRO stage, predicted by
//! [`estimate`](fn@super::estimate::estimate), kept when each rank fits in the memory cap, and
//! ranked by step time.

use super::candidate::Candidate;
use super::cluster::Cluster;
use super::estimate::Estimate;
use super::profile::Profile;
pub use super::ranking::Request;
use super::ranking::{rank, rank_pinned, Refused};
use crate::distributed::topology::Layout;
use crate::parallel::dims::ParallelSpec;
use crate::parallel::pipeline::schedule::ScheduleKind;
use crate::parallel::pipeline::{Recompute, ScheduleChoice};
use crate::parallel::zero::Zero;
use crate::{invalid, Result};

fn divisors(n: usize) -> impl Iterator<Item = usize> {
    (1..=n).filter(move |d| n.is_multiple_of(*d))
}

/// Micro-batch sizes tried for `rows` per replica: the powers of two that divide it, and
/// `rows` itself.
fn micro_batch_sizes(rows: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (0..usize::BITS)
        .map(|i| 1usize << i)
        .take_while(|&s| s <= rows)
        .filter(|s| rows.is_multiple_of(*s))
        .collect();
    if v.last() != Some(&rows) {
        v.push(rows);
    }
    v
}

/// Every layout of `world` ranks for a model of `units` units (pp at most that) whose tp
/// size divides each of `tp_divides` and whose dp divides `global_batch`: the layouts the
/// planner searches and a morphing run chooses from.
pub fn layouts(
    world: usize,
    units: usize,
    tp_divides: &[usize],
    global_batch: usize,
) -> Vec<Layout> {
    let mut out = Vec::new();
    for pp in divisors(world).filter(|&pp| pp <= units) {
        let rest = world / pp;
        for tp in divisors(rest).filter(|tp| tp_divides.iter().all(|d| d.is_multiple_of(*tp))) {
            let dp = rest / tp;
            if global_batch.is_multiple_of(dp) {
                out.push(Layout {
                    pp,
                    tp,
                    dp,
                    cp: 1,
                    ep: 1,
                });
            }
        }
    }
    out
}

/// The fewest tokens of one chunk a ring is searched with (a rank holds two): shorter chunks
/// make attention's products too thin to be worth a ring (Megatron and torchtitan turn to
/// context parallelism for sequences of 8k tokens and more; a pinned candidate may use any).
pub const MIN_CHUNK_TOKENS: usize = 512;

/// Context-parallel sizes searched for `world` ranks and a model attending over `seq` tokens
/// (1 alone when it does not): those that divide the world and split the sequence into
/// `2 x cp` chunks of at least [`MIN_CHUNK_TOKENS`].
fn cp_sizes(world: usize, seq: Option<usize>) -> Vec<usize> {
    divisors(world)
        .filter(|&cp| {
            cp == 1
                || seq.is_some_and(|s| s.is_multiple_of(2 * cp) && s / (2 * cp) >= MIN_CHUNK_TOKENS)
        })
        .collect()
}

/// Every candidate of `req`'s world for `profile`'s model.
pub fn candidates(req: &Request, profile: &Profile) -> Vec<Candidate> {
    let (units, tp_divides) = (profile.units(), &profile.tp_divides);
    let experts = profile.experts();
    let mut out = Vec::new();
    let mut all = Vec::new();
    for cp in cp_sizes(req.world, profile.sequence()) {
        for l in layouts(req.world / cp, units, tp_divides, req.global_batch) {
            // Expert parallelism over groups of the replicas, dividing the experts.
            let eps =
                divisors(l.dp).filter(|&ep| ep == 1 || (experts > 0 && experts.is_multiple_of(ep)));
            all.extend(eps.map(|ep| Layout { cp, ep, ..l }));
        }
    }
    for layout in all {
        let Layout { pp, tp, dp, .. } = layout;
        let rows = req.global_batch / dp;
        for micro_batch in micro_batch_sizes(rows) {
            let m = rows / micro_batch;
            let mut schedules = vec![(ScheduleKind::OneFOneB, 1)];
            if pp > 1 {
                schedules.extend([(ScheduleKind::GPipe, 1), (ScheduleKind::ZeroBubbleH1, 1)]);
                if units >= 2 * pp && m.is_multiple_of(pp) {
                    schedules.push((ScheduleKind::Interleaved, 2));
                }
                // The V schedules: two stages per rank, the first and last on rank 0.
                if units >= 2 * pp {
                    schedules.push((ScheduleKind::ZeroBubbleV, 1));
                    if m >= 2 * pp {
                        schedules.push((ScheduleKind::DualPipeV, 1));
                    }
                }
            }
            let zeros: &[Zero] = if dp > 1 {
                &[
                    Zero::Off,
                    Zero::OptimizerState,
                    Zero::Gradients,
                    Zero::Parameters,
                ]
            } else {
                &[Zero::Off]
            };
            // Sequence parallelism: the same step and less memory in the model, so with tp > 1
            // it is searched alone (pin `sp=0` to compare); a mixture of experts does not
            // take it yet.
            let sps: &[bool] = if tp > 1 && experts == 0 {
                &[true]
            } else {
                &[false]
            };
            for (schedule, virtual_stages) in schedules {
                for recompute in [Recompute::Never, Recompute::Always] {
                    for &zero in zeros {
                        for &sequence_parallel in sps {
                            out.push(Candidate {
                                parallel: ParallelSpec {
                                    layout,
                                    zero,
                                    sequence_parallel,
                                },
                                micro_batch,
                                micro_batches: m,
                                schedule: ScheduleChoice {
                                    kind: schedule,
                                    virtual_stages,
                                    recompute,
                                },
                            });
                        }
                    }
                }
            }
        }
    }
    out
}

/// A candidate written as `pp=2,tp=1,dp=2,mbs=8,schedule=1f1b,recompute=never,zero=1`
/// (`virtual=2` with the interleaved schedule, `cp=2` for context parallelism, `sp=1` for
/// sequence parallelism; left out: pp, tp, cp, dp and virtual 1, mbs the replica's rows, 1f1b,
/// never, zero 0, sp 0) for a global batch of `global_batch` rows.
pub fn parse_candidate(spec: &str, global_batch: usize) -> Result<Candidate> {
    let mut c = Candidate {
        parallel: ParallelSpec::new(Layout::serial()),
        micro_batch: 0,
        micro_batches: 0,
        schedule: ScheduleChoice::default(),
    };
    // Commas or spaces between the parts: the plan's own table writes a layout with spaces
    // (`pp=2 tp=1 dp=4 ep=2`), and it is given back as it is printed.
    let mut ep = 1;
    for part in spec
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|p| !p.trim().is_empty())
    {
        let (k, v) = part.trim().split_once('=').ok_or_else(|| {
            invalid!("`{part}` in candidate `{spec}` is not key=value (pp=2,tp=1,dp=2,mbs=8,schedule=1f1b,recompute=never)")
        })?;
        let n = || -> Result<usize> {
            v.parse::<usize>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| invalid!("{k} in candidate `{spec}` must be a positive integer"))
        };
        match k {
            "pp" => c.parallel.layout.pp = n()?,
            "tp" => c.parallel.layout.tp = n()?,
            "dp" => c.parallel.layout.dp = n()?,
            "cp" => c.parallel.layout.cp = n()?,
            "ep" => ep = n()?,
            "sp" => {
                c.parallel.sequence_parallel = match v {
                    "1" | "on" | "true" => true,
                    "0" | "off" | "false" => false,
                    _ => return Err(invalid!("sp in candidate `{spec}` is 1 or 0")),
                }
            }
            "mbs" => c.micro_batch = n()?,
            "virtual" => c.schedule.virtual_stages = n()?,
            "schedule" => c.schedule.kind = v.parse()?,
            "recompute" => c.schedule.recompute = v.parse()?,
            "zero" => c.parallel.zero = v.parse()?,
            _ => {
                return Err(invalid!(
                    "unknown key `{k}` in candidate `{spec}`: use pp, tp, cp, dp, ep, mbs, schedule, virtual, recompute, zero, sp"
                ))
            }
        }
    }
    c.parallel.layout = c.parallel.layout.with_ep(ep)?;
    let dp = c.parallel.layout.dp;
    if !global_batch.is_multiple_of(dp) {
        return Err(invalid!(
            "candidate `{spec}`: dp {dp} does not divide the global batch {global_batch}"
        ));
    }
    let rows = global_batch / dp;
    if c.micro_batch == 0 {
        c.micro_batch = rows;
    }
    if !rows.is_multiple_of(c.micro_batch) {
        return Err(invalid!(
            "candidate `{spec}`: micro-batches of {} rows do not divide a replica's {rows}",
            c.micro_batch
        ));
    }
    c.micro_batches = rows / c.micro_batch;
    Ok(c)
}

/// The candidates written as `specs` ([`parse_candidate`]) ranked as [`rank_pinned`] ranks
/// them: one that does not parse against the batch, or cannot run, is refused with why
/// (`plan --candidate` lists it beside the others); only refusals is an error naming each.
pub fn rank_specs(
    profile: &Profile,
    cluster: &Cluster,
    req: &Request,
    specs: &[String],
) -> Result<(Vec<Estimate>, Vec<Refused>)> {
    let mut refused = Vec::new();
    let mut pins = Vec::new();
    for spec in specs {
        match parse_candidate(spec, req.global_batch) {
            Ok(c) => pins.push(c),
            Err(e) => refused.push(Refused {
                what: spec.clone(),
                why: e.to_string(),
            }),
        }
    }
    if pins.is_empty() {
        let whys: Vec<String> = refused.into_iter().map(|r| r.why).collect();
        return Err(invalid!("no candidate can run: {}", whys.join("; ")));
    }
    let (best, more) = rank_pinned(profile, cluster, req, pins)?;
    refused.extend(more);
    Ok((best, refused))
}

/// The `req.top` fastest candidates that fit in `req.memory_bytes`, fastest first (ties: the
/// smaller peak). Errors say why none is left: a world the model cannot be split over, or
/// the smallest memory cap any layout needs.
pub fn search(profile: &Profile, cluster: &Cluster, req: &Request) -> Result<Vec<Estimate>> {
    // The candidates are enumerated by the world's divisors: a world past any layout's would
    // take as long to factor as to refuse.
    if req.world > crate::distributed::topology::MAX_WORLD {
        return Err(invalid!(
            "a world of {} ranks is more than the {} a layout may have",
            req.world,
            crate::distributed::topology::MAX_WORLD
        ));
    }
    rank(profile, cluster, req, candidates(req, profile))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::estimate::{estimate, step_floor};
    use crate::plan::memo::Memo;
    use crate::plan::{AttentionKernel, Cluster, Hardware, Transformer};

    /// The floor a search skips replays by is under every candidate's predicted step: on 64
    /// A100s (every layout, schedule, recompute and ZeRO stage of a 1.7B GPT) and on this
    /// machine's two cores shared by 4 ranks (the crowded replay).
    #[test]
    fn the_floor_is_under_every_step() {
        let model = |n_layer, d_model, n_head, seq| Transformer {
            n_layer,
            d_model,
            n_head,
            vocab: 4096,
            seq,
            attention: AttentionKernel::Fused,
        };
        for (hw, world, nodes, m) in [
            ("a100-node", 64, None, model(24, 2304, 24, 2048)),
            ("cpu-2core", 4, Some(1), model(4, 128, 4, 64)),
        ] {
            let hw = Hardware::load(hw).unwrap();
            let profile = m.profile(&hw, 4).unwrap();
            let cluster = Cluster::new(&hw, world, nodes).unwrap();
            let req = Request {
                world,
                memory_bytes: 1e15,
                global_batch: 64,
                top: 1,
            };
            let all = candidates(&req, &profile);
            assert!(all.len() > 50, "{}", all.len());
            let mut memo = Memo::default();
            for c in &all {
                let floor = step_floor(&profile, &cluster, c, &mut memo).unwrap();
                let (e, _) = estimate(&profile, &cluster, c).unwrap();
                assert!(
                    floor > 0.0 && floor <= e.step_s * (1.0 + 1e-12),
                    "{c:?}: {floor} > {}",
                    e.step_s
                );
            }
        }
    }
}
