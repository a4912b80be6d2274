//! Shared by the checkpoint tests: a run of the tiny GPT from step `from` to `to` at any
//! layout, optionally resumed from and saved into a checkpoint, and what it ends with.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{Tensor, Var};
use pipewright::distributed::comm::{local, Communicator};
use pipewright::distributed::topology::Layout;
use pipewright::engine::checkpoint::CheckpointOptions;
use pipewright::engine::varuna::{Varuna, VarunaOptions};
use pipewright::model::nn::optim::{AdamW, AdamWConfig, Optimizer};
use pipewright::model::precision::{LossScaler, Precision};
use pipewright::parallel::data_parallel::ReplicaBatches;
use pipewright::Batch;
use pipewright_models::parity::ParityRun;
use pipewright_models::tasks::Adder;
use pipewright_models::{gpt, GptConfig, Task};

pub const STEPS: u64 = 20;
pub const SAVE_AT: u64 = 10;

pub fn adamw(params: Vec<(String, Var)>) -> pipewright::Result<Box<dyn Optimizer>> {
    Ok(Box::new(AdamW::new(params, AdamWConfig::default())?))
}

pub fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pw-ckpt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// What a run ends with, over all ranks: losses of its steps and every parameter and optimizer
/// tensor by (global name, rank's part).
#[derive(Debug, PartialEq)]
pub struct End {
    pub losses: Vec<f64>,
    pub state: BTreeMap<String, Vec<f32>>,
    pub scale: f64,
}

pub fn cfg(dropout: f64) -> GptConfig {
    GptConfig {
        dropout,
        ..ParityRun::default().gpt
    }
}

pub fn options(layout: Layout, precision: Precision) -> VarunaOptions {
    VarunaOptions {
        loss_scaler: LossScaler::with(1024.0, 3),
        ..ParityRun::default()
            .options(layout)
            .with_spec(|s| s.precision = precision)
    }
}

/// Steps `from..to` at `layout`, after loading `resume` if given, saving into `save` after step
/// `SAVE_AT` if given.
pub fn run(
    c: GptConfig,
    opts: VarunaOptions,
    from: u64,
    to: u64,
    resume: Option<&Path>,
    save: Option<&Path>,
) -> End {
    let layout = opts.topology().unwrap().layout();
    let task = Adder::new(2, 0).unwrap();
    let per_rank = local::run(layout.world(), |comm| {
        let rank = comm.rank();
        let mut v = Varuna::new(&gpt(c)?, Box::new(comm), opts.clone())?;
        v.set_optimizer(adamw)?;
        if let Some(p) = resume {
            assert_eq!(v.load_checkpoint(p)?.step, from);
        }
        let loader = ReplicaBatches::new(
            |s, n| task.batch(s, n).map(|(x, y)| Batch::pair(x, y)),
            opts.spec.batch.global_batch,
            v.coords().dp_rank,
            layout.dp,
            candle_core::Device::Cpu,
        )?;
        let mut losses = Vec::new();
        for s in from..to {
            losses.push(v.step(&loader.batch(s)?)?.loss);
            if s + 1 == SAVE_AT {
                if let Some(root) = save {
                    let dir = v.checkpoint(root, &CheckpointOptions::default())?;
                    assert!(dir.ends_with("step-00000010"), "{}", dir.display());
                }
            }
        }
        let mut state = BTreeMap::new();
        for (n, p) in v.parameters()? {
            state.insert(format!("{n}@{rank}"), flat(&p));
        }
        for (k, t) in v.optimizer().unwrap().state_dict()? {
            state.insert(format!("opt.{k}@{rank}"), flat(&t));
        }
        Ok((losses, state, v.loss_scale()))
    })
    .unwrap();
    let mut end = End {
        losses: per_rank[0].0.clone(),
        state: BTreeMap::new(),
        scale: per_rank[0].2,
    };
    for (_, s, _) in per_rank {
        end.state.extend(s);
    }
    end
}

pub fn flat(t: &Tensor) -> Vec<f32> {
    t.to_dtype(candle_core::DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}
