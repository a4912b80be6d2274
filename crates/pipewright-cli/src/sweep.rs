//! `pipewright sweep`: a program run for every combination of parameter values (pystematic's
//! `run_parameter_sweep`), each with `--NAME VALUE` for its parameters and `--out DIR/<run>`,
//! at most `--max-parallel` at once; a summary table printed and written as `DIR/sweep.csv`;
//! a non-zero exit when any run failed (the others still ran).

use std::path::PathBuf;

use clap::Args;
use pipewright::experiment::{run_parameter_sweep, Sweep};
use pipewright::{invalid, Result};

#[derive(Args)]
pub struct SweepArgs {
    /// A parameter and its values, `lr=1e-3,3e-3` (repeat for more; runs take every
    /// combination).
    #[arg(long = "param", value_name = "NAME=VALUES", required = true)]
    pub params: Vec<String>,
    /// Runs at once.
    #[arg(long, default_value_t = 1, value_parser = crate::train::positive)]
    pub max_parallel: usize,
    /// Where the runs (one directory each), their logs and `sweep.csv` go.
    #[arg(long)]
    pub out: PathBuf,
    /// The flag that gives a run its directory.
    #[arg(long, default_value = "--out")]
    pub out_flag: String,
    /// The program and its fixed arguments (`pipewright` means this pipewright).
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

pub fn run(a: SweepArgs) -> Result<()> {
    let grid = a
        .params
        .iter()
        .map(|p| {
            let (name, values) = p
                .split_once('=')
                .ok_or_else(|| invalid!("--param {p}: write NAME=V1,V2,..."))?;
            let values: Vec<String> = values.split(',').map(|v| v.trim().to_string()).collect();
            if name.is_empty() || values.iter().any(String::is_empty) {
                return Err(invalid!("--param {p}: a name and non-empty values"));
            }
            Ok((name.trim_start_matches('-').to_string(), values))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut command = a.command.clone();
    if command[0] == "pipewright" {
        command[0] = std::env::current_exe()
            .map_err(|e| invalid!("cannot find this program: {e}"))?
            .to_string_lossy()
            .into_owned();
    }
    let runs = run_parameter_sweep(&Sweep {
        grid: grid.clone(),
        command,
        out: a.out.clone(),
        out_flag: a.out_flag,
        max_parallel: a.max_parallel,
    })?;
    let mut header: Vec<String> = grid.iter().map(|(k, _)| format!("{k:>10}")).collect();
    header.extend(["final loss", "    metric", "   seconds", "status"].map(String::from));
    pipewright::say!("{}", header.join(" "));
    let opt = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{x:.4}"));
    for r in &runs {
        let mut row: Vec<String> = r.params.iter().map(|(_, v)| format!("{v:>10}")).collect();
        row.push(format!("{:>10}", opt(r.final_loss)));
        row.push(format!("{:>10}", opt(r.metric)));
        row.push(format!("{:>10.2}", r.seconds));
        row.push(
            r.failure
                .as_ref()
                .map_or("ok".into(), |f| format!("FAILED {f}")),
        );
        pipewright::say!("{}", row.join(" "));
    }
    pipewright::say!("wrote {}", a.out.join("sweep.csv").display());
    if a.out.join("report.html").exists() {
        pipewright::say!("report          {}", a.out.join("report.html").display());
    }
    let failed = runs.iter().filter(|r| r.failure.is_some()).count();
    if failed > 0 {
        return Err(invalid!("{failed} of {} runs failed", runs.len()));
    }
    Ok(())
}
