//! `pipewright profile`: each layer of a model (the flags of `train`) profiled here at a few
//! micro-batch sizes: forward and backward time fitted as fixed + per-sample seconds,
//! parameter bytes, activation bytes per sample, and the bytes crossing each possible cut.

use clap::Args;
use pipewright::plan::profile_layers;
use pipewright::{Batch, Build, Error, Result};
use serde_json::json;

use crate::train::{make_model, make_task, TrainArgs};

#[derive(Args)]
pub struct ProfileArgs {
    /// The model and task, as `train` takes them; `--out` is the JSON file to write.
    #[command(flatten)]
    pub train: TrainArgs,
    /// Micro-batch sizes (rows) to time.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    pub sizes: Vec<usize>,
}

/// Least-squares `a + b x` through the points.
fn fit(xs: &[f64], ys: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let (mx, my) = (xs.iter().sum::<f64>() / n, ys.iter().sum::<f64>() / n);
    let sxx: f64 = xs.iter().map(|x| (x - mx) * (x - mx)).sum();
    let sxy: f64 = xs.iter().zip(ys).map(|(x, y)| (x - mx) * (y - my)).sum();
    // A per-sample cost below zero is noise on a layer too cheap to time: none.
    let b = if sxx > 0.0 { (sxy / sxx).max(0.0) } else { 0.0 };
    (my - b * mx, b)
}

pub fn run(p: ProfileArgs) -> Result<()> {
    let a = &p.train;
    if p.sizes.is_empty() || p.sizes.contains(&0) {
        return Err(pipewright::invalid!(
            "--sizes must list positive micro-batch sizes"
        ));
    }
    let task = make_task(a)?;
    let config = make_model(a, task.as_ref())?;
    let (model, _) = config.build()?;
    let build = Build::cpu(a.seed);
    let mut runs = Vec::new();
    for &size in &p.sizes {
        let (x, y) = task.batch(0, size)?;
        runs.push(profile_layers(&model, &build, &Batch::pair(x, y), 3)?);
    }
    let xs: Vec<f64> = p.sizes.iter().map(|&s| s as f64).collect();
    let last = p.sizes.len() - 1;
    let mut layers = Vec::new();
    println!(
        "{:<10} {:>12} {:>14} {:>14} {:>14}",
        "layer", "params B", "act B/sample", "fwd us/sample", "bwd us/sample"
    );
    for (i, l) in runs[0].iter().enumerate() {
        let fwd: Vec<f64> = runs.iter().map(|r| r[i].forward_s).collect();
        let bwd: Vec<f64> = runs.iter().map(|r| r[i].backward_s).collect();
        let (f0, f1) = fit(&xs, &fwd);
        let (b0, b1) = fit(&xs, &bwd);
        let act = runs[last][i].activation_bytes as f64 / p.sizes[last] as f64;
        println!(
            "{:<10} {:>12} {:>14.0} {:>14.1} {:>14.1}",
            l.name,
            l.param_bytes,
            act,
            f1 * 1e6,
            b1 * 1e6
        );
        layers.push(json!({
            "name": l.name,
            "param_bytes": l.param_bytes,
            "activation_bytes_per_sample": act,
            "forward": {"fixed_s": f0, "per_sample_s": f1},
            "backward": {"fixed_s": b0, "per_sample_s": b1},
            "measured": p.sizes.iter().zip(runs.iter()).map(|(s, r)| json!({
                "rows": s, "forward_s": r[i].forward_s, "backward_s": r[i].backward_s,
            })).collect::<Vec<_>>(),
        }));
    }
    // What crosses each place the model may be cut: the output of the layer before it.
    let bounds = pipewright::pipeline::partition::unit_bounds(&model);
    let cuts: Vec<_> = bounds[1..bounds.len() - 1]
        .iter()
        .map(|&b| json!({"before_layer": b, "bytes_per_sample": layers[b - 1]["activation_bytes_per_sample"]}))
        .collect();
    let doc = json!({"model": config, "sizes": p.sizes, "layers": layers, "cuts": cuts});
    let text = serde_json::to_string_pretty(&doc).map_err(|e| pipewright::invalid!("{e}"))?;
    std::fs::write(&a.out, text).map_err(|e| Error::io("cannot write", &a.out, e))?;
    println!("wrote {}", a.out.display());
    Ok(())
}
