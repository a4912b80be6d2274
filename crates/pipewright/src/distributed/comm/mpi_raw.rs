//! The MPI backend's raw parts: receive buffers MPI fills without zeroing first, and waiting
//! for a request without polling a core ([`settle`]).

use mpi::datatype::Equivalence;
use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::topology::SimpleCommunicator;

use crate::{Error, Result};

/// Waits for `req` by testing it every 100 us and sleeping between. A blocking MPI call polls
/// a core the whole time it waits; on the communication thread that core is the one the rank
/// computes on (on two cores shared by two ranks, the overlapped sums made the backward 17 %
/// slower than the sums they hid). Each test also progresses the transfer.
pub(super) fn settle<'a, D: ?Sized, S: mpi::request::Scope<'a>>(
    mut req: mpi::request::Request<'a, D, S>,
) {
    loop {
        match req.test() {
            Ok(_) => return,
            Err(r) => req = r,
        }
        std::thread::sleep(std::time::Duration::from_micros(100));
    }
}

/// MPI writes every element of a fresh vector (no zeroing first: at 16-64 MiB zeroing the
/// receive buffer costs as much as the transfer). `fill` gets the vector's spare capacity as a
/// raw pointer and must return the number of elements MPI reported written; the vector takes
/// them only if that is all of them.
pub(super) fn filled_by_mpi<T: Copy>(
    n: usize,
    fill: impl FnOnce(*mut T) -> Result<usize>,
) -> Result<Vec<T>> {
    let mut v: Vec<T> = Vec::with_capacity(n);
    let written = fill(v.as_mut_ptr())?;
    if written != n {
        return Err(Error::Comm(format!("MPI wrote {written} of {n} elements")));
    }
    // SAFETY: MPI initialised all n elements of the capacity (checked just above).
    unsafe { v.set_len(n) };
    Ok(v)
}

pub(super) fn count_i32(n: usize) -> Result<i32> {
    i32::try_from(n)
        .map_err(|_| Error::Comm(format!("a message of {n} elements is too large for MPI")))
}

/// Receives exactly `n` elements of `T` from `src` into a fresh vector.
pub(super) fn recv_new<T: Copy>(
    comm: &SimpleCommunicator,
    n: usize,
    src: i32,
    tag: i32,
) -> Result<Vec<T>> {
    let bytes = count_i32(n * std::mem::size_of::<T>())?;
    let byte = u8::equivalent_datatype();
    filled_by_mpi(n, |ptr: *mut T| {
        let mut status = std::mem::MaybeUninit::<ffi::MPI_Status>::uninit();
        let mut got: i32 = 0;
        // SAFETY: `ptr` has room for n elements (`bytes` bytes); MPI fills `status`.
        unsafe {
            ffi::MPI_Recv(
                ptr.cast(),
                bytes,
                byte.as_raw(),
                src,
                tag,
                comm.as_raw(),
                status.as_mut_ptr(),
            );
            ffi::MPI_Get_count(status.as_ptr(), byte.as_raw(), &mut got);
        }
        if got != bytes {
            return Err(Error::Comm(format!(
                "recv from rank {src} got {got} bytes where its header announced {bytes}"
            )));
        }
        Ok(n)
    })
}
