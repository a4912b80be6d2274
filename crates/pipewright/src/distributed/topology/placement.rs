//! A [`Layout`] placed on world ranks ([`Topology`]): index `i` on rank `i`, or as a launcher
//! says (Varuna's `stage_to_rank_map`), and the groups along each axis as world ranks.

use super::{Axis, Coords, Layout};
use crate::{invalid, Result};

/// A [`Layout`] placed on world ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    layout: Layout,
    /// World rank of each layout index.
    place: Vec<usize>,
    /// Layout index of each world rank.
    index: Vec<usize>,
}

impl Topology {
    /// Layout index `i` on world rank `i`.
    pub fn new(layout: Layout) -> Self {
        let place: Vec<usize> = (0..layout.world()).collect();
        Self {
            layout,
            index: place.clone(),
            place,
        }
    }

    /// Parses Varuna's `stage_to_rank_map`: stages separated by `;`, each the comma-separated
    /// world ranks of that stage (`"0,4;1,5;"`: stage 0 on ranks 0 and 4, stage 1 on 1 and 5).
    /// Within a stage, positions enumerate (dp_rank, tp_rank) with tp_rank fastest, so with
    /// `tp = 1` (Varuna) position `d` is data-parallel replica `d`.
    pub fn from_stage_to_rank_map(map: &str, tp: usize) -> Result<Self> {
        let bad = |why: String| invalid!("stage_to_rank_map `{map}`: {why}");
        if tp == 0 {
            return Err(bad("tp must be at least 1".into()));
        }
        let mut parts: Vec<&str> = map.trim().split(';').map(str::trim).collect();
        if parts.last() == Some(&"") {
            parts.pop();
        }
        if parts.is_empty() {
            return Err(bad("names no stage; write it as `0,4;1,5;`".into()));
        }
        let mut stages: Vec<Vec<usize>> = Vec::new();
        for (s, part) in parts.iter().enumerate() {
            if part.is_empty() {
                return Err(bad(format!("stage {s} has no ranks")));
            }
            let ranks = part
                .split(',')
                .map(|r| {
                    r.trim()
                        .parse::<usize>()
                        .map_err(|_| bad(format!("stage {s}: `{}` is not a rank number", r.trim())))
                })
                .collect::<Result<Vec<_>>>()?;
            stages.push(ranks);
        }
        let per_stage = stages[0].len();
        if let Some((s, r)) = stages
            .iter()
            .enumerate()
            .find(|(_, r)| r.len() != per_stage)
        {
            return Err(bad(format!(
                "stage {s} has {} ranks but stage 0 has {per_stage}: every stage needs the same number of replicas",
                r.len()
            )));
        }
        if !per_stage.is_multiple_of(tp) {
            return Err(bad(format!(
                "{per_stage} ranks per stage do not split into tp={tp} shards"
            )));
        }
        let layout = Layout::new(stages.len(), tp, per_stage / tp)?;
        // Positions within a stage: (dp_rank, tp_rank), tp fastest (cp = 1 here).
        let world = layout.world();
        let place: Vec<usize> = stages.concat();
        let mut index = vec![usize::MAX; world];
        for (i, &r) in place.iter().enumerate() {
            if r >= world {
                return Err(bad(format!(
                    "rank {r} is outside a world of {world} ranks: name each rank 0..{} exactly once",
                    world - 1
                )));
            }
            if index[r] != usize::MAX {
                let first = layout.coords(index[r])?.stage;
                let second = layout.coords(i)?.stage;
                return Err(bad(format!(
                    "rank {r} appears twice (stages {first} and {second})"
                )));
            }
            index[r] = i;
        }
        // `world` distinct ranks below `world`: every rank is present.
        Ok(Self {
            layout,
            place,
            index,
        })
    }

    /// The same placement with each mixture's experts split over groups of `ep` replicas
    /// ([`Layout::with_ep`]).
    pub fn with_ep(mut self, ep: usize) -> Result<Self> {
        self.layout = self.layout.with_ep(ep)?;
        Ok(self)
    }

    /// The placement as a `stage_to_rank_map` string (`"0,4;1,5;"`).
    pub fn stage_to_rank_map(&self) -> String {
        let per = self.layout.dp * self.layout.cp * self.layout.tp;
        self.place
            .chunks(per)
            .map(|c| {
                c.iter()
                    .map(|r| r.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
                    + ";"
            })
            .collect()
    }

    /// The layout.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Ranks of the world.
    pub fn world(&self) -> usize {
        self.layout.world()
    }

    /// Coordinates of world rank `rank`.
    pub fn coords(&self, rank: usize) -> Result<Coords> {
        let i = *self
            .index
            .get(rank)
            .ok_or_else(|| invalid!("rank {rank} is outside a world of {} ranks", self.world()))?;
        self.layout.coords(i)
    }

    /// World rank at `c`.
    pub fn rank(&self, c: Coords) -> Result<usize> {
        Ok(self.place[self.layout.index(c)?])
    }

    /// World ranks of the `axis` group of `rank`, in order along the axis.
    pub fn group(&self, rank: usize, axis: Axis) -> Result<Vec<usize>> {
        self.coords(rank)?;
        Ok(self
            .layout
            .group(self.index[rank], axis)?
            .into_iter()
            .map(|i| self.place[i])
            .collect())
    }

    /// Every `axis` group as world ranks.
    pub fn groups(&self, axis: Axis) -> Vec<Vec<usize>> {
        self.layout
            .groups(axis)
            .into_iter()
            .map(|g| g.into_iter().map(|i| self.place[i]).collect())
            .collect()
    }
}
