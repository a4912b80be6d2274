//! Byte-level language modelling over any text file. The last 10 % of the bytes are held out;
//! the metric is bits per byte (mean cross-entropy / ln 2) on windows of that part.

use std::path::Path;

use candle_core::{Device, Tensor};
use pipewright::model::nn::cross_entropy;
use pipewright::runtime::seed::rng_for;
use pipewright::{invalid, Error, Result};
use rand::Rng;

use super::{Predict, Task, TaskShape};

/// Byte-level language modelling of a text (the last tenth held out): bits per byte is the metric.
pub struct Text {
    train: Vec<u8>,
    valid: Vec<u8>,
    seq_len: usize,
    seed: u64,
}

impl Text {
    /// The text of the file at `path` in windows of `seq_len` bytes.
    pub fn from_file(path: &Path, seq_len: usize, seed: u64) -> Result<Self> {
        let bytes =
            std::fs::read(path).map_err(|e| Error::io("cannot read --data file", path, e))?;
        if bytes.is_empty() {
            return Err(invalid!(
                "--data file `{}` is empty: give a text file to learn from",
                path.display()
            ));
        }
        Self::from_bytes(bytes, seq_len, seed)
            .map_err(|e| invalid!("--data file `{}`: {e}", path.display()))
    }

    /// The text `bytes` in windows of `seq_len` bytes.
    pub fn from_bytes(bytes: Vec<u8>, seq_len: usize, seed: u64) -> Result<Self> {
        if seq_len == 0 {
            return Err(invalid!("sequence length must be positive"));
        }
        let n_valid = (bytes.len() / 10).max(seq_len + 1);
        if bytes.len() < n_valid + seq_len + 1 {
            return Err(invalid!(
                "{} bytes are too few for windows of {seq_len}: need at least {} (or lower --block-size)",
                bytes.len(),
                n_valid + seq_len + 1
            ));
        }
        let split = bytes.len() - n_valid;
        Ok(Self {
            train: bytes[..split].to_vec(),
            valid: bytes[split..].to_vec(),
            seq_len,
            seed,
        })
    }

    fn windows(data: &[u8], starts: &[usize], t: usize) -> Result<(Tensor, Tensor)> {
        let b = starts.len();
        let mut x = Vec::with_capacity(b * t);
        let mut y = Vec::with_capacity(b * t);
        for &s in starts {
            x.extend(data[s..s + t].iter().map(|&v| v as u32));
            y.extend(data[s + 1..s + t + 1].iter().map(|&v| v as i64));
        }
        Ok((
            Tensor::from_vec(x, (b, t), &Device::Cpu)?,
            Tensor::from_vec(y, (b, t), &Device::Cpu)?,
        ))
    }
}

impl Task for Text {
    fn name(&self) -> &'static str {
        "text"
    }

    fn shape(&self) -> TaskShape {
        TaskShape::Tokens {
            vocab: 256,
            seq_len: self.seq_len,
        }
    }

    fn metric_name(&self) -> &'static str {
        "bits_per_byte"
    }

    fn higher_is_better(&self) -> bool {
        false
    }

    fn batch(&self, step: u64, batch_size: usize) -> Result<(Tensor, Tensor)> {
        let mut rng = rng_for(self.seed, &format!("text/batch/{step}"));
        let hi = self.train.len() - self.seq_len - 1;
        let starts: Vec<usize> = (0..batch_size).map(|_| rng.random_range(0..=hi)).collect();
        Self::windows(&self.train, &starts, self.seq_len)
    }

    fn evaluate(&self, predict: &mut Predict<'_>) -> Result<f64> {
        let t = self.seq_len;
        let hi = self.valid.len() - t - 1;
        let n = (hi / t + 1).min(64);
        let starts: Vec<usize> = (0..n)
            .map(|i| if n > 1 { i * hi / (n - 1) } else { 0 })
            .collect();
        let mut total = 0.0;
        for chunk in starts.chunks(16) {
            let (x, y) = Self::windows(&self.valid, chunk, t)?;
            let loss = cross_entropy(&predict(&x)?, &y)?.to_scalar::<f32>()? as f64;
            total += loss * chunk.len() as f64;
        }
        Ok(total / n as f64 / std::f64::consts::LN_2)
    }
}
