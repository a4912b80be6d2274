//! `pipewright plan`: AutoConfig. Every pp x tp x cp x dp layout of `--world` ranks, with every
//! micro-batch size, schedule and recompute mode, predicted from a profile (`--profile`, made
//! by `pipewright profile`) or from the model's shapes (the model flags of `train`) on a
//! hardware description, kept when each rank fits in `--memory`, ranked by predicted step
//! time. `--measure` trains the top candidates here for a few steps and prints what they took
//! beside the prediction.

use std::path::{Path, PathBuf};

use clap::Args;
use pipewright::plan::{
    format_bytes, format_flops, parse_bytes, rank_specs, search, Cluster, Estimate, Hardware, Link,
    Profile, Ranking, Request,
};
use pipewright::ModelSpec;
use pipewright::{invalid, Result};
use pipewright_models::measured::Measure;

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

/// Trains (or with `--measured` reads) each of `best` here `--repeats` times and prints what
/// each took beside its prediction ([`Measure`]).
fn measure(p: &PlanArgs, hw: &Hardware, best: &[Estimate]) -> Result<()> {
    let m = Measure {
        program: std::env::current_exe().map_err(|e| invalid!("cannot find this program: {e}"))?,
        root: (p.train.output.out.clone()).unwrap_or_else(|| "output/plan".into()),
        repeats: p.repeats,
        reuse: p.measured,
    };
    let report = m.run(&p.train, (best, p.world), hw.runtime_bytes() as f64)?;
    pipewright::say!("{report}");
    Ok(())
}
