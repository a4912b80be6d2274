//! What a V schedule holds, counted by the allocator: at pp 4 and 8 micro-batches, a GPT of 8
//! blocks whose activations outweigh its weights, two blocks per 1F1B stage and one per ZB-V
//! stage (the embedding and the head ride with the first and last block). Each rank's peak
//! during a step, above what it held when the step began, against the simulator's count of the
//! blocks' micro-batches the rank holds at once (`peak_in_flight` x blocks per stage): 1F1B
//! holds 8, 6, 4 and 2 (rank r: 4 - r micro-batches of 2 blocks), ZB-V 8 on every rank (8 of
//! its half stages). Run with `--nocapture` for the table BENCHMARKS.md quotes.

use candle_core::{Device, Tensor};
use pipewright::distributed::comm::local;
use pipewright::distributed::topology::Layout;
use pipewright::engine::spec::{Balance, TrainSpec};
use pipewright::engine::varuna::{Varuna, VarunaOptions};
use pipewright::model::nn::optim::{AdamW, AdamWConfig, Optimizer};
use pipewright::parallel::pipeline::schedule::{Schedule, ScheduleKind};
use pipewright::runtime::memory::{self, CountingAlloc};
use pipewright::Batch;
use pipewright_models::{gpt, GptConfig, TIED};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

const PP: usize = 4;
const CHUNKS: usize = 8;
const T: usize = 128;

fn model() -> GptConfig {
    GptConfig {
        vocab_size: 16,
        block_size: T,
        n_layer: 8,
        n_head: 4,
        n_embd: 32,
        dropout: 0.0,
    }
}

fn batch() -> Batch {
    let ids = |shift: usize| -> Tensor {
        let v: Vec<u32> = (0..CHUNKS * T)
            .map(|i| ((i * 7 + shift) % 16) as u32)
            .collect();
        Tensor::from_vec(v, (CHUNKS, T), &Device::Cpu).unwrap()
    };
    Batch::pair(ids(0), ids(7))
}

fn adamw(params: Vec<(String, candle_core::Var)>) -> pipewright::Result<Box<dyn Optimizer>> {
    Ok(Box::new(AdamW::new(params, AdamWConfig::default())?))
}

/// Per rank: the most bytes it held during a step above what it held as the step began (the
/// second step, so the optimizer's state is there before).
fn step_peaks(kind: ScheduleKind, balance: Vec<usize>) -> Vec<u64> {
    let opts = VarunaOptions {
        shared_weights: vec![(TIED.0.into(), TIED.1.into())],
        ..VarunaOptions::of(TrainSpec {
            pipeline: pipewright::parallel::pipeline::PipelineSpec {
                schedule: pipewright::parallel::pipeline::ScheduleChoice {
                    kind,
                    ..Default::default()
                },
                balance: Some(Balance::Layers(balance)),
                ..Default::default()
            },
            ..TrainSpec::new(Layout::new(PP, 1, 1).unwrap(), CHUNKS, 1, 2)
        })
    };
    let seq = gpt(model()).unwrap();
    local::run(PP, |comm| {
        let mut v = Varuna::new(&seq, Box::new(comm), opts.clone())?;
        v.set_optimizer(adamw)?;
        v.step(&batch())?;
        let before = memory::reset_thread_peak().unwrap_or(0);
        v.step(&batch())?;
        Ok(memory::thread_peak_bytes().unwrap_or(0) - before)
    })
    .unwrap()
}

#[test]
fn zbv_holds_on_every_rank_what_1f1b_holds_on_its_first() {
    let runs = [
        (ScheduleKind::OneFOneB, vec![3, 2, 2, 3], 2),
        (ScheduleKind::ZeroBubbleH1, vec![3, 2, 2, 3], 2),
        (ScheduleKind::GPipe, vec![3, 2, 2, 3], 2),
        (ScheduleKind::ZeroBubbleV, vec![2, 1, 1, 1, 1, 1, 1, 2], 1),
    ];
    let mut peaks = Vec::new();
    for (kind, balance, blocks) in runs {
        let sim = Schedule::new(kind, PP, CHUNKS, 1)
            .unwrap()
            .validate()
            .unwrap();
        let held: Vec<usize> = sim.peak_in_flight.iter().map(|n| n * blocks).collect();
        let got = step_peaks(kind, balance);
        let mib: Vec<String> = got
            .iter()
            .map(|b| format!("{:.2}", *b as f64 / (1 << 20) as f64))
            .collect();
        println!("| {kind} | {held:?} | {} |", mib.join(", "));
        // Fewer blocks' micro-batches held, fewer bytes.
        for i in 0..PP {
            for j in (0..PP).filter(|&j| held[i] > held[j]) {
                assert!(got[i] > got[j], "{kind}: {held:?} held, {got:?} bytes");
            }
        }
        peaks.push(got);
    }
    let max = |v: &[u64]| *v.iter().max().unwrap() as f64;
    let min = |v: &[u64]| *v.iter().min().unwrap() as f64;
    let (one, zb1, zbv) = (&peaks[0], &peaks[1], &peaks[3]);
    // ZB-V's busiest rank holds about what 1F1B's first does (a split backward keeps the
    // inputs and output gradients its weight passes need a little longer), its least busy
    // nearly as much, and every rank what ZB-H1's first holds (the same 8 block micro-batches).
    assert!(max(zbv) < 1.15 * max(one), "{peaks:?}");
    assert!(min(zbv) > 0.85 * max(zbv), "{peaks:?}");
    assert!((max(zbv) / zb1[0] as f64 - 1.0).abs() < 0.1, "{peaks:?}");
}
