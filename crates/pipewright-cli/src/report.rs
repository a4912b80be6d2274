//! `pipewright report RUN... [--out report.html]`: one page for one or more run directories
//! (a run and its continuation, a sweep's runs), written by the library's report.

use std::path::PathBuf;

use clap::Args;
use pipewright::Result;

#[derive(Args)]
pub struct ReportArgs {
    /// Run directories (what `pipewright train --out` wrote); several are overlaid.
    #[arg(required = true, value_name = "RUN")]
    pub runs: Vec<PathBuf>,
    /// Where the page goes (default: report.html in the first run directory).
    #[arg(long, value_name = "OUT")]
    pub out: Option<PathBuf>,
}

pub fn run(a: ReportArgs) -> Result<()> {
    let out = a
        .out
        .clone()
        .unwrap_or_else(|| a.runs[0].join("report.html"));
    let dirs: Vec<&std::path::Path> = a.runs.iter().map(PathBuf::as_path).collect();
    let runs = pipewright::experiment::write_report(&dirs, &out)?;
    for r in &runs {
        for m in &r.missing {
            pipewright::say!("{}: {m}", r.name);
        }
    }
    pipewright::say!("report          {} ({} runs)", out.display(), runs.len());
    Ok(())
}
