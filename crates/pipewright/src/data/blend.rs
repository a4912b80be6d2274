//! Prepared datasets blended by weight (Megatron's `--data-path 0.7 A 0.3 B`, torchtitan's
//! dataset mixtures): row `g` of the run goes to the source whose share so far lags its weight
//! the most (Megatron's `build_blending_indices`: after any number of rows each source's count
//! is within one row of its weight's share, ties to the first source), so a row's source
//! depends on its number alone; it is that source's `k`-th row, for which the source keeps
//! its own epochs and shuffle ([`TokenDataset::row_window`]), the first source with the run's
//! seed as an unblended run reads it. Every layout and a resumed run read the same rows.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use candle_core::Tensor;

use super::dataset::{pair_tensors, Split, TokenDataset};
use crate::{invalid, Result};

/// Where the assignment of rows to sources has got to: the next row and each source's count
/// so far.
struct Assigned {
    next: u64,
    counts: Vec<u64>,
}

/// Several token datasets read by weight.
pub struct Blend {
    sources: Vec<(f64, TokenDataset)>,
    assigned: Mutex<Assigned>,
}

impl Blend {
    /// Opens the shard directories of `parts` (weight, directory): the weights positive (they
    /// are normalized), the shards encoded by one tokenizer.
    pub fn open(parts: &[(f64, PathBuf)]) -> Result<Self> {
        if parts.is_empty() {
            return Err(invalid!("a blend needs at least one dataset"));
        }
        if let Some((w, d)) = parts.iter().find(|(w, _)| !(w.is_finite() && *w > 0.0)) {
            return Err(invalid!(
                "the weight of `{}` is {w}: give every dataset a positive weight",
                d.display()
            ));
        }
        // Scaled by the largest first: weights near f64's range (1e308 each) would sum to
        // infinity and every share to 0.
        let max = parts.iter().map(|(w, _)| *w).fold(0.0, f64::max);
        let sum: f64 = parts.iter().map(|(w, _)| w / max).sum();
        if let Some((w, d)) = parts.iter().find(|(w, _)| w / max / sum == 0.0) {
            return Err(invalid!(
                "the weight of `{}` ({w}) is too small beside the largest ({max}) for any row \
                 to be read from it: give weights within a factor of 1e300 of each other",
                d.display()
            ));
        }
        let sources = parts
            .iter()
            .map(|(w, d)| Ok((w / max / sum, TokenDataset::open(d, None)?)))
            .collect::<Result<Vec<_>>>()?;
        let first = &sources[0].1;
        for (_, s) in &sources[1..] {
            if s.index().tokenizer_sha256 != first.index().tokenizer_sha256 {
                return Err(invalid!(
                    "`{}` and `{}` were encoded by different tokenizers: a blend's datasets \
                     must share one (prepare them with the same tokenizer.json)",
                    first.dir().display(),
                    s.dir().display()
                ));
            }
        }
        let n = sources.len();
        Ok(Self {
            sources,
            assigned: Mutex::new(Assigned {
                next: 0,
                counts: vec![0; n],
            }),
        })
    }

    /// The datasets and their normalized weights.
    pub fn sources(&self) -> impl Iterator<Item = (f64, &TokenDataset)> {
        self.sources.iter().map(|(w, d)| (*w, d))
    }

    /// The first dataset (its index: the vocabulary, the tokenizer).
    pub fn first(&self) -> &TokenDataset {
        &self.sources[0].1
    }

    /// The directories, in order.
    pub fn dirs(&self) -> Vec<&Path> {
        self.sources.iter().map(|(_, d)| d.dir()).collect()
    }

    /// (source, the source's row number) of rows `first .. first + n` of the run.
    pub fn assign(&self, first: u64, n: usize) -> Vec<(usize, u64)> {
        let mut a = self.assigned.lock().unwrap_or_else(|e| e.into_inner());
        if first < a.next {
            (a.next, a.counts) = (0, vec![0; self.sources.len()]);
        }
        let mut out = Vec::with_capacity(n);
        while a.next < first + n as u64 {
            let g = a.next;
            // The source lagging its share the most after this row.
            let s = (0..self.sources.len())
                .map(|s| (s, self.sources[s].0 * (g + 1) as f64 - a.counts[s] as f64))
                .fold((0, f64::MIN), |b, x| if x.1 > b.1 { x } else { b })
                .0;
            if g >= first {
                out.push((s, a.counts[s]));
            }
            a.counts[s] += 1;
            a.next += 1;
        }
        out
    }

    /// (source, window index in the source's training split) of each of the `rows` rows of
    /// global batch `step`: what [`Blend::batch`] reads, and `data windows` lists.
    pub fn rows(
        &self,
        step: u64,
        rows: usize,
        block: usize,
        seed: u64,
    ) -> Result<Vec<(usize, u64)>> {
        self.assign(step * rows as u64, rows)
            .into_iter()
            .map(|(s, k)| Ok((s, self.sources[s].1.row_window(k, block, seed, s)?)))
            .collect()
    }

    /// The training batch of `step`, `rows` windows of `block` ids drawn by weight (see the
    /// module's text): inputs `(rows, block)` u32, targets `(rows, block)` i64.
    pub fn batch(
        &self,
        step: u64,
        rows: usize,
        block: usize,
        seed: u64,
    ) -> Result<(Tensor, Tensor)> {
        let windows = self
            .rows(step, rows, block, seed)?
            .into_iter()
            .map(|(s, w)| self.sources[s].1.window(Split::Train, w, block))
            .collect::<Result<Vec<_>>>()?;
        pair_tensors(&windows, block)
    }
}

/// The CSV `pipewright data windows` writes for the datasets `parts` (weight, directory): a
/// row per step of `steps` (counted from 1, as `scalars.csv` counts) and its `rows` rows'
/// window indices, each `SOURCE:WINDOW` when `sources` (a blend) else the window alone (one
/// dataset is a blend of one, which reads what it reads alone). Past 16 Mi windows (about 150
/// MB of text, held whole) it is refused before the datasets are opened.
pub fn windows_csv(
    parts: &[(f64, PathBuf)],
    (steps, rows, block, seed): (u64, usize, usize, u64),
    sources: bool,
) -> Result<String> {
    const MAX_WINDOWS: u64 = 1 << 24;
    let windows = steps.saturating_mul(rows as u64);
    if windows > MAX_WINDOWS {
        return Err(invalid!(
            "--steps {steps} x --batch-size {rows} lists {windows} windows, more than the \
             {MAX_WINDOWS} one listing holds: list fewer steps (a step's windows do not depend \
             on the steps listed before it)"
        ));
    }
    let data = Blend::open(parts)?;
    let mut csv = String::from("step,windows\n");
    for step in 0..steps {
        let listed: Vec<String> = data
            .rows(step, rows, block, seed)?
            .iter()
            .map(|(s, w)| match sources {
                true => format!("{s}:{w}"),
                false => w.to_string(),
            })
            .collect();
        csv.push_str(&format!("{},{}\n", step + 1, listed.join(" ")));
    }
    Ok(csv)
}
