//! Bring your own model: a layer type of your own, a model of it with a cut point, a regression
//! loss, inputs of two named tensors, and a tuple of two dtypes crossing the cut. The library
//! profiles it here and plans a layout of 4 ranks; the run trains through the front door
//! ([`Trainer`]), loses a machine half way, and its restarted attempt on 2 ranks is morphed by
//! the planner (from the model's shapes) and goes on from the checkpoint. Both attempts must
//! match serial training.
//!
//! ```sh
//! cargo run --release -p pipewright --example custom_model
//! ```
//!
//! The model predicts `y` from 8 features of which only some are observed: the batch holds
//! `features` (f32), `mask` (u8: 1 where a feature is observed) and the target `y`.
//! `MaskedEncoder` takes the two inputs as a tuple and passes `(hidden, mask)` on, f32 and u8,
//! across the cut to `GatedHead`, which uses the mask again. The loss is mean squared error.

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use pipewright::distributed::topology::Layout;
use pipewright::engine::serial::{SerialTrainer, TrainOptions};
use pipewright::model::nn::optim::{
    AdamWConfig, LrSchedule, OptimSpec, Optimizer, OptimizerConfig,
};
use pipewright::model::nn::{Linear, Module};
use pipewright::model::{Activation, Cx, Layer, LayerSpec, Sequential};
use pipewright::parallel::loss::Mse;
use pipewright::plan::search::candidates;
use pipewright::plan::{
    measure, rank, Cluster, Hardware, LayerShapes, ModelShapes, Morph, Request, ShapedLayer, Sizes,
    TpSplit,
};
use pipewright::runtime::seed::{normal_vec, rng_for};
use pipewright::trainer::model_spec::Custom;
use pipewright::trainer::TrainSpec;
use pipewright::trainer::{Run, Trainer};
use pipewright::{invalid, Batch, Build, Result};
use rand::Rng;

/// Features per row.
pub const FEATURES: usize = 8;
/// Hidden width.
pub const HIDDEN: usize = 16;
/// Rows of one step over all replicas, and of one micro-batch.
pub const GLOBAL_BATCH: usize = 16;
pub const CHUNK_SIZE: usize = 2;

/// The first layer: `tanh(W (features * mask) + b)`, passing the mask on beside it.
struct MaskedEncoder(Linear);

impl Layer for MaskedEncoder {
    fn name(&self) -> &str {
        "encoder"
    }

    fn forward(&self, x: Activation, _cx: &mut Cx) -> Result<Activation> {
        let [features, mask]: [Tensor; 2] = x
            .into_tensors()
            .try_into()
            .map_err(|_| invalid!("encoder takes (features, mask)"))?;
        let observed = (features * mask.to_dtype(DType::F32)?)?;
        let hidden = self.0.forward(&observed)?.tanh()?;
        Ok(Activation::Tuple(vec![hidden, mask]))
    }

    fn params(&self) -> Vec<(String, Var)> {
        self.0.params()
    }
}

/// The second layer: a linear read-out of the hidden state, scaled by the share of observed
/// features (the mask crossed the cut as u8).
struct GatedHead(Linear);

impl Layer for GatedHead {
    fn name(&self) -> &str {
        "head"
    }

    fn forward(&self, x: Activation, _cx: &mut Cx) -> Result<Activation> {
        let [hidden, mask]: [Tensor; 2] = x
            .into_tensors()
            .try_into()
            .map_err(|_| invalid!("head takes (hidden, mask)"))?;
        let share = (mask.to_dtype(DType::F32)?.sum_keepdim(1)? / FEATURES as f64)?;
        Ok(self.0.forward(&hidden)?.broadcast_mul(&share)?.into())
    }

    fn params(&self) -> Vec<(String, Var)> {
        self.0.params()
    }
}

/// The model: encoder | cut | head, taking `features` and `mask` from the batch.
pub fn model() -> Sequential {
    let mut m = Sequential::new();
    m.inputs(&["features", "mask"]);
    m.push(LayerSpec::new("encoder", |b: &Build| {
        let l = Linear::new(b, "encoder", FEATURES, HIDDEN, true)?;
        Ok(Box::new(MaskedEncoder(l)) as Box<dyn Layer>)
    }))
    .cut();
    m.push(LayerSpec::new("head", |b: &Build| {
        Ok(Box::new(GatedHead(Linear::new(b, "head", HIDDEN, 1, true)?)) as Box<dyn Layer>)
    }));
    m
}

/// The model as it describes itself to the trainer and the planner: its layers, and their
/// shapes per sample (a product each; what the forward keeps and what crosses the cut), from
/// which the planner costs a layout without running the model.
pub fn model_spec() -> Custom {
    let layer = |name: &str, inputs: usize, outputs: usize, output: usize, kept: usize| {
        ShapedLayer {
            name: name.into(),
            count: 1,
            first: None,
            params: (inputs * outputs + outputs) as f64,
            tp_split: false,
            shapes: LayerShapes {
                tokens: 1,
                linear: vec![pipewright::plan::Linear::new(
                    inputs,
                    outputs,
                    TpSplit::None,
                )],
                attention: None,
                // The mask's product and the activation, in elements.
                elementwise_whole_bytes: (2 * inputs + 2 * outputs) as f64,
                elementwise_split_bytes: 0.0,
            },
            attention: None,
            output: output as f64,
            kept: kept as f64,
            kept_whole: kept as f64,
            deferred: 0.0,
            tp_all_reduce: 0.0,
            experts: None,
        }
    };
    let shapes = ModelShapes {
        what: "the masked regression".into(),
        layers: vec![
            // (hidden, mask) cross the cut; it keeps the features, the mask and the hidden state.
            layer(
                "encoder",
                FEATURES,
                HIDDEN,
                HIDDEN + FEATURES,
                2 * FEATURES + HIDDEN,
            ),
            layer("head", HIDDEN, 1, 1, HIDDEN + FEATURES),
        ],
        tp_divides: vec![1],
    };
    Custom {
        shapes: Some(shapes),
        ..Custom::new("the masked regression", model())
    }
}

/// Global batch `step` of `rows` rows: a pure function of the step, as Varuna's
/// `get_batch_fn` and a distributed loader need.
pub fn batch(step: u64, rows: usize) -> Result<Batch> {
    let mut rng = rng_for(7, &format!("batch {step}"));
    let features = normal_vec(&mut rng, rows * FEATURES, 0.0, 1.0);
    let mask: Vec<u8> = (0..rows * FEATURES)
        .map(|_| u8::from(rng.random::<f64>() > 0.25))
        .collect();
    let truth: Vec<f64> = (0..FEATURES).map(|i| (i as f64 - 3.5) / 4.0).collect();
    let y: Vec<f32> = (0..rows)
        .map(|r| {
            (0..FEATURES)
                .map(|i| truth[i] * features[r * FEATURES + i] * f64::from(mask[r * FEATURES + i]))
                .sum::<f64>()
                .sin() as f32
        })
        .collect();
    let features: Vec<f32> = features.into_iter().map(|v| v as f32).collect();
    Ok(Batch::new()
        .with(
            "features",
            Tensor::from_vec(features, (rows, FEATURES), &Device::Cpu)?,
        )
        .with(
            "mask",
            Tensor::from_vec(mask, (rows, FEATURES), &Device::Cpu)?,
        )
        .with("y", Tensor::from_vec(y, (rows, 1), &Device::Cpu)?))
}

/// The example's optimizer: AdamW without weight decay.
const ADAMW: OptimizerConfig = OptimizerConfig::AdamW(AdamWConfig {
    beta1: 0.9,
    beta2: 0.999,
    eps: 1e-8,
    weight_decay: 0.0,
    decay_embeddings: true,
});

fn adamw(params: Vec<(String, Var)>) -> Result<Box<dyn Optimizer>> {
    ADAMW.build(params, &[])
}

const LR: f64 = 1e-2;

/// Makes an optimizer over named parameters.
pub type MakeOptimizer = fn(Vec<(String, Var)>) -> Result<Box<dyn Optimizer>>;

/// The serial oracle of the model at the parallel run's micro-batch size, with the optimizer
/// `make` makes and learning rate `lr`.
pub fn serial_trainer(make: MakeOptimizer, lr: f64) -> Result<SerialTrainer> {
    let stage = model().build(&Build::cpu(0))?;
    let opt = make(stage.params())?;
    SerialTrainer::new(
        stage,
        opt,
        TrainOptions {
            spec: TrainSpec {
                optim: OptimSpec {
                    lr: LrSchedule::Constant { lr },
                    ..Default::default()
                },
                ..TrainSpec::serial()
            },
            micro_batches: GLOBAL_BATCH / CHUNK_SIZE,
            tied: vec![],
            loss: Arc::new(Mse::new("y")),
        },
    )
}

/// Losses of `steps` steps of serial training (the oracle), at the same micro-batch size.
pub fn train_serial(steps: u64) -> Result<Vec<f64>> {
    let mut t = serial_trainer(adamw, LR)?;
    (0..steps)
        .map(|s| Ok(t.step(&batch(s, GLOBAL_BATCH)?)?.loss))
        .collect()
}

/// The run on `layout`: `steps` steps of 1F1B at this example's batch, optimizer and
/// learning rate (a [`TrainSpec`] is the run as data: it saves with the run, builds the
/// trainer's options and morphs).
pub fn spec(layout: Layout, steps: u64) -> TrainSpec {
    TrainSpec {
        optim: pipewright::model::nn::optim::OptimSpec {
            optimizer: ADAMW,
            lr: LrSchedule::Constant { lr: LR },
            ..Default::default()
        },
        ..TrainSpec::new(layout, GLOBAL_BATCH, CHUNK_SIZE, steps)
    }
}

/// Losses of `steps` steps on `layout`'s ranks as threads under 1F1B (rank 0's; every rank
/// reports the same).
pub fn train_parallel(layout: Layout, steps: u64) -> Result<Vec<f64>> {
    train(&spec(layout, steps))
}

/// The run `spec` of this example's model, loss and data, through the front door.
pub fn run(spec: TrainSpec) -> Run {
    Run {
        loss: Arc::new(Mse::new("y")),
        ..Run::new(spec, Arc::new(model_spec()), Arc::new(batch))
    }
}

/// Losses of the run `spec` (its layout's ranks as threads) through the front door.
pub fn train(spec: &TrainSpec) -> Result<Vec<f64>> {
    // A run directory of its own (rank 0 records the run there), removed after.
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("custom-model-{}-{n}", std::process::id()));
    let losses = Trainer::new(run(spec.clone()), None)?.losses(&dir, None);
    let _ = std::fs::remove_dir_all(&dir);
    losses
}

/// Plans this model for 4 ranks from a profile measured here: the fastest layout at the
/// serial oracle's micro-batch size, as the run `steps` steps long.
pub fn plan(steps: u64) -> Result<TrainSpec> {
    let sizes = Sizes {
        rows: vec![CHUNK_SIZE, 2 * CHUNK_SIZE],
        tp: vec![1],
        concurrent: 1,
        // The loss the last stage computes is timed with the last layer.
        loss: Some(Arc::new(Mse::new("y"))),
    };
    // The model does not split over tensor-parallel ranks: tp must divide 1.
    let sample = |rows: usize| batch(0, rows);
    let profile = measure(
        &model(),
        &Build::cpu(0),
        &sample,
        &sizes,
        vec![1],
        "here".into(),
    )?;
    let hw = Hardware::load("cpu-2core")?;
    let req = Request {
        world: 4,
        memory_bytes: hw.memory_bytes() as f64,
        global_batch: GLOBAL_BATCH,
        top: 3,
    };
    // The serial oracle's micro-batch size, so that every layout adds the same sums.
    let all = candidates(&req, &profile)
        .into_iter()
        .filter(|c| c.micro_batch == CHUNK_SIZE)
        .collect();
    let planned = rank(&profile, &Cluster::new(&hw, 4, None)?, &req, all)?;
    println!("planned for 4 ranks (predicted step time):");
    for e in &planned {
        let c = &e.candidate;
        let what = format!(
            "{} {}, recompute {:?}",
            c.parallel.layout, c.schedule.kind, c.schedule.recompute
        );
        println!("  {what:<40} {:>8.3} ms", e.step_s * 1e3);
    }
    let c = &planned[0].candidate;
    let mut chosen = spec(c.parallel.layout, steps);
    chosen.batch.micro_batch = c.micro_batch;
    chosen.pipeline.schedule = c.schedule;
    Ok(chosen)
}

/// Trains `planned` for half its steps in the run directory `dir`, saving a checkpoint there;
/// then a restarted attempt finds 2 ranks (a machine left): the front door morphs the run by
/// the planner (the model's shapes on this 2-core machine) and goes on from the checkpoint to
/// the last step. Returns the losses of both attempts, in order, and the morph.
pub fn restart_and_morph(planned: &TrainSpec, dir: &Path) -> Result<(Vec<f64>, Morph)> {
    let steps = planned.cadence.steps;
    let mut first = planned.clone();
    first.cadence.steps = steps / 2;
    first.cadence.checkpoint_every = steps / 2;
    let mut losses = Trainer::new(run(first), None)?.losses(dir, None)?;
    let mut again = run(planned.clone());
    again.place.machines = Some((Hardware::load("cpu-2core")?, 2));
    let trainer = Trainer::new(again, Some(2))?;
    let morph = trainer
        .morphed()
        .cloned()
        .ok_or_else(|| invalid!("a world of 2 ranks did not morph the run"))?;
    losses.extend(trainer.losses(dir, Some("latest"))?);
    Ok((losses, morph))
}

fn main() -> Result<()> {
    let steps = 20;
    let serial = train_serial(steps)?;
    let planned = plan(steps)?;
    let dir = std::env::temp_dir().join(format!("custom-model-{}", std::process::id()));
    let (parallel, m) = restart_and_morph(&planned, &dir)?;
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "a machine left after step {}: morphed from {} to {} ({})",
        steps / 2,
        planned.parallel.layout,
        m.layout,
        m.why
    );
    println!("step  serial      planned, then morphed");
    let mut worst = 0.0f64;
    for (s, (a, b)) in serial.iter().zip(&parallel).enumerate() {
        println!("{s:>4}  {a:.8}  {b:.8}");
        worst = worst.max(((a - b) / a).abs());
    }
    println!("largest relative difference {worst:.2e}");
    if worst > 1e-5 || parallel.len() != serial.len() {
        return Err(invalid!(
            "the planned and morphed run left serial training by {worst:e}"
        ));
    }
    Ok(())
}
