//! Bring your own model: a layer type of your own, a model of it with a cut point, a regression
//! loss, inputs of two named tensors, and a tuple of two dtypes crossing the cut; trained on
//! pp=2 x dp=2 ranks (threads) beside serial training, which it must match.
//!
//! ```sh
//! cargo run --release -p pipewright --example custom_model
//! ```
//!
//! The model predicts `y` from 8 features of which only some are observed: the batch holds
//! `features` (f32), `mask` (u8: 1 where a feature is observed) and the target `y`.
//! `MaskedEncoder` takes the two inputs as a tuple and passes `(hidden, mask)` on, f32 and u8,
//! across the cut to `GatedHead`, which uses the mask again. The loss is mean squared error.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use pipewright::comm::local;
use pipewright::data_parallel::DistributedLoader;
use pipewright::init::{normal_vec, rng_for};
use pipewright::loss::Mse;
use pipewright::model::{Activation, Cx, Layer, LayerSpec, Sequential};
use pipewright::nn::optim::{AdamW, AdamWConfig, LrSchedule, Optimizer};
use pipewright::nn::{Linear, Module};
use pipewright::serial::{SerialTrainer, TrainOptions};
use pipewright::topology::Layout;
use pipewright::varuna::{Varuna, VarunaOptions};
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

fn adamw(params: Vec<(String, Var)>) -> Result<Box<dyn Optimizer>> {
    let cfg = AdamWConfig {
        weight_decay: 0.0,
        ..Default::default()
    };
    Ok(Box::new(AdamW::new(params, cfg)?))
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
            seed: 0,
            chunks: GLOBAL_BATCH / CHUNK_SIZE,
            clip: None,
            schedule: LrSchedule::Constant { lr },
            tied: vec![],
            deferred_batch_norm: false,
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

/// Losses of `steps` steps on `layout`'s ranks as threads (rank 0's; every rank reports the
/// same).
pub fn train_parallel(layout: Layout, steps: u64) -> Result<Vec<f64>> {
    let opts = VarunaOptions {
        loss: Arc::new(Mse::new("y")),
        lr: LrSchedule::Constant { lr: LR },
        ..VarunaOptions::new(layout, GLOBAL_BATCH, CHUNK_SIZE)
    };
    let mut per_rank = local::run(layout.world(), |comm| {
        let mut v = Varuna::new(&model(), Box::new(comm), opts.clone())?;
        v.set_optimizer(adamw)?;
        let (replica, replicas) = (v.coords().dp_rank, layout.dp);
        let device = v.device().clone();
        let loader = DistributedLoader::new(batch, GLOBAL_BATCH, replica, replicas, device)?;
        (0..steps)
            .map(|s| Ok(v.step(&loader.batch(s)?)?.loss))
            .collect::<Result<Vec<f64>>>()
    })?;
    Ok(per_rank.remove(0))
}

fn main() -> Result<()> {
    let steps = 20;
    let serial = train_serial(steps)?;
    let parallel = train_parallel(Layout::new(2, 1, 2)?, steps)?;
    println!("step  serial      pp=2 x dp=2");
    let mut worst = 0.0f64;
    for (s, (a, b)) in serial.iter().zip(&parallel).enumerate() {
        println!("{s:>4}  {a:.8}  {b:.8}");
        worst = worst.max(((a - b) / a).abs());
    }
    println!("largest relative difference {worst:.2e}");
    if worst > 1e-5 {
        return Err(invalid!("pp=2 x dp=2 left serial training by {worst:e}"));
    }
    Ok(())
}
