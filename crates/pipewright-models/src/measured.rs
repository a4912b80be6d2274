//! `plan --measure`: the planner's candidates trained here, each by `pipewright train` (a
//! process of its own, so that each run's peak memory is its own), and what each took set
//! beside what was predicted, step and memory, part by part. The runs' directories stay, so a
//! later plan can be judged against the same runs ([`Measure::reuse`]).

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;

use pipewright::plan::{format_bytes, format_seconds, median, Estimate, StepParts};
use pipewright::{invalid, Error, Result};

use crate::TrainArgs;

/// What one training run of a candidate measured: its median step (seconds), the process's
/// resident training peak and the largest rank's allocated peak (bytes), and rank 0's step
/// part by part.
#[derive(Clone, Copy, Debug)]
pub struct Measured {
    /// The median step, in seconds.
    pub step: f64,
    /// The process's resident training peak, in bytes.
    pub peak: f64,
    /// The largest rank's allocated training peak, in bytes.
    pub rank: f64,
    /// Rank 0's median step, part by part.
    pub parts: StepParts,
}

/// How the candidates are measured.
#[derive(Clone, Debug)]
pub struct Measure {
    /// The `pipewright` program that trains (`train` and the run's flags).
    pub program: PathBuf,
    /// Where the runs go: `candidate-N` (`candidate-N-run-R` when repeated).
    pub root: PathBuf,
    /// Runs of each candidate, the candidates in turn (a slow spell of the machine falls on
    /// all of them); the medians are set beside the predictions.
    pub repeats: usize,
    /// Read the runs an earlier measure left in `root` instead of training again (each must
    /// have trained its candidate as planned).
    pub reuse: bool,
}

/// The candidates' predictions beside what their runs measured, for the table.
pub struct MeasureReport<'a> {
    /// The predictions, best first.
    pub best: &'a [Estimate],
    /// Each candidate's runs.
    pub runs: Vec<Vec<Measured>>,
    /// Ranks of each run.
    pub world: usize,
    /// Bytes the runtime holds once per process (the hardware's).
    pub runtime_bytes: f64,
}

impl Measure {
    /// Trains (or reads) each of `best` (candidates of `world` ranks) as `train` with the
    /// candidate's layout (evaluated once, at the end) and reads what each run measured;
    /// `runtime_bytes`: what the runtime holds once per process.
    pub fn run<'a>(
        &self,
        train: &TrainArgs,
        (best, world): (&'a [Estimate], usize),
        runtime_bytes: f64,
    ) -> Result<MeasureReport<'a>> {
        let mut runs: Vec<Vec<Measured>> = best.iter().map(|_| Vec::new()).collect();
        for r in 0..self.repeats {
            for (i, e) in best.iter().enumerate() {
                let mut name = format!("candidate-{}", i + 1);
                if self.repeats > 1 {
                    name += &format!("-run-{}", r + 1);
                }
                let dir = self.root.join(name);
                let mut a = train.for_candidate(&e.candidate, &e.balance);
                a.cadence.eval_every = a.cadence.steps;
                a.output.out = Some(dir.clone());
                if self.reuse {
                    same_run(&a, &dir)?;
                } else {
                    self.train(&a, &dir)?;
                }
                runs[i].push(read_measured(&dir)?);
            }
        }
        Ok(MeasureReport {
            best,
            runs,
            world,
            runtime_bytes,
        })
    }

    /// Trains `a` here into `dir`.
    fn train(&self, a: &TrainArgs, dir: &Path) -> Result<()> {
        let exe = &self.program;
        let out = Command::new(exe)
            .arg("train")
            .args(a.argv()?)
            .output()
            .map_err(|e| invalid!("cannot run {}: {e}", exe.display()))?;
        if !out.status.success() {
            return Err(invalid!(
                "{} did not train: {}",
                dir.display(),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(())
    }
}

/// Checks that the run in `dir` trained with the flags `a` (its directory aside).
fn same_run(a: &TrainArgs, dir: &Path) -> Result<()> {
    let path = dir.join("params.json");
    let text = std::fs::read_to_string(&path).map_err(|err| {
        invalid!(
            "--measured: no run in {} ({err}); measure it first (without --measured)",
            dir.display()
        )
    })?;
    let ran: serde_json::Value = serde_json::from_str(&text).map_err(|err| invalid!("{err}"))?;
    let planned = serde_json::to_value(a).map_err(|err| invalid!("{err}"))?;
    let flags = planned.as_object().into_iter().flatten();
    for (flag, value) in flags.filter(|(flag, _)| *flag != "out") {
        if ran.get(flag) != Some(value) {
            return Err(invalid!(
                "--measured: the run in {} trained with {flag} = {}, this candidate has {value}: \
                 measure it afresh (without --measured)",
                dir.display(),
                ran.get(flag).unwrap_or(&serde_json::Value::Null)
            ));
        }
    }
    Ok(())
}

/// What the finished run in `dir` measured, from its summary.
fn read_measured(dir: &Path) -> Result<Measured> {
    let path = dir.join("summary.json");
    let text =
        std::fs::read_to_string(&path).map_err(|err| Error::io("cannot read", &path, err))?;
    let s: serde_json::Value = serde_json::from_str(&text).map_err(|err| invalid!("{err}"))?;
    let rank = s["rank_training_peak_allocated_bytes"]
        .as_array()
        .and_then(|r| r.iter().filter_map(|b| b.as_f64()).reduce(f64::max));
    Ok(Measured {
        step: s["median_step_seconds"].as_f64().unwrap_or(f64::NAN),
        peak: s["training_peak_memory_bytes"].as_f64().unwrap_or(f64::NAN),
        rank: rank.unwrap_or(f64::NAN),
        parts: serde_json::from_value(s["median_step_parts"].clone()).unwrap_or_default(),
    })
}

/// The predicted peak of one process holding all `world` ranks as threads: every rank's
/// peak, with the runtime counted once.
fn predicted_process_peak(e: &Estimate, world: usize, runtime: f64) -> f64 {
    let per_stage_ranks = (world / e.peak_bytes.len()) as f64;
    let ranks: f64 = e
        .peak_bytes
        .iter()
        .map(|b| (b - runtime) * per_stage_ranks)
        .sum();
    ranks + runtime
}

impl fmt::Display for MeasureReport<'_> {
    /// Each candidate's predicted and measured (median) step, process peak and rank peak
    /// with the errors, then rank 0's step part by part, predicted and measured: the process's
    /// resident peak, and the most live bytes of one rank as the allocator counts them (the
    /// planner's own quantity: what the rank holds, without what the allocator keeps back
    /// after a free).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (p, m, e) = ("predicted", "measured", "error");
        let (pp, mp, pr, mr) = ("pred. peak", "meas. peak", "pred. rank", "meas. rank");
        write!(f, "{:<4} {p:>11} {m:>11} {e:>7} ", "rank")?;
        write!(f, "{pp:>11} {mp:>11} {e:>7} {pr:>11} {mr:>11} {e:>7}")?;
        for (i, (e, m)) in self.best.iter().zip(&self.runs).enumerate() {
            let median = |f: fn(&Measured) -> f64| median(m.iter().map(f).collect());
            let (step, peak, rank) = (median(|m| m.step), median(|m| m.peak), median(|m| m.rank));
            // Threads share one process: its peak holds every rank, the runtime once.
            let predicted_peak = predicted_process_peak(e, self.world, self.runtime_bytes);
            let predicted_rank = e.max_peak_bytes() - self.runtime_bytes;
            write!(
                f,
                "\n{:<4} {:>11} {:>11} {:>+6.1}% {:>11} {:>11} {:>+6.1}% {:>11} {:>11} {:>+6.1}%",
                i + 1,
                format_seconds(e.step_s),
                format_seconds(step),
                (e.step_s / step - 1.0) * 100.0,
                format_bytes(predicted_peak),
                format_bytes(peak),
                (predicted_peak / peak - 1.0) * 100.0,
                format_bytes(predicted_rank),
                format_bytes(rank),
                (predicted_rank / rank - 1.0) * 100.0
            )?;
        }
        // Each part of rank 0's step: the prediction's and the measured medians, to see which
        // part a miss is in.
        for (i, (e, m)) in self.best.iter().zip(&self.runs).enumerate() {
            let parts: Vec<StepParts> = m.iter().map(|m| m.parts).collect();
            write!(f, "\n{:<4} predicted {}", i + 1, e.parts)?;
            write!(f, "\n{:<4} measured  {}", "", StepParts::median_of(&parts))?;
        }
        Ok(())
    }
}
