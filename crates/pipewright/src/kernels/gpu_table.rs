//! The tables of the kernels that take many tensors in one launch (kernels/cuda/table.cuh):
//! the optimizer's phase of a step (the gradients cast to f32, their norm and overflow check,
//! clipping, AdamW, the masters cast into the model) was a launch or more per parameter, and on
//! a GPU the host's time to launch them, not the GPU's work, was that phase's time. An item is
//! one tensor's buffers (device addresses), its length and the consecutive blocks it is given;
//! the table goes to the device with the launch.

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Result, Shape, Tensor};

use super::gpu::{tensor_addr, THREADS};

/// table.cuh's `Item`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct Item {
    p: [u64; 6],
    n: u64,
    first: u64,
    k: f32,
    flag: i32,
}
// SAFETY: plain old data laid out as the kernel's struct.
unsafe impl DeviceRepr for Item {}

/// Elements a thread walks in one pass of its block: an item of `n` elements is given
/// `n / (THREADS x PER_THREAD)` blocks (at least one, at most the table's cap).
const PER_THREAD: usize = 8;

/// The items of one launch.
#[derive(Debug)]
pub(crate) struct Table {
    items: Vec<Item>,
    blocks: usize,
    cap: usize,
}

impl Table {
    /// No items yet; each will be given at most `cap` blocks (a reduction's partial sums are
    /// one per block; an element-wise kernel takes `usize::MAX`).
    pub(crate) fn new(cap: usize) -> Self {
        Self {
            items: Vec::new(),
            blocks: 0,
            cap: cap.max(1),
        }
    }

    /// Adds a tensor of `n` elements with buffers `p` (as the kernel reads them) and its own
    /// number `k` and switch `flag`; returns the blocks it is given (none when `n` is 0: an
    /// empty tensor is no item).
    pub(crate) fn push(
        &mut self,
        p: [u64; 6],
        n: usize,
        k: f32,
        flag: bool,
    ) -> std::ops::Range<usize> {
        let first = self.blocks;
        if n == 0 {
            return first..first;
        }
        let blocks = n.div_ceil(THREADS as usize * PER_THREAD).clamp(1, self.cap);
        self.items.push(Item {
            p,
            n: n as u64,
            first: first as u64,
            k,
            flag: i32::from(flag),
        });
        self.blocks += blocks;
        first..self.blocks
    }

    /// The blocks of the launch.
    pub(crate) fn blocks(&self) -> usize {
        self.blocks
    }

    /// The table on `dev`, its item count and the launch's shape (None without items): the
    /// kernel's first two arguments and its configuration.
    pub(crate) fn upload(
        &self,
        dev: &CudaDevice,
        op: &str,
    ) -> Result<Option<(CudaSlice<Item>, i32, LaunchConfig)>> {
        if self.items.is_empty() {
            return Ok(None);
        }
        if self.blocks > i32::MAX as usize || self.items.len() > i32::MAX as usize {
            candle_core::bail!(
                "{op}: {} blocks are more than one launch takes",
                self.blocks
            );
        }
        let cfg = LaunchConfig {
            grid_dim: (self.blocks as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        Ok(Some((
            dev.clone_htod(&self.items)?,
            self.items.len() as i32,
            cfg,
        )))
    }
}

/// The outputs of a table kernel: one new buffer of `dtype` on `like`'s device cut into a part
/// of each of `shapes`, in order, each part's device address and its view. The kernel writes
/// every part before anything reads it, unless `zeroed` asks for zeros to start from; the
/// buffer lives as long as any of its views.
pub(crate) fn parts(
    like: &Tensor,
    dtype: DType,
    shapes: &[&Shape],
    zeroed: bool,
    op: &str,
) -> Result<Vec<(u64, Tensor)>> {
    let total = shapes.iter().map(|s| s.elem_count()).sum::<usize>().max(1);
    let flat = match zeroed {
        true => Tensor::zeros(total, dtype, like.device())?,
        // SAFETY: the caller's kernel writes every part before anything reads it.
        false => unsafe { Tensor::empty(total, dtype, like.device())? },
    };
    let base = tensor_addr(&flat, op)?;
    let mut at = 0;
    shapes
        .iter()
        .map(|shape| {
            let n = shape.elem_count();
            let addr = base + (at * dtype.size_in_bytes()) as u64;
            let view = flat.narrow(0, at, n)?.reshape(*shape)?;
            at += n;
            Ok((addr, view))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_get_consecutive_blocks_by_length_and_empty_tensors_none() {
        let per = THREADS as usize * PER_THREAD;
        let mut t = Table::new(3);
        assert_eq!(t.push([0; 6], 1, 0.0, false), 0..1);
        assert_eq!(t.push([0; 6], 0, 0.0, false), 1..1);
        assert_eq!(t.push([0; 6], 2 * per + 1, 0.0, false), 1..4);
        assert_eq!(t.push([0; 6], 10 * per, 0.0, false), 4..7, "capped at 3");
        assert_eq!((t.blocks(), t.items.len()), (7, 3));
        assert_eq!(std::mem::size_of::<Item>(), 72, "table.cuh's Item");
        let firsts: Vec<u64> = t.items.iter().map(|i| i.first).collect();
        assert_eq!(firsts, [0, 1, 4]);
    }
}
