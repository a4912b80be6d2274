//! The `pipewright` command line.

mod balance;
mod bench;
mod bench_ckpt;
mod ckpt;
mod data;
mod generate;
mod launch;
mod plan;
mod profile;
mod report;
mod schedule;
mod sweep;
mod train;

use clap::{Parser, Subcommand};

/// Counts live bytes per rank (`pipewright::memory`): the summary's allocated peaks.
#[global_allocator]
static ALLOC: pipewright::memory::CountingAlloc = pipewright::memory::CountingAlloc;

#[derive(Parser)]
#[command(
    name = "pipewright",
    version,
    about = "Parallel training of deep networks on candle"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a reference model on a generated task and write a run directory (an experiment:
    /// `pipewright train --help` lists its flags and the standard parameters).
    #[command(disable_help_flag = true)]
    Train {
        /// Train's flags and the experiment's parameters (`pipewright train --help`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, num_args = 0..)]
        args: Vec<std::ffi::OsString>,
    },
    /// Print (and draw) a pipeline schedule's timeline with its bubble fraction.
    Schedule(schedule::ScheduleArgs),
    /// Measure throughput (`bench comm`: send/recv and all-reduce bandwidth; `bench ckpt`:
    /// checkpoint save and load beside plain file I/O).
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Profile each layer of a model at a few micro-batch sizes (time, bytes) into a JSON file.
    Profile(Box<profile::ProfileArgs>),
    /// Choose a layout: every pp x tp x dp, micro-batch size, schedule and recompute mode
    /// under a memory cap, ranked by predicted step time (`--measure`: trained here too).
    Plan(Box<plan::PlanArgs>),
    /// One self-contained HTML page for runs: curves, throughput and MFU, the pipeline timeline
    /// measured beside predicted, memory per rank, the launch history, parameters and summary.
    Report(report::ReportArgs),
    /// The balance (layers per stage) of a cost vector that minimises the slowest stage.
    Balance(balance::BalanceArgs),
    /// Run a program for every combination of parameter values, a few at once, and tabulate
    /// the runs.
    Sweep(sweep::SweepArgs),
    /// A tokenizer for a corpus, and the corpus as token shards (`train --task tokens`).
    #[command(subcommand)]
    Data(data::DataCommand),
    /// Continue a prompt with a trained checkpoint or a Hugging Face model (any pp x tp).
    Generate(Box<generate::GenerateArgs>),
    /// Inspect, verify, reshard and export checkpoints.
    #[command(subcommand)]
    Ckpt(ckpt::CkptCommand),
    /// Start a program's ranks under mpirun and restart them when one dies.
    Launch(launch::LaunchArgs),
    /// (What `launch` runs in each rank: torchrun's variables, then the program.)
    #[command(hide = true)]
    RankEnv {
        #[arg(last = true, required = true)]
        program: Vec<String>,
    },
}

fn main() {
    // Evaluations and checkpoints allocate and free the same large buffers again and again.
    pipewright::memory::keep_freed_memory();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train { args } => train::run(args),
        Command::Bench(b) => bench::run(b),
        Command::Schedule(a) => schedule::run(a),
        Command::Ckpt(c) => ckpt::run(c),
        Command::Data(c) => data::run(c),
        Command::Generate(a) => generate::run(*a),
        Command::Balance(a) => balance::run(a),
        Command::Profile(a) => profile::run(*a),
        Command::Plan(a) => plan::run(*a),
        Command::Report(a) => report::run(a),
        Command::Sweep(a) => sweep::run(a),
        Command::Launch(a) => launch::run(a),
        Command::RankEnv { program } => launch::rank_env(&program),
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// Every argument of every subcommand says what it is (`--help` lists none bare).
    #[test]
    fn every_flag_and_argument_has_help() {
        fn walk(cmd: &clap::Command, path: &str, bare: &mut Vec<String>) {
            for arg in cmd.get_arguments() {
                let id = arg.get_id().as_str();
                if id == "help" || id == "version" || arg.is_hide_set() {
                    continue;
                }
                if arg.get_help().is_none() && arg.get_long_help().is_none() {
                    bare.push(format!("{path} {id}"));
                }
            }
            for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
                walk(sub, &format!("{path} {}", sub.get_name()), bare);
            }
        }
        let mut bare = Vec::new();
        walk(&super::Cli::command(), "pipewright", &mut bare);
        // `train` parses its own flags (with the experiment's parameters, described there).
        let train = <crate::train::TrainArgs as clap::Args>::augment_args(clap::Command::new("t"));
        walk(&train, "pipewright train", &mut bare);
        assert!(bare.is_empty(), "arguments without help: {bare:?}");
    }
}
