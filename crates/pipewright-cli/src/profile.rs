//! `pipewright profile`: each layer of a model (the flags of `train`) profiled here at a few
//! micro-batch sizes: forward and backward time fitted as fixed + per-sample seconds,
//! parameters, output and kept activation bytes per sample. The JSON it writes is what
//! `pipewright plan --profile` reads. With `--gemm`, it times matrix products of many shapes
//! instead and writes a hardware file whose curve (`plan --hardware FILE`) costs a model
//! planned from its shapes.

use clap::Args;
use pipewright::plan::{measure, GemmSweep, Sizes};
use pipewright::ModelSpec;
use pipewright::{invalid, Batch, Build, Result};

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
    /// Their collectives wait as a run's ranks do: polling while the group fits the cores. For
    /// a run of more ranks than cores (whose ranks sleep at once) profile with
    /// PIPEWRIGHT_COMM_SPIN_US=0.
    #[arg(long = "tp-sizes", value_delimiter = ',', default_value = "1")]
    pub tp_sizes: Vec<usize>,
    /// Copies of the profile to run at once (as threads), as many as the planned runs will
    /// have ranks computing at once on this machine: they slow each other down. Above 1, it
    /// also measures what twice as many copies lose (the crowded efficiency `plan` applies
    /// where ranks outnumber the cores).
    #[arg(long, default_value_t = 1)]
    pub concurrent: usize,
    /// Time matrix products of many shapes on --device in --precision, fit the device's
    /// roofline (ceiling, bandwidth, per-product overhead) and write --hardware with it to
    /// --out (default hardware.json).
    #[arg(long)]
    pub gemm: bool,
    /// With --gemm: multiply every product's sizes (1 suits a small CPU; a GPU reaches its
    /// ceiling from 4 or 8).
    #[arg(long, default_value_t = 1, value_parser = crate::train::positive)]
    pub gemm_scale: usize,
}

pub fn run(p: ProfileArgs) -> Result<()> {
    p.train.check_profiled()?;
    // The file is replaceable before anything is measured (only a file of its kind is).
    let (default, what) = match p.gemm {
        true => ("hardware.json", "a hardware description"),
        false => ("profile.json", "a layer profile"),
    };
    let out = p.train.output.out.clone().unwrap_or_else(|| default.into());
    pipewright::runtime::files::ensure_replaceable(&out, "--out", what, |t| match p.gemm {
        true => serde_json::from_str::<pipewright::plan::Hardware>(t).is_ok(),
        false => serde_json::from_str::<pipewright::plan::Profile>(t).is_ok(),
    })?;
    if p.gemm {
        return gemm(&p);
    }
    check_fits(&p)?;
    // The pools as `train` sizes them for as many ranks as copies run at once (an unset
    // RAYON_NUM_THREADS left candle's products 20-30 % slower here than train's explicit one).
    pipewright::distributed::comm::size_thread_pools(p.concurrent);
    let a = &p.train;
    let (config, _, task) = a.model_and_task()?;
    let model = config.build()?;
    let batch = |rows: usize| -> Result<Batch> {
        let (x, y) = task.batch(0, rows)?;
        Ok(Batch::pair(x, y))
    };
    let source = format!(
        "measured by `pipewright profile` on {}",
        pipewright::runtime::hostname()
    );
    let profile = measure(
        &model,
        &Build::cpu(a.seed),
        &batch,
        &Sizes {
            rows: p.sizes.clone(),
            tp: p.tp_sizes.clone(),
            concurrent: p.concurrent,
            // The loss `train` trains every reference model with (Varuna's default).
            loss: Some(std::sync::Arc::new(
                pipewright::parallel::loss::CrossEntropy::default(),
            )),
        },
        config.tp_divides(),
        source,
    )?;
    pipewright::say!(
        "{:<10} {:>10} {:>14} {:>14} {:>14} {:>14}",
        "layer",
        "params",
        "out B/sample",
        "kept B/sample",
        "fwd us/sample",
        "bwd us/sample"
    );
    for l in &profile.layers {
        pipewright::say!(
            "{:<10} {:>10} {:>14.0} {:>14.0} {:>14.1} {:>14.1}",
            l.name,
            l.params,
            l.output_bytes_per_sample,
            l.kept_bytes_per_sample,
            l.forward.per_sample_s * 1e6,
            l.backward.per_sample_s * 1e6
        );
    }
    let out = a
        .output
        .out
        .clone()
        .unwrap_or_else(|| "profile.json".into());
    profile.save(&out)?;
    pipewright::say!("wrote {}", out.display());
    Ok(())
}

/// Fails before anything is built when the largest micro-batch profiled, in `--concurrent`
/// copies of the largest tensor-parallel group, would not fit in memory: the check `train`
/// makes of a run with those micro-batches and ranks.
fn check_fits(p: &ProfileArgs) -> Result<()> {
    let most = |v: &[usize], what: &str| {
        v.iter()
            .copied()
            .max()
            .filter(|m| *m > 0)
            .ok_or_else(|| invalid!("{what} must hold positive sizes"))
    };
    let (rows, tp) = (most(&p.sizes, "--sizes")?, most(&p.tp_sizes, "--tp-sizes")?);
    let copies = p.concurrent.max(1);
    let mut a = p.train.clone();
    (
        a.parallel.layout.pp,
        a.parallel.layout.tp,
        a.parallel.layout.cp,
        a.parallel.layout.dp,
        a.batch.chunks,
    ) = (1, tp, 1, copies, 1);
    a.batch.chunk_size = Some(rows);
    a.batch.batch_size = rows.checked_mul(copies).ok_or_else(|| {
        invalid!("--sizes {rows} in --concurrent {copies} copies is too large a batch")
    })?;
    let (spec, task) = a.spec()?;
    spec.check_fits(&task.shape(), spec.train.world())
}

/// `profile --gemm`: the products timed, the curve fitted and printed, the file written.
fn gemm(p: &ProfileArgs) -> Result<()> {
    pipewright::distributed::comm::size_thread_pools(p.concurrent);
    let a = &p.train;
    let device = pipewright::runtime::device::device(&a.parallel.device, 0)?;
    let base = crate::plan::hardware(&a.parallel.hardware, None)?;
    let source = format!(
        "on {} ({})",
        pipewright::runtime::hostname(),
        a.parallel.device
    );
    let sweep = GemmSweep::run(&base, &device, a.precision.dtype(), p.gemm_scale, &source)?;
    pipewright::say!("{sweep}");
    let out = (a.output.out.clone()).unwrap_or_else(|| "hardware.json".into());
    sweep.hardware.save(&out)?;
    pipewright::say!(
        "wrote {} (pipewright plan --hardware {})",
        out.display(),
        out.display()
    );
    Ok(())
}
