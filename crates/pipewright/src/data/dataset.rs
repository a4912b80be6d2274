//! Training windows from token shards, memory-mapped (the corpus is never read whole).
//!
//! A split is one stream of ids, its shards end to end; window `i` of `block` is ids
//! `i*block ..= (i+1)*block` (inputs and, shifted by one, targets). Row `g` of the run (row
//! `r` of the global batch of step `s` is `g = s*rows + r`) is window `perm_e[g mod n]` of
//! epoch `e = g / n`, where `perm_e` is a shuffle seeded by the run's seed and the epoch: every
//! epoch visits every window once in a new order, a step's rows depend only on the step, so a
//! resumed or morphed run reads exactly the rows it would have read, and each data-parallel
//! replica (its slice of the global batch) gets rows no other replica gets.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::{Device, Tensor};
use memmap2::Mmap;
use rand::seq::SliceRandom;

use super::shards::{ShardFile, ShardIndex, TokenDtype, INDEX_FILE, SHARD_FORMAT};
use super::tokenizer::Tokenizer;
use crate::{invalid, Error, Result};

/// Which part of the corpus.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// What training reads.
    Train,
    /// The held-out part (evaluation).
    Valid,
}

/// One split's shards, mapped.
struct Stream {
    maps: Vec<Mmap>,
    /// The first id of each shard in the stream, and the total at the end.
    starts: Vec<u64>,
    dtype: TokenDtype,
}

impl Stream {
    fn open(dir: &Path, files: &[ShardFile], dtype: TokenDtype) -> Result<Self> {
        let mut maps = Vec::new();
        let mut starts = vec![0u64];
        for f in files {
            let path = crate::runtime::files::inside(dir, &f.file)?;
            let file =
                std::fs::File::open(&path).map_err(|e| Error::io("cannot open shard", &path, e))?;
            let len = file
                .metadata()
                .map_err(|e| Error::io("cannot read", &path, e))?
                .len();
            let want = f.tokens.checked_mul(dtype.bytes() as u64);
            if Some(len) != want {
                return Err(Error::State(format!(
                    "shard `{}` holds {len} bytes, not the {} ids of {} bytes its index says: it \
                     is truncated or damaged; prepare the corpus again",
                    path.display(),
                    f.tokens,
                    dtype.bytes()
                )));
            }
            // SAFETY: the shard is only read; a shard changed while mapped reads changed ids,
            // never memory outside the map.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io("cannot map", &path, e))?;
            maps.push(map);
            starts.push(starts[starts.len() - 1] + f.tokens);
        }
        Ok(Self {
            maps,
            starts,
            dtype,
        })
    }

    fn total(&self) -> u64 {
        self.starts[self.starts.len() - 1]
    }

    /// Ids `from .. from + n` (which must lie in the stream) into `out`.
    fn read(&self, from: u64, n: usize, out: &mut Vec<u32>) {
        let mut at = from;
        let end = from + n as u64;
        while at < end {
            let s = self.starts.partition_point(|&st| st <= at) - 1;
            let upto = end.min(self.starts[s + 1]);
            let map = &self.maps[s];
            let (a, b) = (
                (at - self.starts[s]) as usize,
                (upto - self.starts[s]) as usize,
            );
            match self.dtype {
                TokenDtype::U16 => out.extend(
                    map[2 * a..2 * b]
                        .chunks_exact(2)
                        .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32),
                ),
                TokenDtype::U32 => out.extend(
                    map[4 * a..4 * b]
                        .chunks_exact(4)
                        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                ),
            }
            at = upto;
        }
    }
}

/// An epoch's shuffle: (epoch, block, seed, blend source) and the order of its windows.
type Order = ((u64, usize, u64, usize), Arc<Vec<u32>>);

/// Token shards opened for training and evaluation.
pub struct TokenDataset {
    dir: PathBuf,
    index: ShardIndex,
    train: Stream,
    valid: Stream,
    /// The shuffle of the epoch read last.
    order: Mutex<Option<Order>>,
}

impl TokenDataset {
    /// Opens the shard directory `dir`; with `tokenizer`, checks that it is the one that
    /// encoded the shards.
    pub fn open(dir: &Path, tokenizer: Option<&Tokenizer>) -> Result<Self> {
        let ip = dir.join(INDEX_FILE);
        let bytes = std::fs::read(&ip).map_err(|e| {
            Error::io(
                "not a shard directory (`pipewright data prepare` makes one): cannot read",
                &ip,
                e,
            )
        })?;
        let index: ShardIndex = serde_json::from_slice(&bytes)
            .map_err(|e| Error::State(format!("`{}` is not a shard index: {e}", ip.display())))?;
        if index.format_version != SHARD_FORMAT {
            return Err(Error::State(format!(
                "`{}` has shard format {}, this pipewright reads {SHARD_FORMAT}",
                ip.display(),
                index.format_version
            )));
        }
        if let Some(t) = tokenizer {
            if t.sha256() != index.tokenizer_sha256 {
                return Err(invalid!(
                    "the shards in `{}` were encoded by another tokenizer than `{}`: prepare \
                     them with it, or use the tokenizer they were made with",
                    dir.display(),
                    t.path().display()
                ));
            }
        }
        let train = Stream::open(dir, &index.train, index.dtype)?;
        let valid = Stream::open(dir, &index.valid, index.dtype)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            index,
            train,
            valid,
            order: Mutex::new(None),
        })
    }

    /// What the index says.
    pub fn index(&self) -> &ShardIndex {
        &self.index
    }

    /// The shard directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn stream(&self, split: Split) -> &Stream {
        match split {
            Split::Train => &self.train,
            Split::Valid => &self.valid,
        }
    }

    /// Ids in `split`.
    pub fn tokens(&self, split: Split) -> u64 {
        self.stream(split).total()
    }

    /// Windows of `block` ids (and the one after) in `split`.
    pub fn windows(&self, split: Split, block: usize) -> u64 {
        if block == 0 {
            return 0;
        }
        self.tokens(split).saturating_sub(1) / block as u64
    }

    /// Window `i` of `split`: `block + 1` ids (inputs, and targets shifted by one).
    pub fn window(&self, split: Split, i: u64, block: usize) -> Result<Vec<u32>> {
        if i >= self.windows(split, block) {
            return Err(invalid!(
                "window {i} of {block} ids lies beyond the {} ids of the {split:?} split",
                self.tokens(split)
            ));
        }
        let mut out = Vec::with_capacity(block + 1);
        self.stream(split)
            .read(i * block as u64, block + 1, &mut out);
        Ok(out)
    }

    /// The order of epoch `epoch`'s windows of `block` (seeded by `seed`; a blend's source
    /// `source` other than the first by its own stream).
    fn order(&self, epoch: u64, block: usize, seed: u64, source: usize) -> Arc<Vec<u32>> {
        let mut held = self.order.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((key, o)) = held.as_ref() {
            if *key == (epoch, block, seed, source) {
                return o.clone();
            }
        }
        let n = self.windows(Split::Train, block) as u32;
        let mut order: Vec<u32> = (0..n).collect();
        let stream = match source {
            0 => format!("tokens/epoch/{epoch}"),
            s => format!("tokens/{s}/epoch/{epoch}"),
        };
        order.shuffle(&mut crate::runtime::seed::rng_for(seed, &stream));
        let order = Arc::new(order);
        *held = Some(((epoch, block, seed, source), order.clone()));
        order
    }

    /// The window of training row `g` (rows counted over the run, this dataset's own when it
    /// is source `source` of a blend): window `perm_e[g mod n]` of epoch `e = g / n`.
    pub fn row_window(&self, g: u64, block: usize, seed: u64, source: usize) -> Result<u64> {
        let n = self.windows(Split::Train, block);
        if n == 0 || n > u32::MAX as u64 {
            return Err(invalid!(
                "the training split of `{}` has {} ids: {n} windows of {block} (at least one, \
                 at most 2^32 are needed); lower --block-size or prepare more text",
                self.dir.display(),
                self.tokens(Split::Train)
            ));
        }
        let order = self.order(g / n, block, seed, source);
        Ok(order[(g % n) as usize] as u64)
    }

    /// Window indices of the training rows of global batch `step` of `rows` rows.
    pub fn rows(&self, step: u64, rows: usize, block: usize, seed: u64) -> Result<Vec<u64>> {
        let first = step * rows as u64;
        (first..first + rows as u64)
            .map(|g| self.row_window(g, block, seed, 0))
            .collect()
    }

    /// The training batch of `step`: inputs `(rows, block)` u32 and targets `(rows, block)` i64.
    pub fn batch(
        &self,
        step: u64,
        rows: usize,
        block: usize,
        seed: u64,
    ) -> Result<(Tensor, Tensor)> {
        let windows = self.rows(step, rows, block, seed)?;
        self.tensors(Split::Train, &windows, block)
    }

    /// Inputs and targets of the windows `windows` of `split`.
    pub fn tensors(&self, split: Split, windows: &[u64], block: usize) -> Result<(Tensor, Tensor)> {
        let ids = windows
            .iter()
            .map(|&w| self.window(split, w, block))
            .collect::<Result<Vec<_>>>()?;
        pair_tensors(&ids, block)
    }
}

/// Inputs `(rows, block)` u32 and targets `(rows, block)` i64 of windows of `block + 1` ids
/// each (the targets shifted by one).
pub(super) fn pair_tensors(windows: &[Vec<u32>], block: usize) -> Result<(Tensor, Tensor)> {
    let mut x = Vec::with_capacity(windows.len() * block);
    let mut y = Vec::with_capacity(windows.len() * block);
    for ids in windows {
        x.extend_from_slice(&ids[..block]);
        y.extend(ids[1..].iter().map(|&v| v as i64));
    }
    let b = windows.len();
    Ok((
        Tensor::from_vec(x, (b, block), &Device::Cpu)?,
        Tensor::from_vec(y, (b, block), &Device::Cpu)?,
    ))
}
