//! Which of `train`'s flags the commands that take them all (`plan`, `profile`) never read: a
//! program hides them from those commands' help and still accepts them, so a `train` command
//! line with `plan` or `profile` in front parses.

/// The ids of the flags of the section `A` of `train`'s.
fn flags_of<A: clap::Args>() -> Vec<String> {
    let c = A::augment_args(clap::Command::new("section"));
    c.get_arguments().map(|a| a.get_id().to_string()).collect()
}

/// `train`'s flags that `plan` parses with them but never uses: it chooses the layout, the
/// micro-batches, the schedule, recompute, ZeRO, the balance and the evaluation of every run it
/// measures, and none checkpoints.
pub fn unused_by_plan() -> Vec<String> {
    let mut v = flags_of::<super::CheckpointArgs>();
    let chosen = [
        "pp",
        "tp",
        "dp",
        "cp",
        "sequence_parallel",
        "zero",
        "chunks",
        "chunk_size",
        "schedule",
        "schedule_file",
        "virtual_stages",
        "recompute",
        "balance",
        "eval_every",
        "checkpoint_every",
        "async_checkpoint",
    ];
    v.extend(chosen.map(String::from));
    v
}

/// `train`'s flags that `profile` parses with them but never uses: it times the model's layers
/// (its model, task and data flags, the seed, where and in what it computes), not a run.
pub fn unused_by_profile() -> Vec<String> {
    use super::{BatchArgs, CheckpointArgs, OptimArgs, ParallelArgs};
    let mut v = flags_of::<BatchArgs>();
    v.extend(flags_of::<CheckpointArgs>());
    v.extend(flags_of::<pipewright::trainer::Cadence>());
    v.extend(flags_of::<pipewright::parallel::pipeline::PipelineSpec>());
    v.push("schedule_file".into());
    v.extend(flags_of::<OptimArgs>());
    let used = ["device", "hardware"];
    v.extend(
        flags_of::<ParallelArgs>()
            .into_iter()
            .filter(|f| !used.contains(&f.as_str())),
    );
    v.extend(["trace", "report"].map(String::from));
    v
}
