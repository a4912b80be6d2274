//! Language modelling on a user's corpus, prepared into token shards (`pipewright data
//! prepare`, [`pipewright::data::prepare`]): training windows from [`TokenDataset`] (a step's
//! rows depend only on the step and the seed), and the held-out split's perplexity as the
//! metric.

use std::path::Path;

use pipewright::data::{Split, TokenDataset};
use pipewright::model::nn::cross_entropy;
use pipewright::{invalid, Result};

use super::{Predict, Task, TaskShape};

/// Held-out windows an evaluation reads at most.
const EVAL_WINDOWS: u64 = 64;

/// Next-token prediction over token shards; the metric is held-out perplexity.
pub struct Tokens {
    data: TokenDataset,
    seq_len: usize,
    seed: u64,
}

impl Tokens {
    /// The shards in `dir` in windows of `seq_len` ids.
    pub fn open(dir: &Path, seq_len: usize, seed: u64) -> Result<Self> {
        let data = TokenDataset::open(dir, None)?;
        for split in [Split::Train, Split::Valid] {
            if data.windows(split, seq_len) == 0 {
                return Err(invalid!(
                    "the {split:?} split of `{}` holds {} ids, too few for one window of \
                     {seq_len}: lower --block-size or prepare more text",
                    dir.display(),
                    data.tokens(split)
                ));
            }
        }
        Ok(Self {
            data,
            seq_len,
            seed,
        })
    }

    /// The shards.
    pub fn dataset(&self) -> &TokenDataset {
        &self.data
    }
}

impl Task for Tokens {
    fn name(&self) -> &'static str {
        "tokens"
    }

    fn shape(&self) -> TaskShape {
        TaskShape::Tokens {
            vocab: self.data.index().vocab_size,
            seq_len: self.seq_len,
        }
    }

    fn metric_name(&self) -> &'static str {
        "perplexity"
    }

    fn higher_is_better(&self) -> bool {
        false
    }

    fn batch(
        &self,
        step: u64,
        batch_size: usize,
    ) -> Result<(candle_core::Tensor, candle_core::Tensor)> {
        self.data.batch(step, batch_size, self.seq_len, self.seed)
    }

    /// exp of the mean held-out loss over up to 64 windows spread over the held-out split.
    fn evaluate(&self, predict: &mut Predict<'_>) -> Result<f64> {
        let n = self.data.windows(Split::Valid, self.seq_len);
        let k = n.min(EVAL_WINDOWS);
        let windows: Vec<u64> = (0..k).map(|i| i * n / k).collect();
        let mut total = 0.0;
        for chunk in windows.chunks(16) {
            let (x, y) = self.data.tensors(Split::Valid, chunk, self.seq_len)?;
            let loss = cross_entropy(&predict(&x)?, &y)?.to_scalar::<f32>()? as f64;
            total += loss * chunk.len() as f64;
        }
        Ok((total / k as f64).exp())
    }
}
