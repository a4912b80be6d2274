//! `pipewright plan`: AutoConfig. Every pp x tp x cp x dp layout of `--world` ranks, with every
//! micro-batch size, schedule and recompute mode, predicted from a profile (`--profile`, made
//! by `pipewright profile`) or from the model's shapes (the model flags of `train`) on a
//! hardware description, kept when each rank fits in `--memory`, ranked by predicted step
//! time. `--measure` trains the top candidates here for a few steps and prints what they took
//! beside the prediction.

use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Args;
use pipewright::plan::{
    format_bytes, format_flops, format_seconds, parse_bytes, rank_specs, search, Cluster, Estimate,
    Hardware, Link, Profile, Ranking, Request, StepParts,
};
use pipewright::ModelSpec;
use pipewright::{invalid, Error, Result};

use crate::train::TrainArgs;

#[derive(Args)]
pub struct PlanArgs {
    /// The model (and, for `--measure`, the run) as `train` takes them; `--batch-size` is the
    /// global batch, `--precision` what it computes in.
    #[command(flatten)]
    pub train: TrainArgs,
    /// Ranks (devices) of the job.
    #[arg(long, value_parser = crate::train::positive)]
    pub world: usize,
    /// Memory per device, with a unit (4GiB, 512MiB; default: the hardware's).
    #[arg(long)]
    pub memory: Option<String>,
    /// A profile written by `pipewright profile` (default: the model's shapes on --hardware).
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// The link between ranks of a node as measured here (`pipewright bench comm --out FILE`),
    /// in place of the hardware file's.
    #[arg(long)]
    pub link: Option<PathBuf>,
    /// Nodes the ranks are spread over (default: as many as the devices need; with --measure,
    /// one: the measured runs' ranks share this machine).
    #[arg(long, value_parser = crate::train::positive)]
    pub nodes: Option<usize>,
    /// How many of the best layouts to print.
    #[arg(long, default_value_t = 5, value_parser = crate::train::positive)]
    pub top: usize,
    /// Train each printed layout here for --steps steps (threads) and add what it took.
    #[arg(long)]
    pub measure: bool,
    /// Print where the first layout's step goes: the schedule's compute, memory-bound work
    /// and collectives by kind, the bubble, and after it the data-parallel communication
    /// exposed and hidden, the scalars and the optimizer (pin a layout with --candidate).
    #[arg(long)]
    pub explain: bool,
    /// With --measure: train each layout this many times, the layouts in turn, and print the
    /// medians (a busy machine's spells then fall on every layout alike).
    #[arg(long, default_value_t = 1, value_parser = crate::train::positive)]
    pub repeats: usize,
    /// With --measure: read the runs an earlier `--measure` left in --out instead of training
    /// again, and set this plan's predictions beside them: a change to the planner judged
    /// against the same measurements (on a machine whose speed moves, two sets of runs differ
    /// by more than two planners do). Each run must have trained its candidate as planned.
    #[arg(long, requires = "measure")]
    pub measured: bool,
    /// Predict only these layouts instead of searching, each written as
    /// `pp=2,tp=1,dp=2,mbs=8,schedule=1f1b,recompute=never,zero=1` (`cp=2`, `ep=2`, `sp=1`
    /// too; spaces between the parts as the table prints a layout; repeat the flag for more).
    #[arg(long)]
    pub candidate: Vec<String>,
}

/// The profile the flags ask for.
fn profile(p: &PlanArgs, hw: &Hardware) -> Result<Profile> {
    if let Some(path) = &p.profile {
        return Profile::load(path);
    }
    let a = &p.train;
    let (model, _, task) = a.model_and_task()?;
    model
        .shapes_profile(&task.shape().sample(), a.precision, hw)?
        .ok_or_else(|| invalid!("{} has no shapes to plan from", model.what()))
}

/// The hardware file `name`, with the measured link of `link` (if any) between a node's
/// ranks.
pub fn hardware(name: &str, link: Option<&Path>) -> Result<Hardware> {
    let mut hw = Hardware::load(name)?;
    if let Some(path) = link {
        hw.intra_node = Link::load(path)?;
    }
    Ok(hw)
}

pub fn run(p: PlanArgs) -> Result<()> {
    if p.train.output.out.is_some() && !p.measure {
        return Err(invalid!(
            "--out is where --measure keeps its runs: plan alone writes nothing; add --measure, \
             or drop --out"
        ));
    }
    let hw = hardware(&p.train.parallel.hardware, p.link.as_deref())?;
    let memory = match &p.memory {
        Some(m) => parse_bytes(m)?,
        None => hw.memory_bytes(),
    };
    // Measured runs train here: their ranks share this machine's cores.
    let cluster = Cluster::new(&hw, p.world, p.nodes.or(p.measure.then_some(1)))?;
    let nodes = p.world / cluster.ranks_per_node;
    let profile = profile(&p, &hw)?;
    let req = Request {
        world: p.world,
        memory_bytes: memory as f64,
        global_batch: p.train.batch.batch_size,
        top: if p.candidate.is_empty() {
            p.top
        } else {
            p.candidate.len()
        },
    };
    if p.profile.is_some() && profile.threads != cluster.threads_per_rank() {
        eprintln!(
            "warning: the profile was timed with {} CPU threads, the ranks will have {}: times \
             are scaled as if linear in threads; for better predictions profile with \
             RAYON_NUM_THREADS={}",
            profile.threads,
            cluster.threads_per_rank(),
            cluster.threads_per_rank()
        );
    }
    let (best, refused) = match p.candidate.is_empty() {
        true => (search(&profile, &cluster, &req)?, Vec::new()),
        false => rank_specs(&profile, &cluster, &req, &p.candidate)?,
    };
    pipewright::say!(
        "plan for {} ranks on {nodes} node(s) of {}, {} per device; profile: {}",
        p.world,
        hw.name,
        format_bytes(memory as f64),
        profile.source
    );
    let half = profile.dtype_bytes == 2;
    pipewright::say!(
        "mfu: the model's FLOPs per step over {} peak FLOP/s per device ({}); bound: what \
         most of the step waits on (compute, memory, comm, bubble)",
        format_flops(hw.peak_flops(half)),
        if half { "bf16/f16" } else { "f32" }
    );
    let ranking = Ranking {
        best: &best,
        refused: &refused,
    };
    pipewright::say!("{ranking}");
    if let (true, Some(explained)) = (p.explain, ranking.explain()) {
        pipewright::say!("{explained}");
    }
    if p.measure {
        measure(&p, &hw, &best)?;
    }
    Ok(())
}

/// What one training run of a candidate measured: its median step (seconds), the process's
/// resident training peak and the largest rank's allocated peak (bytes), and rank 0's step
/// part by part.
struct Measured {
    step: f64,
    peak: f64,
    rank: f64,
    parts: StepParts,
}

/// The flags of `train` for the candidate `e`, its run in `dir`, evaluated once at its end.
fn train_args(p: &PlanArgs, e: &Estimate, dir: &Path) -> TrainArgs {
    let mut a = p.train.for_candidate(&e.candidate, &e.balance);
    a.output.eval_every = a.batch.steps;
    a.output.out = Some(dir.to_path_buf());
    a
}

/// Trains `a` here into `dir`.
fn train(a: &TrainArgs, dir: &Path) -> Result<()> {
    let exe = std::env::current_exe().map_err(|e| invalid!("cannot find this program: {e}"))?;
    let out = Command::new(&exe)
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

/// Trains each of `best` here `--repeats` times (the candidates in turn, so that a slow spell
/// of the machine falls on all of them; with `--measured`, reads those runs) and prints the
/// medians of its measured step and peak memory beside the prediction: the process's resident
/// peak, and the most live bytes of one rank as the allocator counts them (the planner's own
/// quantity: what the rank holds, without what the allocator keeps back after a free).
fn measure(p: &PlanArgs, hw: &Hardware, best: &[Estimate]) -> Result<()> {
    let root = p
        .train
        .output
        .out
        .clone()
        .unwrap_or_else(|| "output/plan".into());
    let mut runs: Vec<Vec<Measured>> = best.iter().map(|_| Vec::new()).collect();
    for r in 0..p.repeats {
        for (i, e) in best.iter().enumerate() {
            let mut name = format!("candidate-{}", i + 1);
            if p.repeats > 1 {
                name += &format!("-run-{}", r + 1);
            }
            let dir = root.join(name);
            let a = train_args(p, e, &dir);
            if p.measured {
                same_run(&a, &dir)?;
            } else {
                train(&a, &dir)?;
            }
            runs[i].push(read_measured(&dir)?);
        }
    }
    pipewright::say!(
        "{:<4} {:>11} {:>11} {:>7} {:>11} {:>11} {:>7} {:>11} {:>11} {:>7}",
        "rank",
        "predicted",
        "measured",
        "error",
        "pred. peak",
        "meas. peak",
        "error",
        "pred. rank",
        "meas. rank",
        "error"
    );
    for (i, (e, m)) in best.iter().zip(&runs).enumerate() {
        let median = |f: fn(&Measured) -> f64| pipewright::plan::median(m.iter().map(f).collect());
        let (step, peak, rank) = (median(|m| m.step), median(|m| m.peak), median(|m| m.rank));
        // Threads share one process: its peak holds every rank, the runtime once.
        let predicted_peak = predicted_process_peak(e, p.world, hw.runtime_bytes() as f64);
        let predicted_rank = e.max_peak_bytes() - hw.runtime_bytes() as f64;
        pipewright::say!(
            "{:<4} {:>11} {:>11} {:>+6.1}% {:>11} {:>11} {:>+6.1}% {:>11} {:>11} {:>+6.1}%",
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
        );
    }
    // Each part of rank 0's step: the prediction's and the measured medians, to see which
    // part a miss is in.
    for (i, (e, m)) in best.iter().zip(&runs).enumerate() {
        let parts: Vec<StepParts> = m.iter().map(|m| m.parts).collect();
        pipewright::say!("{:<4} predicted {}", i + 1, e.parts);
        pipewright::say!("{:<4} measured  {}", "", StepParts::median_of(&parts));
    }
    Ok(())
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
