//! `pipewright bench ckpt`: the library's checkpoint benchmark
//! ([`pipewright_models::ckpt_bench`]) on the flags' disk, its table printed.

use std::path::PathBuf;

use clap::Args;
use pipewright::Result;
use pipewright_models::ckpt_bench::CkptBench;

#[derive(Args)]
pub struct CkptBenchArgs {
    /// GPT layers (d 768, 12 heads, vocabulary 16384: 12 layers make about 110M parameters).
    #[arg(long, default_value_t = 12)]
    pub n_layer: usize,
    /// The directory to write in (the disk measured; by default the current one, which
    /// exists wherever the command runs): the benchmark makes a fresh subdirectory there and
    /// removes only that.
    #[arg(long, default_value = ".")]
    pub dir: PathBuf,
    /// Training steps run while a background save writes.
    #[arg(long, default_value_t = 2)]
    pub steps_during_async: u64,
}

pub fn run(a: CkptBenchArgs) -> Result<()> {
    let report = CkptBench {
        n_layer: a.n_layer,
        dir: a.dir,
        steps_during_async: a.steps_during_async,
    }
    .run()?;
    pipewright::say!("{report}");
    Ok(())
}
