//! The flags no run may be given without saying so: a size flag of a model or task the run
//! does not use (it would be ignored without a word), and flags that do not combine.

use pipewright::{invalid, Result};

use super::args::{defaults, ModelKind, OptimizerKind, TaskKind, TrainArgs};

/// Fails on a size flag given for a model or task the run does not use (it would be
/// ignored without a word). A flag at its default value is not told apart from an absent
/// one.
pub(super) fn check_flags_apply(a: &TrainArgs) -> Result<()> {
    let d = defaults();
    let given = |flags: &[(&str, bool)]| -> Vec<String> {
        flags
            .iter()
            .filter(|(_, g)| *g)
            .map(|(f, _)| format!("--{f}"))
            .collect()
    };
    let (model, other) = match a.model {
        ModelKind::Gpt => (
            "gpt",
            given(&[
                ("width", a.width != d.width),
                ("blocks", a.blocks != d.blocks),
                ("long-skip", a.long_skip),
                ("n-kv-head", a.n_kv_head.is_some()),
                ("mlp-hidden", a.mlp_hidden.is_some()),
                ("rope-theta", a.rope_theta != d.rope_theta),
                ("n-experts", a.n_experts.is_some()),
            ]),
        ),
        ModelKind::Llama => (
            "llama",
            given(&[
                ("width", a.width != d.width),
                ("blocks", a.blocks != d.blocks),
                ("long-skip", a.long_skip),
                ("dropout", a.dropout != d.dropout),
            ]),
        ),
        ModelKind::Cnn => (
            "cnn",
            given(&[
                ("n-layer", a.n_layer != d.n_layer),
                ("n-head", a.n_head != d.n_head),
                ("n-embd", a.n_embd != d.n_embd),
                ("vocab-size", a.vocab_size.is_some()),
                ("dropout", a.dropout != d.dropout),
                ("n-kv-head", a.n_kv_head.is_some()),
                ("mlp-hidden", a.mlp_hidden.is_some()),
                ("rope-theta", a.rope_theta != d.rope_theta),
                ("n-experts", a.n_experts.is_some()),
            ]),
        ),
    };
    // The CNN's convolutions and batch norms take the images in f32 (candle's conv2d needs
    // one type for input and kernel): a low type failed inside the first convolution.
    if matches!(a.model, ModelKind::Cnn) && a.precision != "f32" {
        return Err(invalid!(
            "--model cnn trains in f32 only: drop --precision {}",
            a.precision
        ));
    }
    if !other.is_empty() {
        return Err(invalid!(
            "this run trains --model {model}, which does not use {}: drop them, or choose the \
             model they size",
            other.join(", ")
        ));
    }
    let task = given(&[
        (
            "digits",
            a.digits != d.digits && !matches!(a.task, TaskKind::Adder),
        ),
        (
            "image-size",
            a.image_size != d.image_size && !matches!(a.task, TaskKind::Shapes),
        ),
    ]);
    if !task.is_empty() {
        return Err(invalid!(
            "this run learns --task {}, which does not use {}: drop them, or choose the task \
             they belong to",
            format!("{:?}", a.task).to_lowercase(),
            task.join(", ")
        ));
    }
    check_flags_combine(a, &d)
}

/// Fails on a flag that only means something beside another the run does not have.
fn check_flags_combine(a: &TrainArgs, d: &TrainArgs) -> Result<()> {
    let adam = (a.beta1, a.beta2, a.eps, a.decay) != (d.beta1, d.beta2, d.eps, d.decay);
    let needs: [(bool, &str); 7] = [
        (
            a.momentum != d.momentum && matches!(a.optimizer, OptimizerKind::Adamw),
            "--momentum is SGD's: this run uses --optimizer adamw (its betas play that part)",
        ),
        (
            adam && matches!(a.optimizer, OptimizerKind::Sgd),
            "--beta1, --beta2, --eps and --decay are AdamW's: this run uses --optimizer sgd \
             (--momentum is its)",
        ),
        (
            a.deferred_batch_norm && !matches!(a.model, ModelKind::Cnn),
            "--deferred-batch-norm defers batch norm's statistics, and only --model cnn has any",
        ),
        (
            a.sequence_parallel && a.tp == 1,
            "--sequence-parallel splits activations over the tensor-parallel ranks: give --tp 2 \
             or more",
        ),
        (
            a.keep.is_some() && a.checkpoint_every == 0,
            "--keep prunes the checkpoints --checkpoint-every N saves: give --checkpoint-every",
        ),
        (
            a.async_checkpoint && a.checkpoint_every == 0,
            "--async-checkpoint writes the checkpoints --checkpoint-every N saves: give \
             --checkpoint-every",
        ),
        (
            a.backend == pipewright::distributed::comm::Backend::Mpi && a.world() == 1,
            "--backend mpi talks between ranks, and this layout has one: drop --backend mpi, or \
             give the layout more ranks (--pp, --tp, --dp, --cp)",
        ),
    ];
    if let Some((_, why)) = needs.iter().find(|(bad, _)| *bad) {
        return Err(invalid!("{why}"));
    }
    super::moe::check(a, d)
}
