//! n-digit addition (minGPT's adder): tokens are digits; a sequence is `a` and `b` written
//! with n digits each, then their sum's n+1 digits reversed (least significant first, which
//! is how the carry flows). Loss only on the sum. Metric: exact-match accuracy of greedily
//! decoded sums on held-out problems that training never draws.

use std::collections::HashSet;

use candle_core::Tensor;
use pipewright::runtime::seed::rng_for;
use pipewright::{invalid, Result};
use rand::Rng;

use super::{greedy, lm_pair, Predict, Task, TaskShape};

/// n-digit addition as tokens (see the module's text): the model writes the sum; exact match on
/// held-out problems is the metric.
pub struct Adder {
    digits: usize,
    seed: u64,
    test: Vec<(u64, u64)>,
    test_set: HashSet<(u64, u64)>,
}

impl Adder {
    /// Holds out min(1000, 10 %) of all problems.
    pub fn new(digits: usize, seed: u64) -> Result<Self> {
        if !(1..=9).contains(&digits) {
            return Err(invalid!(
                "adder --digits must be between 1 and 9, got {digits}"
            ));
        }
        let max = 10u64.pow(digits as u32);
        let total = max * max;
        let n_test = (total / 10).clamp(1, 1000) as usize;
        let mut rng = rng_for(seed, "adder/test");
        let mut test_set = HashSet::new();
        let mut test = Vec::new();
        while test.len() < n_test {
            let p = (rng.random_range(0..max), rng.random_range(0..max));
            if test_set.insert(p) {
                test.push(p);
            }
        }
        Ok(Self {
            digits,
            seed,
            test,
            test_set,
        })
    }

    fn encode(&self, a: u64, b: u64) -> Vec<u32> {
        let n = self.digits;
        let mut s = digits_of(a, n);
        s.extend(digits_of(b, n));
        let mut c = digits_of(a + b, n + 1);
        c.reverse();
        s.extend(c);
        s
    }

    /// The held-out problems `(a, b)`.
    pub fn held_out(&self) -> &[(u64, u64)] {
        &self.test
    }
}

fn digits_of(v: u64, n: usize) -> Vec<u32> {
    let s = format!("{v:0n$}");
    s.bytes().map(|b| (b - b'0') as u32).collect()
}

impl Task for Adder {
    fn name(&self) -> &'static str {
        "adder"
    }

    fn shape(&self) -> TaskShape {
        TaskShape::Tokens {
            vocab: 10,
            seq_len: 3 * self.digits,
        }
    }

    fn metric_name(&self) -> &'static str {
        "accuracy"
    }

    fn higher_is_better(&self) -> bool {
        true
    }

    fn batch(&self, step: u64, batch_size: usize) -> Result<(Tensor, Tensor)> {
        let mut rng = rng_for(self.seed, &format!("adder/batch/{step}"));
        let max = 10u64.pow(self.digits as u32);
        let seqs: Vec<Vec<u32>> = (0..batch_size)
            .map(|_| loop {
                let p = (rng.random_range(0..max), rng.random_range(0..max));
                if !self.test_set.contains(&p) {
                    break self.encode(p.0, p.1);
                }
            })
            .collect();
        lm_pair(&seqs, 2 * self.digits - 1)
    }

    fn evaluate(&self, predict: &mut Predict<'_>) -> Result<f64> {
        let n = self.digits;
        let mut correct = 0;
        for chunk in self.test.chunks(500) {
            let prompts: Vec<Vec<u32>> = chunk
                .iter()
                .map(|&(a, b)| self.encode(a, b)[..2 * n].to_vec())
                .collect();
            let out = greedy(predict, &prompts, n + 1)?;
            for (&(a, b), got) in chunk.iter().zip(out) {
                if got == self.encode(a, b)[2 * n..] {
                    correct += 1;
                }
            }
        }
        Ok(correct as f64 / self.test.len() as f64)
    }
}
