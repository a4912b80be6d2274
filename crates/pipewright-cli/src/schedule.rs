//! `pipewright schedule`: a schedule's action lists as a timeline. Under unit costs (forward
//! 1, backward 2, its input and weight halves 1 each) by default; with `--profile`, the
//! planner's prediction in real seconds (every stage's own durations, the links' delays,
//! ranks sharing a CPU), and with `--trace` a measured step drawn beneath it (without
//! `--profile`, beneath its own schedule simulated with the costs the step measured).

use pipewright::parallel::dims::ParallelSpec;
use std::path::{Path, PathBuf};

use clap::Args;
use pipewright::distributed::topology::Layout;
use pipewright::parallel::pipeline::schedule::{Schedule, ScheduleKind};
use pipewright::parallel::pipeline::timeline::{svg_panels, svg_panels_wide};
use pipewright::parallel::pipeline::{read_chrome_trace, replay_chrome_trace};
use pipewright::parallel::pipeline::{Sharing, Simulation};
use pipewright::plan::{estimate, format_bytes, Candidate, Cluster, Profile};
use pipewright::{invalid, Error, Result};

#[derive(Args)]
pub struct ScheduleArgs {
    /// gpipe, 1f1b, interleaved, zb1, zbv or dualpipev.
    #[arg(long, default_value = "1f1b")]
    pub schedule: String,
    /// Check and draw this schedule written as data (one rank's actions per line, as --save
    /// writes it) in place of --schedule; its ranks and micro-batches are its own.
    #[arg(long, value_name = "FILE")]
    pub schedule_file: Option<PathBuf>,
    /// Write the schedule as data to FILE (to edit, then train with `--schedule-file`).
    #[arg(long, value_name = "FILE")]
    pub save: Option<PathBuf>,
    /// Pipeline stages.
    #[arg(long, default_value_t = 4)]
    pub pp: usize,
    /// Micro-batches per batch.
    #[arg(long, default_value_t = 8)]
    pub chunks: usize,
    /// Model chunks per stage (interleaved).
    #[arg(long, default_value_t = 1)]
    pub r#virtual: usize,
    /// Also draw the timeline into this SVG file.
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Predict the timeline in seconds from this profile (`pipewright profile`).
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// With --profile: rows per micro-batch.
    #[arg(long, default_value_t = 1)]
    pub mbs: usize,
    /// With --profile: tensor-parallel size of the layout.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// With --profile: data-parallel size of the layout.
    #[arg(long, default_value_t = 1)]
    pub dp: usize,
    /// With --profile: activation recomputation (always, except_last, never).
    #[arg(long, default_value = "never")]
    pub recompute: String,
    /// With --profile: a hardware file or a built-in one (cpu-2core, h100-node, h200-node,
    /// a100-node).
    #[arg(long, default_value = "cpu-2core")]
    pub hardware: String,
    /// With --profile: the link between ranks of a node as measured here (`pipewright bench comm --out FILE`),
    /// in place of the hardware file's.
    #[arg(long)]
    pub link: Option<PathBuf>,
    /// With --profile: nodes the ranks are spread over.
    #[arg(long, default_value_t = 1)]
    pub nodes: usize,
    /// Draw this measured step (a `pipewright train --trace` file, its last step) under the
    /// prediction; without --profile, under its schedule simulated with the step's own costs
    /// (the idle shares of both printed).
    #[arg(long)]
    pub trace: Option<PathBuf>,
}

/// The timeline under the planner's costs, with its title.
fn predicted(a: &ScheduleArgs, kind: ScheduleKind) -> Result<(String, Simulation)> {
    let path = a.profile.as_ref().expect("asked with --profile");
    let profile = Profile::load(path)?;
    let hw = crate::plan::hardware(&a.hardware, a.link.as_deref())?;
    let cluster = Cluster::new(&hw, a.pp * a.tp * a.dp, Some(a.nodes))?;
    let cand = Candidate {
        parallel: ParallelSpec::new(Layout::new(a.pp, a.tp, a.dp)?),
        micro_batch: a.mbs,
        micro_batches: a.chunks,
        schedule: pipewright::parallel::pipeline::ScheduleChoice {
            kind,
            virtual_stages: a.r#virtual,
            recompute: a.recompute.parse()?,
        },
    };
    let (e, sim) = estimate(&profile, &cluster, &cand)?;
    pipewright::say!(
        "predicted step {:.2} ms (pipeline {:.2} ms), balance {:?}",
        e.step_s * 1e3,
        sim.makespan * 1e3,
        e.balance
    );
    for (r, (idle, peak)) in sim.idle_per_stage().iter().zip(&e.peak_bytes).enumerate() {
        pipewright::say!(
            "  stage {r}: idle {:.1} %, peak memory {}",
            idle * 100.0,
            format_bytes(*peak)
        );
    }
    let title = format!(
        "predicted: {kind} pp={} tp={} dp={} chunks={} x {} rows",
        a.pp, a.tp, a.dp, a.chunks, a.mbs
    );
    Ok((title, sim))
}

/// The last step of the trace at `path`, with its idle share; with `simulate`, also its
/// schedule simulated under the step's own measured costs (the panel drawn above it).
fn measured(path: &Path, simulate: bool) -> Result<Vec<(String, Simulation)>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io("cannot read", path, e))?;
    // Ranks as threads of this machine take turns on its cores.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let sharing = Sharing {
        slots: cores as f64,
        ..Sharing::ALONE
    };
    let replay = replay_chrome_trace(&text, None, sharing)?;
    pipewright::say!(
        "measured step (last in the trace): pipeline {:.2} ms, idle {:.1} % (between actions \
         and waiting inside them)",
        replay.measured_makespan * 1e3,
        replay.measured_idle * 100.0
    );
    let mut panels = Vec::new();
    if simulate {
        let sim = replay.simulated;
        pipewright::say!(
            "its schedule simulated with the step's own costs (each stage's median forward, \
             backward, input and weight pass; the ranks sharing {cores} cores): {:.2} ms, idle \
             {:.1} %",
            sim.makespan * 1e3,
            sim.bubble * 100.0
        );
        panels.push(("simulated with the measured costs".to_string(), sim));
    }
    panels.push((
        format!("measured: {}", path.display()),
        read_chrome_trace(&text, None)?,
    ));
    Ok(panels)
}

pub fn run(a: ScheduleArgs) -> Result<()> {
    if let Some(svg) = &a.svg {
        let drawn = pipewright::parallel::pipeline::timeline::is_timeline_svg;
        pipewright::runtime::files::ensure_replaceable(svg, "--svg", "a drawn schedule", drawn)?;
    }
    if let Some(path) = &a.save {
        let ours = |text: &str| Schedule::from_csv(text).is_ok();
        pipewright::runtime::files::ensure_replaceable(path, "--save", "a saved schedule", ours)?;
    }
    let kind: ScheduleKind = a.schedule.parse()?;
    let (s, title) = match &a.schedule_file {
        Some(path) => {
            let s = Schedule::load(path)?;
            let title = format!(
                "{} ({} ranks, {} stages, {} chunks)",
                path.display(),
                s.ranks,
                s.stages,
                s.micro_batches
            );
            (s, title)
        }
        None => {
            let title = format!(
                "{kind} pp={} chunks={} virtual={}",
                a.pp, a.chunks, a.r#virtual
            );
            (Schedule::new(kind, a.pp, a.chunks, a.r#virtual)?, title)
        }
    };
    let sim = s.validate()?;
    // A trace drawn alone is the measured step's schedule: the flags' built one (checked
    // all the same) is not said, as if it were the trace's.
    let alone = a.trace.is_some() && a.profile.is_none() && a.save.is_none();
    if !alone || a.schedule_file.is_some() {
        pipewright::say!("{title}: complete and deadlock-free");
    }
    if a.profile.is_some() && a.schedule_file.is_some() {
        return Err(invalid!(
            "--profile predicts a built schedule (--schedule): drop --schedule-file, or \
             --profile to draw the file's under unit costs"
        ));
    }
    if let Some(path) = &a.save {
        s.save(path)?;
        pipewright::say!("saved {}", path.display());
    }
    let mut panels = vec![(title, sim)];
    if a.profile.is_some() {
        panels = vec![predicted(&a, kind)?];
    } else if a.trace.is_none() {
        let sim = &panels[0].1;
        pipewright::runtime::console::say_text(&sim.timeline());
        pipewright::say!(
            "time {} units, bubble {:.1} %, micro-batch stages held per rank {:?}",
            sim.makespan,
            sim.bubble * 100.0,
            sim.peak_in_flight
        );
    }
    if let Some(path) = &a.trace {
        let measured = measured(path, a.profile.is_none())?;
        if a.profile.is_none() {
            panels.clear();
        }
        panels.extend(measured);
    }
    if let Some(path) = &a.svg {
        // Unit costs: 28 pixels a unit; seconds: the longest timeline 1000 pixels wide.
        let refs: Vec<(&str, &Simulation)> = panels.iter().map(|(t, s)| (t.as_str(), s)).collect();
        let svg = if a.profile.is_some() || a.trace.is_some() {
            svg_panels_wide(&refs, 1000.0)
        } else {
            svg_panels(&refs, 28.0)
        };
        std::fs::write(path, svg).map_err(|e| Error::io("cannot write", path, e))?;
        pipewright::say!("drew {}", path.display());
    }
    Ok(())
}
