//! What ranks hold, counted by the allocator (the tests take turns: the counts are per rank
//! number, shared by every test's rank 0).
//! - Loading pretrained weights, each rank reads only its own slices: what a tensor-parallel
//!   rank allocates while it loads a Hugging Face Llama directory is its share of the model,
//!   not the whole model (which a rank that read whole tensors and cut them would hold). The
//!   oracle: the same load on one rank, which must hold the whole model.
//! - A key/value cache grows by its keys and values alone, not the graphs that made them.

use std::path::Path;

use pipewright::distributed::comm::local;
use pipewright::distributed::topology::Layout;
use pipewright::engine::checkpoint::Reader;
use pipewright::engine::varuna::{Varuna, VarunaOptions};
use pipewright::model::nn::optim::OptimizerConfig;
use pipewright::model::KvCache;
use pipewright::runtime::memory::{self, CountingAlloc};
use pipewright::ModelSpec;
use pipewright_models::llama::LlamaConfig;
use pipewright_models::{hf, ModelConfig};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

static TURNS: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn model() -> ModelConfig {
    let llama = LlamaConfig {
        vocab_size: 4096,
        block_size: 64,
        n_layer: 2,
        n_head: 4,
        n_kv_head: 2,
        dim: 256,
        hidden: 768,
        norm_eps: 1e-5,
        rope_theta: 10000.0,
        moe: None,
        head_dim: None,
        qk_norm: false,
    };
    ModelConfig::Llama { llama, vocab: 4096 }
}

/// Per rank of `layout`: the most bytes it held while loading `dir`, above what it held
/// before, and its parameters' bytes.
fn load(dir: &Path, layout: Layout) -> Vec<(u64, u64)> {
    let model = model();
    let (seq, tied) = (model.build().unwrap(), model.tied());
    let opts = VarunaOptions {
        shared_weights: tied,
        ..VarunaOptions::new(layout, 1, 1)
    };
    // The ranks are threads: one barrier between building and loading on all of them.
    let sync = std::sync::Barrier::new(layout.world());
    local::run(layout.world(), |comm| {
        let rank = {
            use pipewright::distributed::comm::Communicator;
            comm.rank()
        };
        let mut v = Varuna::new(&seq, Box::new(comm), opts.clone())?;
        v.set_optimizer(|ps| OptimizerConfig::default().build(ps, &[]))?;
        let own: u64 = v
            .pipeline()
            .params()
            .iter()
            .map(|(_, p)| p.elem_count() as u64 * 4)
            .sum();
        sync.wait();
        let before = memory::thread_live_bytes().unwrap();
        if rank == 0 {
            memory::reset_peaks();
        }
        sync.wait();
        v.load_pretrained(dir, &|n| model.hf_names(n))?;
        Ok((memory::rank_peak_bytes(rank).unwrap() - before, own))
    })
    .unwrap()
}

#[test]
fn a_tensor_parallel_rank_reads_only_its_slices() {
    let _turn = TURNS.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = std::env::temp_dir().join(format!("pw-pre-mem-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    // A Hugging Face directory of a 3.6M-parameter Llama, written by the export.
    let saved = local::run(1, |comm| {
        let seq = model().build()?;
        let mut v = Varuna::new(
            &seq,
            Box::new(comm),
            VarunaOptions::new(Layout::new(1, 1, 1)?, 1, 1),
        )?;
        v.set_optimizer(|ps| OptimizerConfig::default().build(ps, &[]))?;
        v.checkpoint(&tmp.join("ckpt"), &Default::default())?;
        Ok(v.pipeline()
            .params()
            .iter()
            .map(|(_, p)| p.elem_count() as u64 * 4)
            .sum::<u64>())
    })
    .unwrap()[0];
    hf::export(
        &Reader::open(&tmp.join("ckpt")).unwrap(),
        &model(),
        &tmp.join("hf"),
    )
    .unwrap();

    let whole = load(&tmp.join("hf"), Layout::new(1, 1, 1).unwrap());
    let (peak, own) = whole[0];
    assert_eq!(own, saved);
    assert!(
        peak >= own * 9 / 10,
        "one rank loading the whole model held only {peak} bytes of its {own}: the count misses"
    );
    for (rank, (peak, own)) in load(&tmp.join("hf"), Layout::new(1, 2, 1).unwrap())
        .into_iter()
        .enumerate()
    {
        assert!(
            own < saved * 6 / 10,
            "rank {rank} holds {own} of {saved} bytes"
        );
        assert!(
            peak < saved * 6 / 10,
            "tp rank {rank} held {peak} bytes while loading a {saved}-byte model (its share: {own})"
        );
    }
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn the_cache_holds_keys_and_values_only() {
    let _turn = TURNS.lock().unwrap_or_else(|e| e.into_inner());
    for name in ["hf-gpt2", "hf-llama"] {
        let dir = fixture(name);
        let model = hf::config_from_dir(&dir).unwrap();
        let (seq, tied) = (model.build().unwrap(), model.tied());
        let opts = VarunaOptions {
            shared_weights: tied,
            ..VarunaOptions::new(Layout::new(1, 1, 1).unwrap(), 1, 1)
        };
        let (grew, cached) = local::run(1, |comm| {
            let mut v = Varuna::new(&seq, Box::new(comm), opts.clone())?;
            v.set_optimizer(|ps| OptimizerConfig::default().build(ps, &[]))?;
            v.load_pretrained(&dir, &|n| model.hf_names(n))?;
            let block = model.sampling(0)?.block_size;
            let cache = KvCache::with_capacity(block);
            v.predict_tokens(&[1, 2, 3, 4], Some(&cache))?;
            let (live, bytes) = (memory::thread_live_bytes().unwrap(), cache.bytes());
            for t in 4..block as u32 {
                v.predict_tokens(&[t], Some(&cache))?;
            }
            let grew = memory::thread_live_bytes().unwrap() as i64 - live as i64;
            Ok((grew, (cache.bytes() - bytes) as i64))
        })
        .unwrap()[0];
        // The cache's growth, and a little for the allocator's and candle's own.
        assert!(
            grew <= cached + 16 * 1024,
            "{name}: live bytes grew {grew} while the cache grew {cached}"
        );
    }
}
