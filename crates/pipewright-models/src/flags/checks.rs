//! The flags no run may be given without saying so: a size flag of a model or task the run
//! does not use (it would be ignored without a word), and flags that do not combine.

use pipewright::{invalid, Result};

use pipewright::model::precision::Precision;

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
                ("width", a.sizes.width != d.sizes.width),
                ("blocks", a.sizes.blocks != d.sizes.blocks),
                ("long-skip", a.sizes.long_skip),
                ("n-kv-head", a.sizes.n_kv_head.is_some()),
                ("mlp-hidden", a.sizes.mlp_hidden.is_some()),
                ("rope-theta", a.sizes.rope_theta != d.sizes.rope_theta),
                ("n-experts", a.sizes.n_experts.is_some()),
            ]),
        ),
        ModelKind::Llama => (
            "llama",
            given(&[
                ("width", a.sizes.width != d.sizes.width),
                ("blocks", a.sizes.blocks != d.sizes.blocks),
                ("long-skip", a.sizes.long_skip),
                ("dropout", a.sizes.dropout != d.sizes.dropout),
            ]),
        ),
        ModelKind::Cnn => (
            "cnn",
            given(&[
                ("n-layer", a.sizes.n_layer != d.sizes.n_layer),
                ("n-head", a.sizes.n_head != d.sizes.n_head),
                ("n-embd", a.sizes.n_embd != d.sizes.n_embd),
                ("vocab-size", a.sizes.vocab_size.is_some()),
                ("dropout", a.sizes.dropout != d.sizes.dropout),
                ("n-kv-head", a.sizes.n_kv_head.is_some()),
                ("mlp-hidden", a.sizes.mlp_hidden.is_some()),
                ("rope-theta", a.sizes.rope_theta != d.sizes.rope_theta),
                ("n-experts", a.sizes.n_experts.is_some()),
            ]),
        ),
    };
    // The CNN's convolutions and batch norms take the images in f32 (candle's conv2d needs
    // one type for input and kernel): a low type failed inside the first convolution.
    if matches!(a.model, ModelKind::Cnn) && a.precision != Precision::F32 {
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
            a.inputs.digits != d.inputs.digits && !matches!(a.task, TaskKind::Adder),
        ),
        (
            "image-size",
            a.inputs.image_size != d.inputs.image_size && !matches!(a.task, TaskKind::Shapes),
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
    let adam = (a.optim.beta1, a.optim.beta2, a.optim.eps, a.optim.decay)
        != (d.optim.beta1, d.optim.beta2, d.optim.eps, d.optim.decay);
    let needs: [(bool, &str); 7] = [
        (
            a.optim.momentum != d.optim.momentum
                && matches!(a.optim.optimizer, OptimizerKind::Adamw),
            "--momentum is SGD's: this run uses --optimizer adamw (its betas play that part)",
        ),
        (
            adam && matches!(a.optim.optimizer, OptimizerKind::Sgd),
            "--beta1, --beta2, --eps and --decay are AdamW's: this run uses --optimizer sgd \
             (--momentum is its)",
        ),
        (
            a.pipeline.deferred_batch_norm && !matches!(a.model, ModelKind::Cnn),
            "--deferred-batch-norm defers batch norm's statistics, and only --model cnn has any",
        ),
        (
            a.parallel.sequence_parallel && a.parallel.layout.tp == 1,
            "--sequence-parallel splits activations over the tensor-parallel ranks: give --tp 2 \
             or more",
        ),
        (
            a.checkpoint.keep.is_some() && a.cadence.checkpoint_every == 0,
            "--keep prunes the checkpoints --checkpoint-every N saves: give --checkpoint-every",
        ),
        (
            a.cadence.async_checkpoint && a.cadence.checkpoint_every == 0,
            "--async-checkpoint writes the checkpoints --checkpoint-every N saves: give \
             --checkpoint-every",
        ),
        (
            a.parallel.backend == pipewright::distributed::comm::Backend::Mpi && a.world() == 1,
            "--backend mpi talks between ranks, and this layout has one: drop --backend mpi, or \
             give the layout more ranks (--pp, --tp, --dp, --cp)",
        ),
    ];
    if let Some((_, why)) = needs.iter().find(|(bad, _)| *bad) {
        return Err(invalid!("{why}"));
    }
    super::moe::check(a, d)
}
