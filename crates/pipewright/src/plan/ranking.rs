//! Ranking given candidates: each checked against the world and the model, costed
//! ([`super::estimate()`]), kept when every rank fits in the memory cap, and the fastest
//! returned; what cannot run is refused with why. [`super::search()`] ranks every candidate
//! of a world this way.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::candidate::Candidate;
use super::cluster::Cluster;
use super::estimate::{estimate_with, step_floor, Estimate};
use super::hardware::format_bytes;
use super::memo::Memo;
use super::profile::Profile;
use crate::distributed::topology::Layout;
use crate::{invalid, Result};

/// What to plan for.
#[derive(Clone, Debug)]
pub struct Request {
    /// Ranks (devices) of the job.
    pub world: usize,
    /// Memory each rank may use, in bytes.
    pub memory_bytes: f64,
    /// Rows of every step over all data-parallel replicas.
    pub global_batch: usize,
    /// The best `top` candidates are returned.
    pub top: usize,
}

/// A candidate the planner cannot cost, and why: a layout of another world, more stages
/// than the model has units, an interleaved schedule whose micro-batches pp does not divide.
#[derive(Clone, Debug)]
pub struct Refused {
    /// The candidate as given (its spec), or as it prints.
    pub what: String,
    /// Why it cannot run.
    pub why: String,
}

/// [`super::search()`] among the given candidates only (each checked against the world and model); an
/// error names the first that cannot run ([`rank_pinned`] lists them and ranks the others).
pub fn rank(
    profile: &Profile,
    cluster: &Cluster,
    req: &Request,
    all: Vec<Candidate>,
) -> Result<Vec<Estimate>> {
    let (best, refused) = rank_pinned(profile, cluster, req, all)?;
    match refused.into_iter().next() {
        Some(r) => Err(invalid!("{}", r.why)),
        None => Ok(best),
    }
}

/// Why `c` cannot be planned for `req` and `profile`, if it cannot.
fn check(c: &Candidate, req: &Request, profile: &Profile) -> Result<()> {
    let Layout { pp, tp, cp, .. } = c.parallel.layout;
    if c.parallel.layout.world() != req.world {
        return Err(invalid!(
            "{} is not a layout of {} ranks",
            c.parallel.layout,
            req.world
        ));
    }
    let per_rank = c.schedule.stages_per_rank();
    if pp * per_rank > profile.units() {
        return Err(invalid!(
            "{} with {} chunks per stage needs more than the model's {} units",
            c.parallel.layout,
            per_rank,
            profile.units()
        ));
    }
    if cp > 1 && !profile.sequence().is_some_and(|s| s.is_multiple_of(2 * cp)) {
        return Err(invalid!(
            "{}: cp {cp} needs a model that attends over sequences of a multiple of 2 x cp = \
             {} tokens (this profile's: {:?}; a measured profile does not record its \
             attention: plan cp from the model's shapes)",
            c.parallel.layout,
            2 * cp,
            profile.sequence()
        ));
    }
    if c.parallel.sequence_parallel && tp == 1 {
        return Err(invalid!(
            "{}: sequence parallelism splits over the tensor-parallel ranks: it needs tp > 1",
            c.parallel.layout
        ));
    }
    if let Some(d) = profile.tp_divides.iter().find(|d| !d.is_multiple_of(tp)) {
        return Err(invalid!(
            "tp {tp} does not divide {d}: the model splits over tensor-parallel sizes that \
             divide each of {:?} (its heads, vocabulary, ...; [1]: it does not split)",
            profile.tp_divides
        ));
    }
    Ok(())
}

/// Each of `all` costed on its own: the `req.top` fastest that fit in `req.memory_bytes`
/// (as [`super::search()`] ranks them), and those that cannot run, each with why (`plan --candidate`
/// lists them beside the others). An error when none can run, or none fits. The candidates
/// are costed in contiguous runs taken in turn by a thread a core, each sharing what
/// consecutive candidates share (a layout's stages, a schedule's replay): the same ranking
/// as one after another.
pub fn rank_pinned(
    profile: &Profile,
    cluster: &Cluster,
    req: &Request,
    all: Vec<Candidate>,
) -> Result<(Vec<Estimate>, Vec<Refused>)> {
    if req.world == 0 || req.global_batch == 0 || req.top == 0 {
        return Err(invalid!("world, global batch and top must be positive"));
    }
    if all.is_empty() {
        return Err(invalid!(
            "a world of {} cannot be split for this model: pp must divide it and be at most the \
             model's {} units, tp must divide what is left and each of {:?}, and dp must divide \
             the global batch {}; choose another world size or global batch",
            req.world,
            profile.units(),
            profile.tp_divides,
            req.global_batch
        ));
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Runs much smaller than a core's share, taken in turn: candidates' costs vary by orders
    // of magnitude (a replay's actions grow with pp x micro-batches).
    let runs: Vec<&[Candidate]> = all.chunks(all.len().div_ceil(16 * cores)).collect();
    let next = AtomicUsize::new(0);
    // The slowest of `top` fits any finished run kept (f64 bits): a candidate whose floor
    // is above it is slower than `top` others, so it cannot be among those returned.
    let bar = AtomicU64::new(f64::INFINITY.to_bits());
    let work = || {
        let mut memo = Memo::default();
        let mut done = Vec::new();
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(run) = runs.get(i) else {
                return done;
            };
            done.push((i, Tally::of((profile, cluster, req), run, &mut memo, &bar)));
        }
    };
    let mut tallies: Vec<(usize, Tally)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..cores.min(runs.len())).map(|_| s.spawn(work)).collect();
        let joined = workers.into_iter().map(|w| w.join());
        joined.collect::<std::thread::Result<Vec<Vec<(usize, Tally)>>>>()
    })
    .map_err(|_| invalid!("a planner thread panicked"))?
    .into_iter()
    .flatten()
    .collect();
    // Merged in the candidates' order: the same ranking, ties and all, as one after another.
    tallies.sort_by_key(|(i, _)| *i);
    let mut t = Tally::default();
    for (_, other) in tallies {
        t.merge(other, req.top);
    }
    t.finish(req)
}

/// What a run of candidates came to: the fastest that fit (at most `top` once trimmed), the
/// one over the cap with the smallest peak, and the refused.
struct Tally {
    fits: Vec<Estimate>,
    /// The step of the `top`-th fastest fit at the last trim (infinite before).
    slowest_kept: f64,
    smallest: Option<Estimate>,
    refused: Vec<Refused>,
}

impl Default for Tally {
    fn default() -> Self {
        Self {
            fits: Vec::new(),
            slowest_kept: f64::INFINITY,
            smallest: None,
            refused: Vec::new(),
        }
    }
}

impl Tally {
    /// `run` costed in order, sharing `memo`; a candidate whose floor
    /// ([`step_floor`]) is above the slowest of `top` fits kept here or in another run (`bar`)
    /// is skipped: it cannot be among those returned. This run's slowest kept joins `bar`.
    fn of(
        (profile, cluster, req): (&Profile, &Cluster, &Request),
        run: &[Candidate],
        memo: &mut Memo,
        bar: &AtomicU64,
    ) -> Self {
        let mut t = Tally::default();
        for c in run {
            let slowest = t
                .slowest_kept
                .min(f64::from_bits(bar.load(Ordering::Relaxed)));
            let costed = check(c, req, profile).and_then(|()| {
                if step_floor(profile, cluster, c, memo)? > slowest {
                    return Ok(None);
                }
                estimate_with(profile, cluster, c, memo).map(Some)
            });
            match costed {
                Ok(Some((e, _))) => t.add(e, req),
                Ok(None) => {}
                Err(e) => t.refused.push(Refused {
                    what: c.to_string(),
                    why: e.to_string(),
                }),
            }
        }
        t.trim(req.top);
        let mut seen = bar.load(Ordering::Relaxed);
        while t.slowest_kept < f64::from_bits(seen) {
            let kept = t.slowest_kept.to_bits();
            match bar.compare_exchange(seen, kept, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => break,
                Err(now) => seen = now,
            }
        }
        t
    }

    fn add(&mut self, e: Estimate, req: &Request) {
        if e.max_peak_bytes() <= req.memory_bytes {
            self.fits.push(e);
            // Bounded memory over a large search: only the fastest `top` can be returned.
            if self.fits.len() >= 2 * req.top + 16 {
                self.trim(req.top);
            }
        } else if (self.smallest.as_ref()).is_none_or(|s| e.max_peak_bytes() < s.max_peak_bytes()) {
            self.smallest = Some(e);
        }
    }

    /// Keeps the `top` fastest fits (ties: the smaller peak; then the earlier).
    fn trim(&mut self, top: usize) {
        self.fits.sort_by(|a, b| {
            a.step_s
                .total_cmp(&b.step_s)
                .then(a.max_peak_bytes().total_cmp(&b.max_peak_bytes()))
        });
        self.fits.truncate(top);
        self.slowest_kept = match self.fits.len() {
            n if n == top => self.fits[n - 1].step_s,
            _ => f64::INFINITY,
        };
    }

    /// Adds a later run's tally to this one's.
    fn merge(&mut self, other: Tally, top: usize) {
        self.fits.extend(other.fits);
        self.trim(top);
        if let Some(e) = other.smallest {
            if (self.smallest.as_ref()).is_none_or(|s| e.max_peak_bytes() < s.max_peak_bytes()) {
                self.smallest = Some(e);
            }
        }
        self.refused.extend(other.refused);
    }

    /// The fastest fits and the refused; an error when nothing could be costed, or nothing
    /// fits (naming the smallest cap that works).
    fn finish(self, req: &Request) -> Result<(Vec<Estimate>, Vec<Refused>)> {
        if !self.fits.is_empty() {
            return Ok((self.fits, self.refused));
        }
        let Some(s) = self.smallest else {
            let whys: Vec<String> = self.refused.iter().map(|r| r.why.clone()).collect();
            return Err(invalid!("no candidate can run: {}", whys.join("; ")));
        };
        Err(invalid!(
            "no layout fits in {} per device: the smallest cap that works is {} ({} bytes: {} \
             micro-batch {} {} recompute {} zero {})",
            format_bytes(req.memory_bytes),
            format_bytes(s.max_peak_bytes()),
            s.max_peak_bytes().ceil(),
            s.candidate.parallel.layout,
            s.candidate.micro_batch,
            s.candidate.schedule.kind,
            s.candidate.schedule.recompute,
            s.candidate.parallel.zero
        ))
    }
}
