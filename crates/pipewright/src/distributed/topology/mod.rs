//! Where each rank sits: [`Layout`] `{pp, tp, cp, dp}` and [`Topology`] (a layout plus a
//! placement of its positions on world ranks, such as Varuna's `stage_to_rank_map`).
//!
//! Ordering: within a layout, the tensor-parallel rank varies fastest, then the
//! context-parallel rank, then the data-parallel rank, then the pipeline stage (Megatron's
//! order):
//!
//! ```text
//! index = stage * (dp * cp * tp) + dp_rank * (cp * tp) + cp_rank * tp + tp_rank
//! ```
//!
//! so the ranks of one tensor-parallel group are neighbours (they talk most, every layer), a
//! context-parallel ring comes next (key/value blocks every attention), and each stage owns
//! one contiguous block of `dp * cp * tp` ranks. With `cp = 1` (the default) this is
//! `stage * (dp * tp) + dp_rank * tp + tp_rank`.
//!
//! Context-parallel ranks hold the same weights and split each sequence: they sum their
//! gradients with the data-parallel ranks ([`Axis::Replica`] is both together). [`Topology::new`] places index `i` on world
//! rank `i`; [`Topology::from_stage_to_rank_map`] places them as a launcher says.
//!
//! Expert parallelism (`ep`) adds no ranks: as in torchtitan and Megatron, replicas
//! `g*ep .. (g+1)*ep` (same stage, tp and cp rank) form expert group `g` ([`Axis::Expert`]),
//! replica `d` holding part `d % ep` of every mixture's experts; the ranks holding the same
//! experts ([`Axis::ExpertReplica`]) sum the experts' gradients, the rest as without experts.
//!
//! A [`Layout`] is also where the facts derived from the degrees live (torchtitan's
//! `ParallelDims`), so that no caller works them out again: its ranks ([`Layout::world`]), the
//! ranks that hold the same weights and sum gradients and losses ([`Layout::replicas`]), the
//! micro-batches a replica splits its rows into ([`Layout::micro_batches`]), and what a
//! sequence length must be a multiple of ([`Layout::sequence_multiple`]).

mod placement;

pub use placement::Topology;

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::runtime::flag_values::positive;
use crate::{invalid, Result};

/// The three parallel axes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Axis {
    /// Ranks holding the successive stages of one replica (same tp and dp rank).
    Pipeline,
    /// Ranks sharing the layers of one stage of one replica.
    Tensor,
    /// Replicas of the same stage and shard.
    Data,
    /// Ranks splitting the sequences of one replica (same stage, tp and dp rank).
    Context,
    /// Every rank holding the same weights (same stage and tp rank): the data-parallel and
    /// context-parallel ranks together, which sum their gradients (the data-parallel group
    /// when cp = 1).
    Replica,
    /// The `ep` neighbouring data-parallel replicas (same stage, tp and cp rank) that split a
    /// mixture's experts between them and send each other the tokens routed to them.
    Expert,
    /// The ranks holding the same experts (same stage, tp rank and expert-parallel rank):
    /// every `ep`-th data-parallel replica with its context-parallel ranks, which sum the
    /// experts' gradients (the [`Axis::Replica`] group when ep = 1).
    ExpertReplica,
}

/// A rank's position: pipeline stage, tensor-parallel rank, context-parallel rank,
/// data-parallel rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Coords {
    /// The pipeline stage.
    pub stage: usize,
    /// The rank within the tensor-parallel group.
    pub tp_rank: usize,
    /// The data-parallel replica.
    pub dp_rank: usize,
    /// The rank within the context-parallel ring (which slice of each sequence it holds).
    #[serde(default)]
    pub cp_rank: usize,
}

fn one() -> usize {
    1
}

/// Degrees of pipeline, tensor, context, data and expert parallelism. Its fields are
/// `train`'s flags `--pp`, `--tp`, `--dp`, `--cp` and `--ep` (clap's derive: a program
/// flattens it into its flags and checks what they make with [`Layout::validated`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, clap::Args)]
pub struct Layout {
    /// Pipeline stages.
    #[arg(help_heading = "Parallelism", long, default_value_t = 1, value_parser = positive)]
    pub pp: usize,
    /// Tensor-parallel ranks per stage (Megatron's split of the GPT: heads, MLP, vocabulary).
    #[arg(help_heading = "Parallelism", long, default_value_t = 1, value_parser = positive)]
    pub tp: usize,
    /// Data-parallel replicas (each takes its rows of every batch; gradients are summed).
    #[arg(help_heading = "Parallelism", long, default_value_t = 1, value_parser = positive)]
    pub dp: usize,
    /// Context-parallel ranks per replica: each holds 1/cp of every sequence (a front and a
    /// back chunk) and attends over a ring (GPT and Llama; the sequence length must be a
    /// multiple of 2 x cp; no dropout).
    #[arg(help_heading = "Parallelism", long, default_value_t = 1, value_parser = positive)]
    // 1 in files written before it existed.
    #[serde(default = "one")]
    pub cp: usize,
    /// Expert-parallel ranks, carved from the --dp replicas: groups of ep replicas each hold
    /// 1/ep of every mixture's experts and send each other the tokens routed to them
    /// (with --n-experts; a divisor of --dp and of --n-experts; no ranks added).
    #[arg(help_heading = "Parallelism", long, default_value_t = 1, value_parser = positive)]
    // 1 in files written before it existed.
    #[serde(default = "one")]
    pub ep: usize,
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pp={} tp={} ", self.pp, self.tp)?;
        if self.cp > 1 {
            write!(f, "cp={} ", self.cp)?;
        }
        write!(f, "dp={}", self.dp)?;
        if self.ep > 1 {
            write!(f, " ep={}", self.ep)?;
        }
        Ok(())
    }
}

/// The most ranks a layout may have (2^20): more than any cluster trains on, and small enough
/// that the tables a rank keeps of the world (a few words a rank) stay small.
pub const MAX_WORLD: usize = 1 << 20;

impl Layout {
    /// A layout of `pp x tp x dp` ranks (no context parallelism); every size at least 1, the
    /// world at most [`MAX_WORLD`].
    pub fn new(pp: usize, tp: usize, dp: usize) -> Result<Self> {
        if pp == 0 || tp == 0 || dp == 0 {
            return Err(invalid!(
                "layout pp={pp} tp={tp} dp={dp}: every degree must be at least 1"
            ));
        }
        Self {
            pp,
            tp,
            dp,
            cp: 1,
            ep: 1,
        }
        .checked()
    }

    /// The same layout with each replica's sequences split over `cp` context-parallel ranks.
    pub fn with_cp(self, cp: usize) -> Result<Self> {
        if cp == 0 {
            return Err(invalid!("layout {self}: cp must be at least 1"));
        }
        Self { cp, ..self }.checked()
    }

    /// The same layout with each mixture's experts split over groups of `ep` data-parallel
    /// replicas (torchtitan's and Megatron's expert parallelism, carved from the data-parallel
    /// ranks): `ep` must divide `dp`.
    pub fn with_ep(self, ep: usize) -> Result<Self> {
        if ep == 0 || !self.dp.is_multiple_of(ep) {
            return Err(invalid!(
                "layout {self}: --ep {ep} must divide the {} data-parallel replicas (expert \
                 parallelism splits groups of them); choose a divisor of dp",
                self.dp
            ));
        }
        Ok(Self { ep, ..self })
    }

    /// The expert-parallel rank of a rank at `c`: which part of each mixture's experts it holds.
    pub fn ep_rank(&self, c: Coords) -> usize {
        c.dp_rank % self.ep
    }

    /// `self` if its world is at most [`MAX_WORLD`] ranks.
    fn checked(self) -> Result<Self> {
        let world = [self.pp, self.tp, self.cp, self.dp]
            .into_iter()
            .try_fold(1usize, |w, d| w.checked_mul(d));
        match world {
            Some(w) if w <= MAX_WORLD => Ok(self),
            _ => Err(invalid!(
                "layout pp={} tp={} cp={} dp={}: {} ranks is more than the {MAX_WORLD} a layout \
                 may have: choose smaller degrees",
                self.pp,
                self.tp,
                self.cp,
                self.dp,
                world.map_or("more than 2^64".to_string(), |w| w.to_string())
            )),
        }
    }

    /// This layout if its degrees can run together (each at least 1, no more ranks than a
    /// layout may have, ep dividing dp), as [`Layout::new`], [`Layout::with_cp`] and
    /// [`Layout::with_ep`] check them: what a layout read from flags or a file goes through.
    pub fn validated(self) -> Result<Self> {
        Self::new(self.pp, self.tp, self.dp)?
            .with_cp(self.cp)?
            .with_ep(self.ep)
    }

    /// One rank does everything.
    pub fn serial() -> Self {
        Self {
            pp: 1,
            tp: 1,
            dp: 1,
            cp: 1,
            ep: 1,
        }
    }

    /// The layout with `pp` stages and `tp`-way shards that fills `world` ranks (dp derived).
    pub fn for_world(world: usize, pp: usize, tp: usize) -> Result<Self> {
        if pp == 0 || tp == 0 || world == 0 || !world.is_multiple_of(pp * tp) {
            return Err(invalid!(
                "a world of {world} ranks cannot be split into pp={pp} x tp={tp} groups: \
                 the world size must be a multiple of pp*tp"
            ));
        }
        Self::new(pp, tp, world / (pp * tp))
    }

    /// Ranks of the layout, `pp * tp * cp * dp`.
    pub fn world(&self) -> usize {
        // Saturating: a layout read from flags is counted before it is checked, and absurd
        // degrees are refused by that check, not wrapped.
        [self.pp, self.tp, self.cp, self.dp]
            .iter()
            .fold(1usize, |w, d| w.saturating_mul(*d))
    }

    /// Ranks that hold the same weights and sum their gradients, losses and target counts:
    /// the data- and context-parallel ranks together ([`Axis::Replica`]).
    pub fn replicas(&self) -> usize {
        self.dp * self.cp
    }

    /// Micro-batches of `micro_batch` rows each data-parallel replica splits a global batch
    /// of `global_batch` rows into; an error that says what to choose when it does not split
    /// evenly.
    pub fn micro_batches(&self, global_batch: usize, micro_batch: usize) -> Result<usize> {
        let per = self.dp * micro_batch;
        if per == 0 || global_batch == 0 || !global_batch.is_multiple_of(per) {
            return Err(invalid!(
                "a global batch of {global_batch} rows does not split into {} data-parallel \
                 replicas of micro-batches of {micro_batch} rows: choose a batch that is a \
                 positive multiple of {per}",
                self.dp
            ));
        }
        Ok(global_batch / per)
    }

    /// What a sequence length must be a multiple of to split over the context-parallel ring
    /// (two chunks a rank) and, with Megatron's sequence parallelism, each rank's part over the
    /// tensor-parallel ranks.
    pub fn sequence_multiple(&self, sequence_parallel: bool) -> usize {
        let ring = if self.cp > 1 { 2 * self.cp } else { 1 };
        let split = if sequence_parallel {
            self.cp * self.tp
        } else {
            1
        };
        let gcd = |mut a: usize, mut b: usize| {
            while b != 0 {
                (a, b) = (b, a % b);
            }
            a
        };
        ring / gcd(ring, split) * split
    }

    /// Checks that the layout fills exactly `world` ranks.
    pub fn check_world(&self, world: usize) -> Result<()> {
        if self.world() != world {
            return Err(invalid!(
                "layout {self} needs {} ranks but the world has {world}: make pp*tp*cp*dp equal the number of ranks",
                self.world()
            ));
        }
        Ok(())
    }

    /// Coordinates of layout index `i`.
    pub fn coords(&self, i: usize) -> Result<Coords> {
        if i >= self.world() {
            return Err(invalid!(
                "rank {i} is outside layout {self} of {} ranks",
                self.world()
            ));
        }
        Ok(Coords {
            stage: i / (self.dp * self.cp * self.tp),
            dp_rank: (i / (self.cp * self.tp)) % self.dp,
            cp_rank: (i / self.tp) % self.cp,
            tp_rank: i % self.tp,
        })
    }

    /// Layout index of `c`.
    pub fn index(&self, c: Coords) -> Result<usize> {
        if c.stage >= self.pp
            || c.tp_rank >= self.tp
            || c.dp_rank >= self.dp
            || c.cp_rank >= self.cp
        {
            return Err(invalid!("coordinates {c:?} are outside layout {self}"));
        }
        Ok(c.stage * self.dp * self.cp * self.tp
            + c.dp_rank * self.cp * self.tp
            + c.cp_rank * self.tp
            + c.tp_rank)
    }

    /// Layout indices of the `axis` group that holds index `i`, in order along the axis
    /// ([`Axis::Replica`]: data-parallel rank slowest, context-parallel rank fastest).
    pub fn group(&self, i: usize, axis: Axis) -> Result<Vec<usize>> {
        let c = self.coords(i)?;
        // The members along the axis: how many, and the coordinates of member `k`.
        type Member = fn(Coords, usize, &Layout) -> Coords;
        let (n, set): (usize, Member) = match axis {
            Axis::Pipeline => (self.pp, |c, k, _| Coords { stage: k, ..c }),
            Axis::Tensor => (self.tp, |c, k, _| Coords { tp_rank: k, ..c }),
            Axis::Data => (self.dp, |c, k, _| Coords { dp_rank: k, ..c }),
            Axis::Context => (self.cp, |c, k, _| Coords { cp_rank: k, ..c }),
            Axis::Replica => (self.cp * self.dp, |c, k, l| Coords {
                dp_rank: k / l.cp,
                cp_rank: k % l.cp,
                ..c
            }),
            Axis::Expert => (self.ep, |c, k, l| Coords {
                dp_rank: c.dp_rank / l.ep * l.ep + k,
                ..c
            }),
            Axis::ExpertReplica => (self.cp * self.dp / self.ep, |c, k, l| Coords {
                dp_rank: k / l.cp * l.ep + c.dp_rank % l.ep,
                cp_rank: k % l.cp,
                ..c
            }),
        };
        (0..n).map(|k| self.index(set(c, k, self))).collect()
    }

    /// Every `axis` group, each in order along the axis, groups ordered by their first index.
    pub fn groups(&self, axis: Axis) -> Vec<Vec<usize>> {
        let mut out: Vec<Vec<usize>> = Vec::new();
        for i in 0..self.world() {
            let g = self.group(i, axis).expect("index inside the layout");
            if g[0] == i {
                out.push(g);
            }
        }
        out
    }
}
