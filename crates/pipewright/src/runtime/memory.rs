//! Live memory counted by the allocator, per rank: what a run has allocated and not yet freed,
//! and its peak, for the process and for each rank running as a thread of it. It is the
//! CPU's `torch.cuda.max_memory_allocated`: the bytes the program holds, without what the
//! allocator keeps back from the system after a free (which the resident set, the Linux
//! `VmHWM` of [`crate::experiment::peak_memory_bytes`], includes). The planner predicts these
//! bytes; `pipewright train` reports them.
//!
//! A program opts in by installing the allocator:
//!
//! ```
//! use pipewright::runtime::memory::{rank_peak_bytes, set_rank, CountingAlloc};
//!
//! #[global_allocator]
//! static ALLOC: CountingAlloc = CountingAlloc;
//!
//! fn main() {
//!     set_rank(Some(0));
//!     let v = vec![1u8; 1 << 20];
//!     assert!(rank_peak_bytes(0).unwrap() >= 1 << 20);
//!     drop(v);
//! }
//! ```
//!
//! Each allocation is charged to the rank of the thread that made it ([`set_rank`]; threads
//! of candle's pool and the main thread to none) until it is freed, wherever that is.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

/// Ranks counted on their own; allocations of higher ranks count to the process only.
pub const MAX_RANKS: usize = 64;

/// One counter pair on its own cache line: ranks allocating at once do not share one.
#[repr(align(64))]
struct Counter {
    live: AtomicI64,
    peak: AtomicI64,
}

impl Counter {
    const fn new() -> Self {
        Counter {
            live: AtomicI64::new(0),
            peak: AtomicI64::new(0),
        }
    }

    /// Starts the peak again from what is held now.
    fn reset_peak(&self) {
        self.peak
            .store(self.live.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    fn add(&self, bytes: i64) {
        let now = self.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        if bytes > 0 {
            self.peak.fetch_max(now, Ordering::Relaxed);
        }
    }
}

/// Slot 0: the process; slot r + 1: rank r.
static COUNTERS: [Counter; MAX_RANKS + 1] = [const { Counter::new() }; MAX_RANKS + 1];
static INSTALLED: AtomicBool = AtomicBool::new(false);
/// No rank: the slot byte a thread's allocations carry when [`set_rank`] was not called.
const NO_RANK: u8 = u8::MAX;

thread_local! {
    static RANK: Cell<u8> = const { Cell::new(NO_RANK) };
}

/// The allocator that counts: the system's, with each allocation's rank in a header before it.
/// Install it with `#[global_allocator]` in a binary (a library cannot choose it).
pub struct CountingAlloc;

/// The header's size for `layout`: room for the rank byte, keeping the block's alignment.
fn header(layout: &Layout) -> usize {
    layout.align().max(16)
}

/// The counter of a rank's slot byte (none for [`NO_RANK`] or a rank beyond [`MAX_RANKS`]).
fn rank_counter(slot: u8) -> Option<&'static Counter> {
    COUNTERS[1..].get(slot as usize)
}

fn charge(slot: u8, bytes: i64) {
    COUNTERS[0].add(bytes);
    if let Some(c) = rank_counter(slot) {
        c.add(bytes);
    }
}

// SAFETY: every block handed out is `header` bytes into a system block of the caller's
// alignment and `size + header` bytes; the rank byte sits just before the caller's block, and
// `dealloc` and `realloc` undo the offset with the same layout the caller passes back.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        self.allocate(layout, false)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        self.allocate(layout, true)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let h = header(&layout);
        let slot = *ptr.sub(1);
        charge(slot, -(layout.size() as i64));
        System.dealloc(
            ptr.sub(h),
            Layout::from_size_align_unchecked(layout.size() + h, layout.align()),
        );
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let h = header(&layout);
        let base = System.realloc(
            ptr.sub(h),
            Layout::from_size_align_unchecked(layout.size() + h, layout.align()),
            new_size + h,
        );
        if base.is_null() {
            return base;
        }
        let block = base.add(h);
        // The block stays charged to the rank that made it.
        charge(*block.sub(1), new_size as i64 - layout.size() as i64);
        block
    }
}

impl CountingAlloc {
    unsafe fn allocate(&self, layout: Layout, zeroed: bool) -> *mut u8 {
        // Read before written: a store on every allocation would bounce the flag's cache line
        // between the ranks' cores.
        if !INSTALLED.load(Ordering::Relaxed) {
            INSTALLED.store(true, Ordering::Relaxed);
        }
        let h = header(&layout);
        let Ok(whole) = Layout::from_size_align(layout.size() + h, layout.align()) else {
            return std::ptr::null_mut();
        };
        let base = if zeroed {
            System.alloc_zeroed(whole)
        } else {
            System.alloc(whole)
        };
        if base.is_null() {
            return base;
        }
        let block = base.add(h);
        let slot = RANK.try_with(Cell::get).unwrap_or(NO_RANK);
        *block.sub(1) = slot;
        charge(slot, layout.size() as i64);
        block
    }
}

/// Charges what this thread allocates from now on to `rank` (`None`: to the process only).
/// `comm::local::run` calls it for each rank's thread.
pub fn set_rank(rank: Option<usize>) {
    let slot = rank.filter(|&r| r < MAX_RANKS).map_or(NO_RANK, |r| r as u8);
    RANK.with(|c| c.set(slot));
}

/// Whether [`CountingAlloc`] is this program's allocator (the counts below are `None` if not).
pub fn installed() -> bool {
    INSTALLED.load(Ordering::Relaxed)
}

fn read(c: &Counter, f: fn(&Counter) -> &AtomicI64) -> Option<u64> {
    installed().then(|| f(c).load(Ordering::Relaxed).max(0) as u64)
}

/// Bytes the process holds now.
pub fn live_bytes() -> Option<u64> {
    read(&COUNTERS[0], |c| &c.live)
}

/// Bytes held now by this thread's rank ([`set_rank`]), or by the process if it has none.
pub fn thread_live_bytes() -> Option<u64> {
    read(thread_counter(), |c| &c.live)
}

/// The most bytes the process has held at once since the start or [`reset_peaks`].
pub fn peak_bytes() -> Option<u64> {
    read(&COUNTERS[0], |c| &c.peak)
}

/// The most bytes charged to `rank` at once since the start or [`reset_peaks`].
pub fn rank_peak_bytes(rank: usize) -> Option<u64> {
    read(COUNTERS[1..].get(rank)?, |c| &c.peak)
}

/// The counter this thread's allocations are charged to beside the process's: its rank's, or
/// the process's when it has none.
fn thread_counter() -> &'static Counter {
    rank_counter(RANK.with(Cell::get)).unwrap_or(&COUNTERS[0])
}

/// Starts the peak of this thread's rank (of the process if it has none) again from what it
/// holds now, and returns those bytes: with [`thread_peak_bytes`] after it, the most one piece
/// of work (a layer's backward) held beyond what it started with.
pub fn reset_thread_peak() -> Option<u64> {
    let c = thread_counter();
    c.reset_peak();
    read(c, |c| &c.live)
}

/// The most bytes this thread's rank (the process if it has none) has held at once since the
/// start, [`reset_peaks`] or [`reset_thread_peak`].
pub fn thread_peak_bytes() -> Option<u64> {
    read(thread_counter(), |c| &c.peak)
}

/// Starts every peak again from what is held now.
pub fn reset_peaks() {
    for c in &COUNTERS {
        c.reset_peak();
    }
}

/// Serves large allocations from glibc's heap and keeps freed memory there instead of giving
/// it back to the system: a buffer allocated again reuses pages already mapped instead of
/// faulting in fresh zeroed ones. By default glibc maps each large block anew and unmaps it on
/// free, and trims its heap when the top is free, so a program that allocates and frees the
/// same large tensors over and over (an evaluation's 500-row batches, an MPI receive buffer)
/// spends its time in page faults: `pipewright train --steps 2` took 0.36 s with the defaults
/// and 0.21 s with this. The price is a resident set that stays at its peak. Call it once, at
/// the start of a training process (the `pipewright` binary and the MPI backend do); it does
/// nothing outside glibc.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn mallopt(
                param: std::os::raw::c_int,
                value: std::os::raw::c_int,
            ) -> std::os::raw::c_int;
        }
        const M_TRIM_THRESHOLD: std::os::raw::c_int = -1;
        const M_MMAP_THRESHOLD: std::os::raw::c_int = -3;
        // SAFETY: mallopt only tunes glibc's allocator; both values are within its limits.
        unsafe {
            mallopt(M_MMAP_THRESHOLD, 1 << 30);
            mallopt(M_TRIM_THRESHOLD, 1 << 30);
        }
    }
}

/// The most GPU memory tensors on `device` have held at once since the process started or
/// [`reset_gpu_peak`]: the high-water mark of the CUDA memory pool candle allocates from, which
/// is what PyTorch's `torch.cuda.max_memory_allocated` reports for its own allocator. `None`
/// for the CPU, or in a build without the `cuda` feature.
pub fn gpu_peak_bytes(device: &candle_core::Device) -> Option<u64> {
    #[cfg(feature = "cuda")]
    return gpu::peak(device, None);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        None
    }
}

/// Starts [`gpu_peak_bytes`] of `device` again from what its tensors hold now.
pub fn reset_gpu_peak(device: &candle_core::Device) {
    #[cfg(feature = "cuda")]
    gpu::peak(device, Some(0));
    #[cfg(not(feature = "cuda"))]
    let _ = device;
}

#[cfg(feature = "cuda")]
mod gpu {
    use cudarc::driver::result::{device, mem_pool};
    use cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;

    /// Reads the high-water mark of the memory pool of `d`, or sets it to `set` (0 resets it
    /// to the memory in use now).
    pub(super) fn peak(d: &candle_core::Device, set: Option<u64>) -> Option<u64> {
        let stream = d.as_cuda_device().ok()?.cuda_stream();
        let ctx = stream.context();
        ctx.bind_to_thread().ok()?;
        let mut v = set.unwrap_or(0);
        let at = (&mut v as *mut u64).cast();
        // SAFETY: the device handle comes from a live context, and USED_MEM_HIGH is a u64.
        unsafe {
            let pool = device::get_mem_pool(ctx.cu_device()).ok()?;
            match set {
                Some(_) => mem_pool::set_attribute(pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH, at),
                None => mem_pool::get_attribute(pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH, at),
            }
            .ok()?;
        }
        Some(v)
    }
}

/// Bytes of address space this process may still map under its `RLIMIT_AS` (`ulimit -v`): the
/// limit less what is mapped now. `None` when there is no limit or it cannot be read.
fn address_space_left() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max address space"))?;
    let limit: u64 = line.split_whitespace().nth(3)?.parse().ok()?;
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let mapped_kib: u64 = status
        .lines()
        .find(|l| l.starts_with("VmSize:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(limit.saturating_sub(mapped_kib * 1024))
}

/// Bytes this process may still allocate: the kernel's `MemAvailable`, or less when a cgroup
/// (a container) or an address-space limit (`ulimit -v`) leaves the process less. `None` where
/// none can be read.
pub fn available_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
        Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
    });
    let read = |p: &str| std::fs::read_to_string(p).ok()?.trim().parse::<u64>().ok();
    let cgroup = read("/sys/fs/cgroup/memory.max")
        .map(|max| max.saturating_sub(read("/sys/fs/cgroup/memory.current").unwrap_or(0)));
    [meminfo, cgroup, address_space_left()]
        .into_iter()
        .flatten()
        .min()
}

/// Fails, before anything is allocated, when `bytes` (an estimate of what `what` needs) is
/// more than [`available_bytes`]: an error naming both sizes and `fix`, instead of an abort
/// or an out-of-memory kill later.
pub fn check_fits(bytes: f64, what: &str, fix: &str) -> crate::Result<()> {
    match available_bytes() {
        Some(avail) if bytes > avail as f64 || !bytes.is_finite() => Err(crate::invalid!(
            "{what} needs about {}, more than the {} this machine has available: {fix}",
            crate::runtime::bytes::format_bytes(bytes),
            crate::runtime::bytes::format_bytes(avail as f64)
        )),
        _ => Ok(()),
    }
}
