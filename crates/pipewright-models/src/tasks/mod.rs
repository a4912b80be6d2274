//! Tasks generated in process: same seed, same data. A task gives training batches as a pure
//! function of (seed, step) and evaluates a model on held-out examples it never trains on.

mod adder;
mod shapes;
mod sort;
mod text;
mod tokens;

pub use adder::Adder;
pub use shapes::Shapes;
pub use sort::Sort;
pub use text::Text;
pub use tokens::Tokens;

use candle_core::{DType, Device, Tensor};
use pipewright::model::nn::IGNORE_INDEX;
use pipewright::Result;

/// What the model sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskShape {
    /// Token ids `(batch, seq_len)` in `0..vocab`, targets `(batch, seq_len)`.
    Tokens {
        /// Token ids run from 0 to this.
        vocab: usize,
        /// Tokens per sequence.
        seq_len: usize,
    },
    /// Images `(batch, channels, size, size)`, targets `(batch)` class ids.
    Images {
        /// Channels per image.
        channels: usize,
        /// Height and width.
        size: usize,
        /// Classes.
        classes: usize,
    },
}

impl TaskShape {
    /// The dims of one input sample: `[seq_len]` tokens, `[channels, size, size]` pixels (what
    /// a model's shapes are sized for, [`pipewright::ModelSpec::shapes`]).
    pub fn sample(&self) -> Vec<usize> {
        match *self {
            TaskShape::Tokens { seq_len, .. } => vec![seq_len],
            TaskShape::Images { channels, size, .. } => vec![channels, size, size],
        }
    }
}

/// A forward function in evaluation mode: inputs to logits.
pub type Predict<'a> = dyn FnMut(&Tensor) -> Result<Tensor> + 'a;

/// A task: training batches made in process from a seed, and a held-out metric of a model's
/// predictions.
pub trait Task: Send + Sync {
    /// The task's name (`adder`, `sort`, `text`, `shapes`, `tokens`).
    fn name(&self) -> &'static str;
    /// What the model sees.
    fn shape(&self) -> TaskShape;
    /// Name of the metric [`Task::evaluate`] returns (`accuracy`, `bits_per_byte`).
    fn metric_name(&self) -> &'static str;
    /// Whether a larger metric is better.
    fn higher_is_better(&self) -> bool;
    /// Training batch number `step`: (inputs, targets), deterministic for the task's seed.
    fn batch(&self, step: u64, batch_size: usize) -> Result<(Tensor, Tensor)>;
    /// The metric on the held-out examples.
    fn evaluate(&self, predict: &mut Predict<'_>) -> Result<f64>;
    /// The metric and its parts by name (a blend's held-out perplexity of each dataset); the
    /// metric alone by default.
    fn evaluate_parts(&self, predict: &mut Predict<'_>) -> Result<(f64, Vec<(String, f64)>)> {
        Ok((self.evaluate(predict)?, Vec::new()))
    }
}

/// Bytes of logits one forward of [`greedy`] may make: rows are decoded in groups that fit
/// (all the held-out rows at once made 8 GB of logits with a vocabulary of a million).
const LOGIT_BYTES: usize = 64 << 20;

/// Greedy decoding of `n` tokens after each prompt row; returns the generated tokens. Rows are
/// decoded in groups whose logits fit in 64 MiB (the first group is one row, which
/// tells the vocabulary's size).
pub fn greedy(predict: &mut Predict<'_>, prompts: &[Vec<u32>], n: usize) -> Result<Vec<Vec<u32>>> {
    let mut seqs = prompts.to_vec();
    let mut vocab: Option<usize> = None;
    for _ in 0..n {
        let t = seqs[0].len();
        let mut next = Vec::with_capacity(seqs.len());
        while next.len() < seqs.len() {
            let rows = vocab.map_or(1, |v| (LOGIT_BYTES / (t * v * 4).max(1)).max(1));
            let group = &seqs[next.len()..(next.len() + rows).min(seqs.len())];
            let flat: Vec<u32> = group.iter().flatten().copied().collect();
            let x = Tensor::from_vec(flat, (group.len(), t), &Device::Cpu)?;
            let logits = predict(&x)?;
            vocab = Some(logits.dim(2)?);
            let last = logits
                .narrow(1, t - 1, 1)?
                .squeeze(1)?
                .argmax(1)?
                .to_dtype(DType::U32)?;
            next.extend(last.to_vec1::<u32>()?);
        }
        for (s, v) in seqs.iter_mut().zip(next) {
            s.push(v);
        }
    }
    Ok(seqs
        .into_iter()
        .map(|s| s[s.len() - n..].to_vec())
        .collect())
}

/// Builds (inputs, targets) from full sequences: inputs drop the last token, targets drop the
/// first and ignore the first `ignore` target positions (the prompt).
pub fn lm_pair(seqs: &[Vec<u32>], ignore: usize) -> Result<(Tensor, Tensor)> {
    let b = seqs.len();
    let t = seqs[0].len() - 1;
    let mut x = Vec::with_capacity(b * t);
    let mut y = Vec::with_capacity(b * t);
    for s in seqs {
        x.extend_from_slice(&s[..t]);
        for (i, &v) in s[1..].iter().enumerate() {
            y.push(if i < ignore { IGNORE_INDEX } else { v as i64 });
        }
    }
    Ok((
        Tensor::from_vec(x, (b, t), &Device::Cpu)?,
        Tensor::from_vec(y, (b, t), &Device::Cpu)?,
    ))
}
