//! The sections of [`TrainArgs`](super::TrainArgs): one clap group per part of a run, each
//! flattened into the command line and into `params.json`, and each read by the part of
//! [`TrainArgs::train_spec`](super::TrainArgs::train_spec) that builds the library's section
//! of the same name.

use std::path::PathBuf;

use clap::Args;
use serde::{Deserialize, Serialize};

use pipewright::parallel::zero::Zero;

use super::args::*;
use super::as_text;

/// The model's sizes and where its weights start (`--n-layer`, ..., `--init-from`): read by
/// the model the run chooses; a flag another model does not read is refused by name.
#[derive(Args, Clone, Debug, Serialize, Deserialize)]
pub struct ModelArgs {
    /// Transformer blocks of the GPT or the Llama.
    #[arg(help_heading = "Model", long, default_value_t = SMALL.n_layer, value_parser = positive)]
    pub n_layer: usize,
    /// Attention heads (tensor and pipeline sizes must fit them: tp divides the heads).
    #[arg(help_heading = "Model", long, default_value_t = SMALL.n_head, value_parser = positive)]
    pub n_head: usize,
    /// Hidden size (a multiple of --n-head).
    #[arg(help_heading = "Model", long, default_value_t = SMALL.n_embd, value_parser = positive)]
    pub n_embd: usize,
    /// Tokens of a training window, and the longest sequence a new model accepts (default 64;
    /// with --init-from, the pretrained model's positions, and at most them).
    #[arg(help_heading = "Model", long, value_parser = positive)]
    pub block_size: Option<usize>,
    /// The GPT's dropout probability (after the embeddings, in attention, after the MLP),
    /// in [0, 1); 0 with --cp > 1.
    #[arg(help_heading = "Model", long, default_value_t = SMALL.dropout, value_parser = finite)]
    pub dropout: f64,
    /// GPT vocabulary (default: the task's); a larger one pads the vocabulary, for example to
    /// a multiple of --tp. Padded ids never occur.
    #[arg(help_heading = "Model", long, value_parser = positive)]
    pub vocab_size: Option<usize>,
    /// Start from pretrained weights: a Hugging Face model directory (GPT-2 or Llama:
    /// `config.json` and `model.safetensors`, or its shards and index), which also gives the
    /// model's sizes. Each rank reads only its own slices.
    #[arg(help_heading = "Model", long)]
    pub init_from: Option<PathBuf>,
    /// Llama key/value heads (grouped-query attention; default: --n-head).
    #[arg(help_heading = "Model", long, value_parser = positive)]
    pub n_kv_head: Option<usize>,
    /// Llama MLP width (default: 8/3 of --n-embd, rounded up to a multiple of 8).
    #[arg(help_heading = "Model", long, value_parser = positive)]
    pub mlp_hidden: Option<usize>,
    /// Llama rotary base.
    #[arg(help_heading = "Model", long, default_value_t = SMALL_LLAMA.rope_theta, value_parser = finite)]
    pub rope_theta: f64,
    /// Llama: a mixture of this many experts in place of the MLP (Mixtral's; --tp 1, --cp 1
    /// for now).
    #[arg(help_heading = "Model", long, value_parser = positive)]
    pub n_experts: Option<usize>,
    /// Experts each token goes to (with --n-experts).
    #[arg(help_heading = "Model", long, default_value_t = 2, value_parser = positive)]
    pub top_k: usize,
    /// A mixture in every Nth block, dense MLPs between (with --n-experts; 1: every block).
    #[arg(help_heading = "Model", long, default_value_t = 1, value_parser = positive)]
    pub moe_every: usize,
    /// Experts every token also goes through, unweighted (DeepSeek's; with --n-experts).
    #[arg(help_heading = "Model", long, default_value_t = 0)]
    pub shared_experts: usize,
    /// One expert's MLP width (with --n-experts; default: --mlp-hidden's).
    #[arg(help_heading = "Model", long, value_parser = positive)]
    pub moe_hidden: Option<usize>,
    /// The load-balancing loss's weight in the training loss (with --n-experts; Switch's 0.01).
    #[arg(help_heading = "Model", long, default_value_t = 0.01, value_parser = finite)]
    pub aux_loss_coef: f64,
    /// CNN channels of the first blocks.
    #[arg(help_heading = "Model", long, default_value_t = SMALL_CNN.width, value_parser = positive)]
    pub width: usize,
    /// CNN: a long skip connection from the stem to the head (crosses every pipeline stage).
    #[arg(help_heading = "Model", long)]
    pub long_skip: bool,
    /// CNN residual blocks.
    #[arg(help_heading = "Model", long, default_value_t = SMALL_CNN.blocks, value_parser = positive)]
    pub blocks: usize,
}

/// What the task reads: `--data` and the built-in tasks' sizes.
#[derive(Args, Clone, Debug, Serialize, Deserialize)]
pub struct TaskArgs {
    /// Text file for `--task text`; token shard directory for `--task tokens` (`data prepare`).
    #[arg(help_heading = "Task", long)]
    pub data: Option<PathBuf>,
    /// Digits of each adder operand.
    #[arg(help_heading = "Task", long, default_value_t = 2, value_parser = positive)]
    pub digits: usize,
    /// Side of the shapes images.
    #[arg(help_heading = "Task", long, default_value_t = 16, value_parser = positive)]
    pub image_size: usize,
}

/// How a step's batch splits (how long the run trains is the library's `Cadence`).
#[derive(Args, Clone, Debug, Serialize, Deserialize)]
pub struct BatchArgs {
    /// Rows of every step, over all data-parallel replicas.
    #[arg(help_heading = "Training", long, default_value_t = 64, value_parser = positive)]
    pub batch_size: usize,
    /// Micro-batches each data-parallel replica splits its rows into (torchgpipe's `chunks`;
    /// gradient accumulation, the same mathematics as one batch).
    #[arg(help_heading = "Training", long, default_value_t = 1, value_parser = positive, conflicts_with = "chunk_size")]
    pub chunks: usize,
    /// Rows of one micro-batch (Varuna's `chunk_size`): the other way to say --chunks, which
    /// becomes --batch-size / (--dp x --chunk-size).
    #[arg(help_heading = "Training", long, value_parser = positive)]
    pub chunk_size: Option<usize>,
}

/// Where the ranks compute, how they talk, and how they split the model and the data
/// (the library's `ParallelSpec` and `OverlapSpec`).
#[derive(Args, Clone, Debug, Serialize, Deserialize)]
pub struct ParallelArgs {
    /// Where each rank computes: cpu, or cuda (GPU ordinal = the rank's local rank; needs a
    /// build with `--features cuda`).
    #[arg(help_heading = "Parallelism", long, default_value = "cpu")]
    pub device: String,
    /// How ranks talk: threads of this process (local), or one process per rank under
    /// `mpirun -np P` (mpi; build with `--features mpi`), or NCCL between GPUs, one per rank
    /// (nccl, with --device cuda; ranks as threads, or processes under mpirun). Under mpirun
    /// or `pipewright launch` local means mpi.
    #[arg(help_heading = "Parallelism", long, default_value = "local")]
    pub backend: pipewright::distributed::comm::Backend,
    /// The pp x tp x cp x dp x ep layout (`--pp` .. `--ep`).
    #[command(flatten)]
    #[serde(flatten)]
    pub layout: pipewright::distributed::topology::Layout,
    /// Megatron's sequence parallelism with --tp > 1: activations outside the tensor-parallel
    /// layers split along the sequence over the tp ranks (same result, less memory).
    #[arg(help_heading = "Parallelism", long)]
    pub sequence_parallel: bool,
    /// Shard over the --dp replicas (ZeRO): 0 nothing, 1 the optimizer state and f32 master
    /// weights, 2 the gradients too, 3 the model's weights too (FSDP: each layer gathers its
    /// weights when it computes). Nothing to shard with --dp 1.
    #[arg(help_heading = "Parallelism", long, default_value = "0")]
    #[serde(with = "as_text")]
    pub zero: Zero,
    /// Sum the data-parallel gradients after the schedule ends instead of during the backward
    /// (where each bucket's sum starts once its gradients are final), wait for each ZeRO
    /// reduce-scatter at once and gather each ZeRO-3 layer when it is needed: the same bits,
    /// for comparison and debugging.
    #[arg(help_heading = "Parallelism", long)]
    pub no_overlap: bool,
    /// MiB per bucket of the data-parallel gradient sums and of ZeRO's shards (PyTorch DDP's
    /// bucket_cap_mb): smaller buckets start their sums sooner in the backward.
    #[arg(help_heading = "Parallelism", long, default_value_t = 25.0, value_parser = positive_mb)]
    pub bucket_mb: f64,
    /// Under --zero 3, layers held gathered at a time at most, the one computing included
    /// (DeepSpeed's stage3_max_live_parameters, by layer): above 1 the next layers' gathers
    /// travel while one computes (FSDP's prefetch); 1 (or --no-overlap) gathers each layer
    /// when it is needed.
    #[arg(help_heading = "Parallelism", long, default_value_t = 2, value_parser = positive)]
    pub zero_live_layers: usize,
    /// The machines the planner assumes when it chooses a layout (`plan`, and morphing to a
    /// new world under `launch`): a hardware file, or a built-in one: cpu-2core (this kind of
    /// machine), h100-node, a100-node (published figures) or h200-node (measured on an H200).
    #[arg(help_heading = "Parallelism", long, default_value = "cpu-2core")]
    pub hardware: String,
}

/// The optimizer, its learning rate and clipping (the library's `OptimSpec`).
#[derive(Args, Clone, Debug, Serialize, Deserialize)]
pub struct OptimArgs {
    /// The optimizer: adamw, or sgd.
    #[arg(help_heading = "Training", long, value_enum, default_value = "adamw")]
    pub optimizer: OptimizerKind,
    /// Peak learning rate.
    #[arg(help_heading = "Training", long, default_value_t = 1e-3, value_parser = finite)]
    pub lr: f64,
    /// Learning-rate schedule: constant, or linear warm-up then cosine decay.
    #[arg(
        help_heading = "Training",
        long = "lr-schedule",
        value_name = "LR_SCHEDULE",
        value_enum,
        default_value = "cosine"
    )]
    pub lr_decay: LrScheduleKind,
    /// Warm-up steps of the cosine schedule.
    #[arg(help_heading = "Training", long, default_value_t = 100)]
    pub warmup: u64,
    /// Final learning rate of the cosine schedule, as a fraction of --lr.
    #[arg(help_heading = "Training", long, default_value_t = 0.1, value_parser = finite)]
    pub min_lr_ratio: f64,
    /// Weight decay: AdamW's decoupled decay of matrices and embeddings (not biases or norm
    /// gains); SGD's L2 term on every parameter.
    #[arg(help_heading = "Training", long, default_value_t = 0.1, value_parser = finite)]
    pub weight_decay: f64,
    /// SGD momentum.
    #[arg(help_heading = "Training", long, default_value_t = 0.9, value_parser = finite)]
    pub momentum: f64,
    /// AdamW's decay of the first moment (PyTorch's default 0.9).
    #[arg(help_heading = "Training", long, default_value_t = 0.9, value_parser = finite)]
    #[serde(default = "default_beta1")]
    pub beta1: f64,
    /// AdamW's decay of the second moment (PyTorch's default 0.999; LLM recipes use 0.95).
    #[arg(help_heading = "Training", long, default_value_t = 0.999, value_parser = finite)]
    #[serde(default = "default_beta2")]
    pub beta2: f64,
    /// AdamW's term added to the root of the second moment (PyTorch's default 1e-8).
    #[arg(help_heading = "Training", long, default_value_t = 1e-8, value_parser = finite)]
    #[serde(default = "default_eps")]
    pub eps: f64,
    /// Which parameters AdamW's weight decay shrinks: matrices-and-embeddings (nanoGPT's
    /// rule), or matrices (embedding tables, and a head tied to one, keep their norm).
    #[arg(
        help_heading = "Training",
        long,
        value_enum,
        default_value = "matrices-and-embeddings"
    )]
    #[serde(default)]
    pub decay: DecayKind,
    /// Clip the global gradient norm to this value (0: no clipping).
    #[arg(help_heading = "Training", long, default_value_t = 1.0, value_parser = finite)]
    pub clip: f64,
}

/// When and where the run saves, and what it goes on from.
#[derive(Args, Clone, Debug, Serialize, Deserialize)]
pub struct CheckpointArgs {
    /// Where checkpoints go (default: `<out>/checkpoints`).
    #[arg(help_heading = "Checkpoints", long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Keep only the newest K checkpoints.
    #[arg(help_heading = "Checkpoints", long, value_parser = positive)]
    pub keep: Option<usize>,
    /// The checkpoint the run goes on from: the experiment's `--checkpoint` (alias
    /// `--resume`): a checkpoint directory, or `latest` (the newest complete one in
    /// --checkpoint-dir). Any layout and precision may resume any other.
    #[arg(skip)]
    #[serde(alias = "checkpoint")]
    pub resume: Option<String>,
}

/// What the run writes besides its checkpoints (how often is the library's `Cadence`).
#[derive(Args, Clone, Debug, Serialize, Deserialize)]
pub struct OutputArgs {
    /// Run directory (created; must not already hold a run unless it goes on with it; default
    /// `<output-dir>/train/<date>-<time>-<id>`).
    #[arg(help_heading = "Output", long)]
    pub out: Option<PathBuf>,
    /// Write a Chrome trace of the pipeline's actions, with each stage's data-parallel
    /// communication (gradient sums, ZeRO's reduce-scatters and gathers) on a track beside it
    /// (open it in Perfetto).
    #[arg(help_heading = "Output", long)]
    pub trace: Option<PathBuf>,
    /// At the end, write the run's page, report.html in the run directory (what `pipewright
    /// report RUN` writes: curves, throughput, timeline, memory, parameters).
    #[arg(help_heading = "Output", long)]
    pub report: bool,
}
