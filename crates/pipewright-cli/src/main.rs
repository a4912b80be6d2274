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

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

/// Counts live bytes per rank (`pipewright::runtime::memory`): the summary's allocated peaks.
#[global_allocator]
static ALLOC: pipewright::runtime::memory::CountingAlloc =
    pipewright::runtime::memory::CountingAlloc;

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

/// The command line: [`Cli`]'s, with the flags `plan` and `profile` take from `train` but never
/// use hidden from their help (still accepted, so a `train` command line with `plan` or
/// `profile` in front still parses).
/// `c` and every subcommand read `-5` as a value, which the flag's parser then refuses with
/// its range ("must be a positive integer, got -5"), not as an unknown flag ("unexpected
/// argument '-5' found").
fn negative_values(c: clap::Command) -> clap::Command {
    c.allow_negative_numbers(true)
        .mut_subcommands(negative_values)
}

fn command() -> clap::Command {
    fn hide(ids: Vec<String>) -> impl FnOnce(clap::Command) -> clap::Command {
        move |c| ids.iter().fold(c, |c, id| c.mut_arg(id, |a| a.hide(true)))
    }
    // `--out` is a run directory to `train`; these write something else there.
    negative_values(Cli::command())
        .mut_subcommand("plan", |c| {
            hide(pipewright_models::flags::unused_by_plan())(c).mut_arg("out", |a| {
                a.help(
                    "With --measure: the directory the measured runs go in, one directory each \
                     (default: output/plan)",
                )
            })
        })
        .mut_subcommand("profile", |c| {
            hide(pipewright_models::flags::unused_by_profile())(c).mut_arg("out", |a| {
                a.help(
                    "The JSON file written: the profile (default: profile.json), or with --gemm \
                     the hardware file (default: hardware.json)",
                )
            })
        })
}

fn main() {
    // Evaluations and checkpoints allocate and free the same large buffers again and again.
    pipewright::runtime::memory::keep_freed_memory();
    let cli = Cli::from_arg_matches(&command().get_matches()).unwrap_or_else(|e| e.exit());
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
        Command::RankEnv { program } => pipewright::trainer::launch::exec_rank(&program),
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {

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
        walk(&super::command(), "pipewright", &mut bare);
        // `train` parses its own flags (with the experiment's parameters, described there).
        let train = <crate::train::TrainArgs as clap::Args>::augment_args(clap::Command::new("t"));
        walk(&train, "pipewright train", &mut bare);
        assert!(bare.is_empty(), "arguments without help: {bare:?}");
    }

    /// Every value a flag takes is named after the flag (`--virtual <VIRTUAL>`, not the field's
    /// `<VIRTUAL_STAGES>`), unless it is named on purpose (`--param <NAME=VALUES>`).
    #[test]
    fn every_flags_value_is_named_after_it() {
        fn walk(cmd: &clap::Command, path: &str, wrong: &mut Vec<String>) {
            for arg in cmd.get_arguments().filter(|a| !a.is_hide_set()) {
                let (Some(long), Some([name, ..])) = (arg.get_long(), arg.get_value_names()) else {
                    continue;
                };
                // The derive names a value after its field: wrong where the field is not the
                // flag; a name set on purpose is neither.
                let id = arg.get_id().as_str();
                if name.as_str() == id.to_uppercase() && id != long.replace('-', "_") {
                    wrong.push(format!("{path} --{long} <{name}>"));
                }
            }
            for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
                walk(sub, &format!("{path} {}", sub.get_name()), wrong);
            }
        }
        let mut wrong = Vec::new();
        let mut cmd = super::command();
        cmd.build();
        walk(&cmd, "pipewright", &mut wrong);
        let mut train =
            <crate::train::TrainArgs as clap::Args>::augment_args(clap::Command::new("t"));
        train.build();
        walk(&train, "pipewright train", &mut wrong);
        assert!(
            wrong.is_empty(),
            "values named unlike their flags: {wrong:?}"
        );
    }

    /// `train --help` groups its flags (model, task, training, parallelism, checkpoints,
    /// output) instead of one list of sixty.
    #[test]
    fn every_train_flag_is_grouped() {
        let train = <crate::train::TrainArgs as clap::Args>::augment_args(clap::Command::new("t"));
        let loose: Vec<&str> = train
            .get_arguments()
            .filter(|a| !a.is_hide_set() && a.get_help_heading().is_none())
            .map(|a| a.get_id().as_str())
            .collect();
        assert!(loose.is_empty(), "flags under no heading: {loose:?}");
    }

    /// `plan --help` and `profile --help` show their own flags, not `train`'s that they ignore
    /// (checkpoints; for `profile`, the whole run), and still accept them.
    #[test]
    fn plan_and_profile_show_only_the_flags_they_use() {
        let cmd = super::command();
        for (sub, unused) in [
            ("plan", pipewright_models::flags::unused_by_plan()),
            ("profile", pipewright_models::flags::unused_by_profile()),
        ] {
            let mut c = cmd.find_subcommand(sub).unwrap().clone();
            let help = c.render_long_help().to_string();
            for flag in ["--checkpoint-every", "--keep", "--chunks", "--virtual"] {
                assert!(!help.contains(flag), "{sub} --help shows {flag}");
            }
            assert!(
                help.contains("--model") && help.contains("--n-layer"),
                "{help}"
            );
            for id in unused {
                let arg = c.get_arguments().find(|a| a.get_id() == id.as_str());
                assert!(arg.is_some_and(|a| a.is_hide_set()), "{sub} {id}");
            }
        }
        assert!(cmd
            .clone()
            .try_get_matches_from(["pipewright", "profile", "--chunks", "4", "--steps", "9"])
            .is_ok());
    }
}
