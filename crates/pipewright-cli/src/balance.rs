//! `pipewright balance`: the balance (layers per stage) of any cost vector, for users who
//! profile elsewhere (torchgpipe's `balance_by_time` / `balance_by_size` over given costs).

use clap::{Args, ValueEnum};
use pipewright::plan::{balance_cost, stage_costs};
use pipewright::Result;

#[derive(Clone, Copy, ValueEnum)]
pub enum By {
    /// Costs are times (seconds, milliseconds: any one unit).
    Time,
    /// Costs are sizes (bytes of parameters and activations).
    Size,
}

#[derive(Args)]
pub struct BalanceArgs {
    /// Cost of each layer (or segment between cut points), comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    pub costs: Vec<f64>,
    /// Pipeline stages.
    #[arg(long)]
    pub partitions: usize,
    /// What the costs measure (only the report's wording depends on it).
    #[arg(long, value_enum, default_value = "time")]
    pub by: By,
}

pub fn run(a: BalanceArgs) -> Result<()> {
    let b = balance_cost(&a.costs, a.partitions)?;
    let totals = stage_costs(&a.costs, &b);
    let list = |v: &[String]| v.join(",");
    pipewright::say!(
        "balance {}",
        list(&b.iter().map(|n| n.to_string()).collect::<Vec<_>>())
    );
    let what = match a.by {
        By::Time => "time",
        By::Size => "size",
    };
    for (s, t) in totals.iter().enumerate() {
        pipewright::say!("stage {s}: {} layers, {what} {t}", b[s]);
    }
    let worst = totals.iter().cloned().fold(0.0, f64::max);
    pipewright::say!("slowest stage {what} {worst} (the least any split of these costs can give)");
    Ok(())
}
