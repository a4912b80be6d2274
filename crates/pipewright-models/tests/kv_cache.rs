//! The key/value cache: logits computed a token at a time through the cache equal those of the
//! whole sequence in one forward (the oracle: the model without a cache), for the fixture GPT-2
//! and Llama (grouped-query attention, rotary positions from the cache's offset) on 1 x 1, tp 2
//! and pp 2 x tp 2; generation gives the same tokens with and without it, also once the context
//! slides past the model's window; a sequence past the window through the cache is an error.
//! (What a cache holds, counted by the allocator: `held_bytes.rs`.)

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use pipewright::distributed::comm::local;
use pipewright::distributed::topology::Layout;
use pipewright::engine::varuna::{Varuna, VarunaOptions};
use pipewright::model::nn::max_rel_diff;
use pipewright::model::nn::optim::OptimizerConfig;
use pipewright::model::KvCache;
use pipewright::Batch;
use pipewright::ModelSpec;
use pipewright_models::{hf, ModelConfig};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// Runs `f` on every rank of `layout` with the fixture model `name` loaded; rank 0's result.
fn with_model<R: Send>(
    name: &str,
    layout: Layout,
    f: impl Fn(&Varuna, &ModelConfig) -> pipewright::Result<R> + Sync,
) -> R {
    let dir = fixture(name);
    let model = hf::config_from_dir(&dir).unwrap();
    let (seq, tied) = (model.build().unwrap(), model.tied());
    let opts = VarunaOptions {
        shared_weights: tied,
        ..VarunaOptions::new(layout, 1, 1)
    };
    let mut out = local::run(layout.world(), |comm| {
        let mut v = Varuna::new(&seq, Box::new(comm), opts.clone())?;
        v.set_optimizer(|ps| OptimizerConfig::default().build(ps, &[]))?;
        v.load_pretrained(&dir, &|n| model.hf_names(n))?;
        f(&v, &model)
    })
    .unwrap();
    out.remove(0)
}

fn layouts() -> [Layout; 3] {
    [
        Layout::new(1, 1, 1).unwrap(),
        Layout::new(1, 2, 1).unwrap(),
        Layout::new(2, 2, 1).unwrap(),
    ]
}

#[test]
fn cached_logits_equal_the_whole_sequence_forward() {
    for name in ["hf-gpt2", "hf-llama"] {
        for layout in layouts() {
            let (whole, stepped, bytes) = with_model(name, layout, |v, model| {
                let window = model.sampling(0)?;
                let (block, vocab) = (window.block_size, window.vocab);
                let ids: Vec<u32> = (0..block as u32)
                    .map(|i| (i * 7 + 3) % vocab as u32)
                    .collect();
                let x = Tensor::from_vec(ids.clone(), (1, ids.len()), &Device::Cpu)?;
                let whole = v.predict(&Batch::new().with(Batch::INPUTS, x))?;
                // A prompt of 5, then one token at a time.
                let cache = KvCache::with_capacity(block);
                let mut parts = vec![v.predict_tokens(&ids[..5], Some(&cache))?];
                for i in 5..ids.len() {
                    parts.push(v.predict_tokens(&ids[i..i + 1], Some(&cache))?);
                }
                assert_eq!(cache.past(), block);
                // The window is full: one more token through the cache is a clear error.
                let err = v.predict_tokens(&ids[..1], Some(&cache)).unwrap_err();
                assert!(err.to_string().contains("block_size"), "{err}");
                Ok((whole, Tensor::cat(&parts, 1)?, cache.bytes()))
            });
            let e = max_rel_diff(&stepped, &whole).unwrap();
            assert!(e < 1e-5, "{name} at {layout}: relative error {e:e}");
            assert!(bytes > 0, "{name} at {layout}: nothing was cached");
        }
    }
}

#[test]
fn generation_is_the_same_with_and_without_the_cache() {
    for name in ["hf-gpt2", "hf-llama"] {
        for layout in layouts() {
            let (cached, uncached, sampled) = with_model(name, layout, |v, model| {
                // To the last learned position (GPT-2), past the block size (the Llama's
                // rotary positions go on, as transformers' do).
                let prompt = [1, 2, 3, 4, 5];
                let s = model.sampling(0)?;
                let new = match s.extends {
                    true => s.block_size + 6,
                    false => s.block_size - prompt.len(),
                };
                let mut s = model.sampling(new)?;
                if !s.extends {
                    let mut past = s;
                    past.max_new_tokens += 1;
                    let e = v.generate(&prompt, &past).unwrap_err().to_string();
                    assert!(e.contains("learned positions"), "{e}");
                }
                let cached = v.generate(&prompt, &s)?;
                s.use_cache = false;
                let uncached = v.generate(&prompt, &s)?;
                s.temperature = 1.0;
                s.top_k = Some(5);
                s.seed = 3;
                let a = v.generate(&prompt, &s)?;
                s.use_cache = true;
                let b = v.generate(&prompt, &s)?;
                Ok((cached, uncached, (a, b)))
            });
            assert_eq!(cached, uncached, "{name} at {layout}: greedy");
            assert_eq!(sampled.0, sampled.1, "{name} at {layout}: sampled");
        }
    }
}
