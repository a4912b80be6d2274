//! [`Varuna::describe`]: which rank holds what, one line per rank, for the run's summary.

use super::Varuna;
use crate::Result;

impl Varuna {
    /// Runs [`Varuna::predict`] over at most `rows` rows at a time (every rank of the run
    /// sets the same): a held-out set of thousands of rows at once made gigabytes of
    /// activations with a wide model. Fewer forwards are faster, so a caller gives the most
    /// that fit ([`crate::runtime::memory::available_bytes`]).
    pub fn set_eval_rows(&mut self, rows: usize) {
        self.eval_rows = Some(rows.max(1));
    }

    /// One line per rank of the world: its stage, the layers it holds, its shard and replica
    /// (and under expert parallelism which part of the experts it holds).
    pub fn describe(&self) -> Result<Vec<String>> {
        let l = self.topo.layout();
        let ranges = self.pipeline.ranges();
        let schedule = self.pipeline.schedule();
        (0..self.topo.world())
            .map(|r| {
                let c = self.topo.coords(r)?;
                let layers: Vec<String> = schedule
                    .stages_of(c.stage)
                    .into_iter()
                    .map(|k| {
                        let rg = &ranges[k];
                        format!("{}..{}", rg.start, rg.end)
                    })
                    .collect();
                let ring = if l.cp > 1 {
                    format!(", cp slice {}/{}", c.cp_rank, l.cp)
                } else {
                    String::new()
                };
                let experts = if l.ep > 1 {
                    format!(", experts part {}/{}", l.ep_rank(c), l.ep)
                } else {
                    String::new()
                };
                Ok(format!(
                    "rank {r}: stage {} (layers {}), tp shard {}/{}{ring}, dp replica {}/{}{experts}",
                    c.stage,
                    layers.join(" + "),
                    c.tp_rank,
                    l.tp,
                    c.dp_rank,
                    l.dp
                ))
            })
            .collect()
    }
}
