//! Sequence sorting (minGPT's sort task): `len` symbols from `0..symbols`, then the same symbols
//! sorted. Loss only on the sorted half. A quarter of all sequences (chosen by a hash) are held
//! out; the metric is exact-match accuracy of greedily decoded sorted sequences on them.

use candle_core::Tensor;
use pipewright::runtime::seed::hash_seed;
use pipewright::runtime::seed::rng_for;
use pipewright::{invalid, Result};
use rand::Rng;

use super::{greedy, lm_pair, Predict, Task, TaskShape};

/// Sequences of `len` symbols to sort: the model writes them back in order; exact match on held-out
/// sequences is the metric.
pub struct Sort {
    len: usize,
    symbols: u32,
    seed: u64,
    test: Vec<Vec<u32>>,
}

fn is_test(seq: &[u32]) -> bool {
    let bytes: Vec<u8> = seq.iter().map(|&v| v as u8).collect();
    hash_seed(&[b"sort", &bytes]).is_multiple_of(4)
}

impl Sort {
    /// Sequences of `len` symbols out of `symbols`, drawn from `seed`.
    pub fn new(len: usize, symbols: u32, seed: u64) -> Result<Self> {
        if len < 2 || symbols < 2 {
            return Err(invalid!("sort needs length >= 2 and >= 2 symbols"));
        }
        // Up to 512 held-out sequences drawn deterministically.
        let mut rng = rng_for(seed, "sort/test");
        let total = (symbols as f64).powi(len as i32);
        let want = ((total / 4.0) as usize).clamp(1, 512);
        let mut test: Vec<Vec<u32>> = Vec::new();
        let mut tries = 0;
        while test.len() < want && tries < 100_000 {
            tries += 1;
            let s: Vec<u32> = (0..len).map(|_| rng.random_range(0..symbols)).collect();
            if is_test(&s) && !test.contains(&s) {
                test.push(s);
            }
        }
        if test.is_empty() {
            return Err(invalid!(
                "sort: no held-out sequences for length {len}, {symbols} symbols"
            ));
        }
        Ok(Self {
            len,
            symbols,
            seed,
            test,
        })
    }

    fn encode(s: &[u32]) -> Vec<u32> {
        let mut sorted = s.to_vec();
        sorted.sort_unstable();
        let mut out = s.to_vec();
        out.extend(sorted);
        out
    }
}

impl Task for Sort {
    fn name(&self) -> &'static str {
        "sort"
    }

    fn shape(&self) -> TaskShape {
        TaskShape::Tokens {
            vocab: self.symbols as usize,
            seq_len: 2 * self.len - 1,
        }
    }

    fn metric_name(&self) -> &'static str {
        "accuracy"
    }

    fn higher_is_better(&self) -> bool {
        true
    }

    fn batch(&self, step: u64, batch_size: usize) -> Result<(Tensor, Tensor)> {
        let mut rng = rng_for(self.seed, &format!("sort/batch/{step}"));
        let seqs: Vec<Vec<u32>> = (0..batch_size)
            .map(|_| loop {
                let s: Vec<u32> = (0..self.len)
                    .map(|_| rng.random_range(0..self.symbols))
                    .collect();
                if !is_test(&s) {
                    break Self::encode(&s);
                }
            })
            .collect();
        lm_pair(&seqs, self.len - 1)
    }

    fn evaluate(&self, predict: &mut Predict<'_>) -> Result<f64> {
        let out = greedy(predict, &self.test, self.len)?;
        let correct = self
            .test
            .iter()
            .zip(out)
            .filter(|(s, got)| Self::encode(s)[self.len..] == got[..])
            .count();
        Ok(correct as f64 / self.test.len() as f64)
    }
}
