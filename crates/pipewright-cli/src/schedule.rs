//! `pipewright schedule`: a schedule's action lists as a timeline, under unit costs
//! (forward 1, backward 2, its input and weight halves 1 each).

use std::path::PathBuf;

use clap::Args;
use pipewright::pipeline::schedule::{Kind, Schedule};
use pipewright::{Error, Result};

#[derive(Args)]
pub struct ScheduleArgs {
    /// gpipe, 1f1b, interleaved or zb1.
    #[arg(long, default_value = "1f1b")]
    pub schedule: String,
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
}

pub fn run(a: ScheduleArgs) -> Result<()> {
    let kind: Kind = a.schedule.parse()?;
    let s = Schedule::new(kind, a.pp, a.chunks, a.r#virtual)?;
    let sim = s.validate()?;
    let title = format!(
        "{kind} pp={} chunks={} virtual={}",
        a.pp, a.chunks, a.r#virtual
    );
    println!("{title}: complete and deadlock-free");
    print!("{}", sim.timeline());
    println!(
        "time {} units, bubble {:.1} %, activations held per stage {:?}",
        sim.makespan,
        sim.bubble * 100.0,
        sim.peak_in_flight
    );
    if let Some(path) = &a.svg {
        std::fs::write(path, sim.svg(&title)).map_err(|e| Error::io("cannot write", path, e))?;
        println!("drew {}", path.display());
    }
    Ok(())
}
