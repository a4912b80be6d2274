//! `pipewright profile`: each layer of a model (the flags of `train`) profiled here at a few
//! micro-batch sizes: forward and backward time fitted as fixed + per-sample seconds,
//! parameters, output and kept activation bytes per sample. The JSON it writes is what
//! `pipewright plan --profile` reads.

use clap::Args;
use pipewright::plan::{measure, Sizes};
use pipewright::{Batch, Build, Result};

use crate::train::TrainArgs;

#[derive(Args)]
pub struct ProfileArgs {
    /// The model and task, as `train` takes them; `--out` is the JSON file to write (default
    /// profile.json).
    #[command(flatten)]
    pub train: TrainArgs,
    /// Micro-batch sizes (rows) to time.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    pub sizes: Vec<usize>,
    /// Tensor-parallel sizes to time as such (ranks as threads here); others are modelled.
    #[arg(long = "tp-sizes", value_delimiter = ',', default_value = "1")]
    pub tp_sizes: Vec<usize>,
    /// Copies of the profile to run at once (as threads), as many as the planned runs will
    /// have ranks computing at once on this machine: they slow each other down.
    #[arg(long, default_value_t = 1)]
    pub concurrent: usize,
}

pub fn run(p: ProfileArgs) -> Result<()> {
    // The pools as `train` sizes them for as many ranks as copies run at once (an unset
    // RAYON_NUM_THREADS left candle's products 20-30 % slower here than train's explicit one).
    pipewright::comm::size_thread_pools(p.concurrent);
    let a = &p.train;
    let (config, _, task) = a.model_and_task()?;
    let (model, _) = config.build()?;
    let batch = |rows: usize| -> Result<Batch> {
        let (x, y) = task.batch(0, rows)?;
        Ok(Batch::pair(x, y))
    };
    let source = format!("measured by `pipewright profile` on {}", hostname());
    let profile = measure(
        &model,
        &Build::cpu(a.seed),
        &batch,
        &Sizes {
            rows: p.sizes.clone(),
            tp: p.tp_sizes.clone(),
            concurrent: p.concurrent,
        },
        config.tp_divides(),
        source,
    )?;
    println!(
        "{:<10} {:>10} {:>14} {:>14} {:>14} {:>14}",
        "layer", "params", "out B/sample", "kept B/sample", "fwd us/sample", "bwd us/sample"
    );
    for l in &profile.layers {
        println!(
            "{:<10} {:>10} {:>14.0} {:>14.0} {:>14.1} {:>14.1}",
            l.name,
            l.params,
            l.output_bytes_per_sample,
            l.kept_bytes_per_sample,
            l.forward.per_sample_s * 1e6,
            l.backward.per_sample_s * 1e6
        );
    }
    let out = a.out.clone().unwrap_or_else(|| "profile.json".into());
    profile.save(&out)?;
    println!("wrote {}", out.display());
    Ok(())
}

fn hostname() -> String {
    std::fs::read_to_string("/etc/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "this machine".into())
}
