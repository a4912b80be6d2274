//! Language modelling on a user's corpus, prepared into token shards (`pipewright data
//! prepare`, [`pipewright::data::prepare`]), or on several blended by weight ([`Blend`]):
//! training windows whose rows depend only on the step and the seed, and the held-out
//! perplexity as the metric (of each dataset's held-out split, blended by weight).

use std::path::PathBuf;

use pipewright::data::{Blend, Split, TokenDataset};
use pipewright::model::nn::cross_entropy;
use pipewright::{invalid, Result};

use super::{Predict, Task, TaskShape};

/// Held-out windows an evaluation reads at most.
const EVAL_WINDOWS: u64 = 64;

/// Next-token prediction over token shards; the metric is held-out perplexity.
pub struct Tokens {
    data: Blend,
    seq_len: usize,
    seed: u64,
}

impl Tokens {
    /// The shards of the directories `parts` (weight, directory; one of weight 1 for a
    /// single dataset) in windows of `seq_len` ids.
    pub fn open(parts: &[(f64, PathBuf)], seq_len: usize, seed: u64) -> Result<Self> {
        let data = Blend::open(parts)?;
        for (_, d) in data.sources() {
            for split in [Split::Train, Split::Valid] {
                if d.windows(split, seq_len) == 0 {
                    return Err(invalid!(
                        "the {split:?} split of `{}` holds {} ids, too few for one window of \
                         {seq_len}: lower --block-size or prepare more text",
                        d.dir().display(),
                        d.tokens(split)
                    ));
                }
            }
        }
        Ok(Self {
            data,
            seq_len,
            seed,
        })
    }

    /// The shards (the first dataset of a blend).
    pub fn dataset(&self) -> &TokenDataset {
        self.data.first()
    }

    /// The datasets and their weights.
    pub fn blend(&self) -> &Blend {
        &self.data
    }

    /// The mean held-out loss of `data` over up to 64 windows spread over its held-out split.
    fn held_out_loss(&self, data: &TokenDataset, predict: &mut Predict<'_>) -> Result<f64> {
        let n = data.windows(Split::Valid, self.seq_len);
        let k = n.min(EVAL_WINDOWS);
        let windows: Vec<u64> = (0..k).map(|i| i * n / k).collect();
        let mut total = 0.0;
        for chunk in windows.chunks(16) {
            let (x, y) = data.tensors(Split::Valid, chunk, self.seq_len)?;
            let loss = cross_entropy(&predict(&x)?, &y)?.to_scalar::<f32>()? as f64;
            total += loss * chunk.len() as f64;
        }
        Ok(total / k as f64)
    }
}

impl Task for Tokens {
    fn name(&self) -> &'static str {
        "tokens"
    }

    fn shape(&self) -> TaskShape {
        TaskShape::Tokens {
            vocab: self.data.first().index().vocab_size,
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

    /// exp of the held-out loss: each dataset's mean over up to 64 windows spread over its
    /// held-out split, blended by the datasets' weights.
    fn evaluate(&self, predict: &mut Predict<'_>) -> Result<f64> {
        Ok(self.evaluate_parts(predict)?.0)
    }

    /// With a blend, each dataset's own held-out perplexity too, named by its directory.
    fn evaluate_parts(&self, predict: &mut Predict<'_>) -> Result<(f64, Vec<(String, f64)>)> {
        let (mut loss, mut parts) = (0.0, Vec::new());
        for (w, d) in self.data.sources() {
            let l = self.held_out_loss(d, predict)?;
            loss += w * l;
            let name = d.dir().file_name().map_or_else(
                || d.dir().display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            );
            parts.push((name, l.exp()));
        }
        if parts.len() < 2 {
            parts.clear();
        }
        Ok((loss.exp(), parts))
    }
}
