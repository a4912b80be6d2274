//! A training run's result as `summary.json` records it and as the one screen after a run
//! shows it ([`Summary`]'s `Display`): the steps, the loss and metric, where the time went
//! (the median step, rank 0's step part by part, the throughput), the memory, the layout and
//! which rank holds what, each pipeline rank's bubble and each rank's exposed communication.
//! `pipewright train` fills it from its trainer and prints it; a program of its own can too.

use std::fmt;

use serde::Serialize;

use crate::plan::StepParts;

/// `summary.json`: the result, the layout and where the time went.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Summary {
    /// Steps done (the run's last step number).
    pub steps: u64,
    /// The last step's training loss.
    pub final_loss: f64,
    /// The task's metric's name ...
    pub metric_name: &'static str,
    /// ... and its last evaluation.
    pub metric: f64,
    /// Seconds the run took, evaluations and checkpoints included.
    pub seconds: f64,
    /// The median of the steps' own times (evaluation and checkpoints left out).
    pub median_step_seconds: f64,
    /// Tokens or samples trained per second of the steps themselves: evaluations and
    /// checkpoints are left out (with `--eval-every 1` they made the rate look slow).
    pub items_per_second: f64,
    /// What `items_per_second` counts: `tokens` or `samples`.
    pub items: &'static str,
    /// The process's peak resident memory.
    pub peak_memory_bytes: Option<u64>,
    /// The process's peak before its first evaluation: training's own (the task's greedy
    /// decoding can hold more).
    pub training_peak_memory_bytes: Option<u64>,
    /// The most bytes held at once before the first evaluation as the allocator counts them
    /// ([`crate::runtime::memory`]: without what glibc keeps back after a free), or on a GPU
    /// its memory pool's high-water mark ...
    pub training_peak_allocated_bytes: Option<u64>,
    /// ... and each rank's, for ranks running as threads of this process (empty under
    /// mpirun, where each process is one rank and the line above is its own).
    pub rank_training_peak_allocated_bytes: Vec<u64>,
    /// The layout and the precision (`pp=2 tp=1 ... bf16`).
    pub layout: String,
    /// Which rank holds what, a line per rank.
    pub ranks: Vec<String>,
    /// Each pipeline rank's measured bubble: the share of all steps' time it waited.
    pub bubble_per_stage: Vec<f64>,
    /// Each rank's median time waited on data-parallel communication per step, in seconds
    /// (`StepParts::exposed_comm_s`): the communication its steps exposed.
    pub exposed_comm_per_rank: Vec<f64>,
    /// Rank 0's step, part by part: each part's median over the steps that updated.
    pub median_step_parts: StepParts,
    /// Layers per model stage.
    pub balance: Vec<usize>,
    /// The device the run computed on (`cpu`, `cuda:0`), for the screen only: where its
    /// tensors live says which allocated peak the screen shows.
    #[serde(skip)]
    pub device: String,
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

impl Summary {
    /// The memory lines of the screen.
    fn fmt_memory(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(p) = self.peak_memory_bytes {
            writeln!(f, "peak memory     {:.1} MiB", mib(p))?;
        }
        if let Some(p) = self.training_peak_memory_bytes {
            writeln!(
                f,
                "training peak   {:.1} MiB (before the first evaluation)",
                mib(p)
            )?;
        }
        let in_host = crate::runtime::device::in_host_memory(&self.device);
        match (self.training_peak_allocated_bytes, in_host) {
            (Some(p), false) => writeln!(
                f,
                "allocated peak  {:.1} MiB on rank 0's GPU (its memory pool's high-water mark, \
                 before the first evaluation)",
                mib(p)
            ),
            (Some(p), true) => {
                let most = (self.rank_training_peak_allocated_bytes.iter().max())
                    .map_or(String::new(), |r| {
                        format!(", the most of one rank {:.1} MiB", mib(*r))
                    });
                writeln!(
                    f,
                    "allocated peak  {:.1} MiB{most} (live bytes, before the first evaluation)",
                    mib(p)
                )
            }
            (None, false) => writeln!(f, "allocated peak  not counted on {}", self.device),
            (None, true) => Ok(()),
        }
    }

    /// The layout lines of the screen: the balance, the ranks and their bubbles, and the
    /// exposed communication.
    fn fmt_layout(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "layout          {}", self.layout)?;
        let b: Vec<String> = self.balance.iter().map(|n| n.to_string()).collect();
        writeln!(
            f,
            "balance         {} (layers per model stage)",
            b.join(",")
        )?;
        if self.ranks.len() > 1 {
            for r in &self.ranks {
                writeln!(f, "  {r}")?;
            }
            let b: Vec<String> = (self.bubble_per_stage.iter().enumerate())
                .map(|(s, b)| format!("rank {s} {:.0}%", b * 100.0))
                .collect();
            writeln!(
                f,
                "bubble          {} (share of all steps' time each pipeline rank waited)",
                b.join(", ")
            )?;
        }
        if self.exposed_comm_per_rank.iter().any(|e| *e > 0.0) {
            let e: Vec<String> = (self.exposed_comm_per_rank.iter().enumerate())
                .map(|(r, e)| format!("rank {r} {:.1} ms", e * 1e3))
                .collect();
            writeln!(
                f,
                "exposed comm    {} (median step's wait on data-parallel communication)",
                e.join(", ")
            )?;
        }
        Ok(())
    }
}

impl fmt::Display for Summary {
    /// The one-screen summary, a line each (the last ends with a newline).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "steps           {}", self.steps)?;
        writeln!(f, "final loss      {:.6}", self.final_loss)?;
        writeln!(f, "{:<15} {:.4}", self.metric_name, self.metric)?;
        writeln!(f, "time            {:.1} s", self.seconds)?;
        writeln!(
            f,
            "step time       {:.1} ms (median)",
            self.median_step_seconds * 1e3
        )?;
        writeln!(
            f,
            "step parts      {} (rank 0, each part's median)",
            self.median_step_parts
        )?;
        writeln!(
            f,
            "throughput      {:.0} {}/s",
            self.items_per_second, self.items
        )?;
        self.fmt_memory(f)?;
        self.fmt_layout(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_screen_names_each_rank_only_when_there_are_several() {
        let mut s = Summary {
            steps: 3,
            metric_name: "accuracy",
            items: "tokens",
            layout: "pp=1 tp=1 cp=1 dp=1 f32".into(),
            balance: vec![4],
            ranks: vec!["rank 0: all".into()],
            device: "cpu".into(),
            ..Summary::default()
        };
        let one = s.to_string();
        assert!(one.contains("balance         4 (layers"), "{one}");
        assert!(!one.contains("bubble"), "{one}");
        s.ranks.push("rank 1: the rest".into());
        s.bubble_per_stage = vec![0.25, 0.5];
        s.exposed_comm_per_rank = vec![0.002, 0.0];
        let two = s.to_string();
        assert!(
            two.contains("bubble          rank 0 25%, rank 1 50%"),
            "{two}"
        );
        assert!(
            two.contains("exposed comm    rank 0 2.0 ms, rank 1 0.0 ms"),
            "{two}"
        );
        // Nothing counted on a GPU says so; nothing counted on the CPU says nothing.
        assert!(!two.contains("allocated peak"), "{two}");
        s.device = "cuda:0".into();
        assert!(s
            .to_string()
            .contains("allocated peak  not counted on cuda:0"));
    }

    #[test]
    fn the_json_keeps_its_keys_and_leaves_the_screen_only_fields_out() {
        let v = serde_json::to_value(Summary::default()).unwrap();
        for key in [
            "steps",
            "final_loss",
            "median_step_parts",
            "exposed_comm_per_rank",
        ] {
            assert!(v.get(key).is_some(), "{key}");
        }
        assert!(v.get("device").is_none());
    }
}
