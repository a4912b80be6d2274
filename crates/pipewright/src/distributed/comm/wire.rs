//! How a tensor travels as bytes between processes: a fixed-size header (dtype, shape) and the
//! raw little-endian elements, read straight from CPU storage and received into the vector the
//! new tensor then owns. Used by the MPI and NCCL backends.

use candle_core::{CpuStorage, DType, Device, Storage, Tensor};
use half::{bf16, f16};

use crate::{Error, Result};

/// Words (u64) in a message header: the dtype code, the number of dimensions, the dimensions.
pub const HEADER: usize = 10;
/// The most dimensions a tensor on the wire may have (what the header leaves room for).
pub const MAX_RANK: usize = HEADER - 2;

fn dtype_code(dt: DType) -> Result<u64> {
    Ok(match dt {
        DType::U8 => 0,
        DType::U32 => 1,
        DType::I64 => 2,
        DType::BF16 => 3,
        DType::F16 => 4,
        DType::F32 => 5,
        DType::F64 => 6,
        other => {
            return Err(Error::Comm(format!(
                "the MPI backend does not carry {other:?} tensors"
            )))
        }
    })
}

fn code_dtype(c: u64) -> Result<DType> {
    Ok(match c {
        0 => DType::U8,
        1 => DType::U32,
        2 => DType::I64,
        3 => DType::BF16,
        4 => DType::F16,
        5 => DType::F32,
        6 => DType::F64,
        _ => {
            return Err(Error::Comm(format!(
                "corrupt message header: dtype code {c}"
            )))
        }
    })
}

/// The header that describes `t` to its receiver; an error for a tensor of more than
/// [`MAX_RANK`] dimensions or a dtype the wire does not carry.
pub fn header(t: &Tensor) -> Result<[u64; HEADER]> {
    if t.rank() > MAX_RANK {
        return Err(Error::Comm(format!(
            "the MPI backend carries tensors of at most {MAX_RANK} dimensions, got {:?}",
            t.dims()
        )));
    }
    let mut h = [0u64; HEADER];
    h[0] = dtype_code(t.dtype())?;
    h[1] = t.rank() as u64;
    for (i, d) in t.dims().iter().enumerate() {
        h[2 + i] = *d as u64;
    }
    Ok(h)
}

/// The shape and dtype a received [`header`] describes; an error for a corrupt one.
pub fn parse_header(h: &[u64]) -> Result<(Vec<usize>, DType)> {
    let n = h[1] as usize;
    if n > MAX_RANK {
        return Err(Error::Comm(format!("corrupt message header: rank {n}")));
    }
    Ok((
        h[2..2 + n].iter().map(|d| *d as usize).collect(),
        code_dtype(h[0])?,
    ))
}

/// Byte view of a slice of plain numbers.
pub fn bytes_of<T: Copy>(s: &[T]) -> &[u8] {
    // SAFETY: T is a plain number type (u8, u32, i64, f16, bf16, f32, f64): no padding, every
    // byte initialised, and u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

/// Mutable byte view of a slice of plain numbers, to receive into.
pub fn bytes_of_mut<T: Copy>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `bytes_of`; any byte pattern is a valid value of these types.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

/// Calls `f` with the bytes of `t` (contiguous, on the CPU) without copying them.
pub fn with_bytes<R>(t: &Tensor, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let (a, b) = layout
        .contiguous_offsets()
        .ok_or_else(|| Error::Comm("tensor is not contiguous".into()))?;
    let cpu = match &*storage {
        Storage::Cpu(c) => c,
        _ => {
            return Err(Error::Comm(
                "the MPI backend carries CPU tensors only".into(),
            ))
        }
    };
    Ok(match cpu {
        CpuStorage::U8(v) => f(bytes_of(&v[a..b])),
        CpuStorage::U32(v) => f(bytes_of(&v[a..b])),
        CpuStorage::I64(v) => f(bytes_of(&v[a..b])),
        CpuStorage::BF16(v) => f(bytes_of(&v[a..b])),
        CpuStorage::F16(v) => f(bytes_of(&v[a..b])),
        CpuStorage::F32(v) => f(bytes_of(&v[a..b])),
        CpuStorage::F64(v) => f(bytes_of(&v[a..b])),
        _ => {
            return Err(Error::Comm(format!(
                "the MPI backend does not carry {:?} tensors",
                t.dtype()
            )))
        }
    })
}

/// `t` in host memory, for a backend that moves bytes from there (MPI, and NCCL for CPU
/// tensors): a CPU tensor as it is, a GPU tensor copied over. The first GPU tensor prints a
/// warning, once per process: MPI here is not CUDA-aware, and every step pays the copies.
pub fn to_host(t: &Tensor, backend: &str) -> Result<Tensor> {
    if t.device().is_cpu() {
        return Ok(t.clone());
    }
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| {
        eprintln!(
            "pipewright: warning: the {backend} backend copies GPU tensors through host memory \
             (the nccl backend keeps them on the GPU)"
        )
    });
    Ok(t.to_device(&Device::Cpu)?)
}

/// A typed receive buffer that becomes a tensor without a copy.
#[allow(missing_docs)]
pub enum Buf {
    U8(Vec<u8>),
    U32(Vec<u32>),
    I64(Vec<i64>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
    F32(Vec<f32>),
    F64(Vec<f64>),
}

impl Buf {
    /// A zeroed buffer for `n` elements, to be filled by a receive or a copy.
    pub fn for_receive(dt: DType, n: usize) -> Result<Self> {
        Ok(match dt {
            DType::U8 => Buf::U8(vec![0; n]),
            DType::U32 => Buf::U32(vec![0; n]),
            DType::I64 => Buf::I64(vec![0; n]),
            DType::BF16 => Buf::BF16(vec![bf16::ZERO; n]),
            DType::F16 => Buf::F16(vec![f16::ZERO; n]),
            DType::F32 => Buf::F32(vec![0.0; n]),
            DType::F64 => Buf::F64(vec![0.0; n]),
            other => {
                return Err(Error::Comm(format!(
                    "the MPI backend does not carry {other:?} tensors"
                )))
            }
        })
    }

    /// The buffer's elements as bytes, for the backend to receive into.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Buf::U8(v) => bytes_of_mut(v),
            Buf::U32(v) => bytes_of_mut(v),
            Buf::I64(v) => bytes_of_mut(v),
            Buf::BF16(v) => bytes_of_mut(v),
            Buf::F16(v) => bytes_of_mut(v),
            Buf::F32(v) => bytes_of_mut(v),
            Buf::F64(v) => bytes_of_mut(v),
        }
    }

    /// The received buffer as a CPU tensor of shape `dims`, without copying.
    pub fn into_tensor(self, dims: &[usize]) -> Result<Tensor> {
        let d = &Device::Cpu;
        Ok(match self {
            Buf::U8(v) => Tensor::from_vec(v, dims, d)?,
            Buf::U32(v) => Tensor::from_vec(v, dims, d)?,
            Buf::I64(v) => Tensor::from_vec(v, dims, d)?,
            Buf::BF16(v) => Tensor::from_vec(v, dims, d)?,
            Buf::F16(v) => Tensor::from_vec(v, dims, d)?,
            Buf::F32(v) => Tensor::from_vec(v, dims, d)?,
            Buf::F64(v) => Tensor::from_vec(v, dims, d)?,
        })
    }
}

/// A tensor of `dims` and `dt` from its raw bytes (copied).
pub fn tensor_from_bytes(dt: DType, dims: &[usize], bytes: &[u8]) -> Result<Tensor> {
    let mut b = Buf::for_receive(dt, dims.iter().product())?;
    if b.bytes_mut().len() != bytes.len() {
        return Err(Error::Comm(format!(
            "{} bytes cannot hold a {dims:?} {dt:?} tensor",
            bytes.len()
        )));
    }
    b.bytes_mut().copy_from_slice(bytes);
    b.into_tensor(dims)
}

/// The header of `t` as an i64 tensor (for sending it through another communicator).
pub fn header_tensor(t: &Tensor) -> Result<Tensor> {
    let h: Vec<i64> = header(t)?.iter().map(|v| *v as i64).collect();
    Ok(Tensor::from_vec(h, HEADER, &Device::Cpu)?)
}

/// Reads a header made by [`header_tensor`].
pub fn parse_header_tensor(t: &Tensor) -> Result<(Vec<usize>, DType)> {
    let h: Vec<u64> = t.to_vec1::<i64>()?.iter().map(|v| *v as u64).collect();
    parse_header(&h)
}

/// The shape a reduction of `t` over `size` members produces (dim 0 divided by `size` when
/// scattering), checked the same way by every backend that moves bytes between processes.
/// Refuses averaging integers and scattering what does not split.
pub fn reduce_plan(
    t: &Tensor,
    op: super::ReduceOp,
    size: usize,
    scatter: bool,
) -> Result<Vec<usize>> {
    let name = if scatter {
        "reduce_scatter"
    } else {
        "all_reduce"
    };
    let dt = t.dtype();
    if op == super::ReduceOp::Avg && dt.is_int() {
        return Err(Error::Invalid(format!(
            "cannot average {dt:?} tensors: use ReduceOp::Sum and divide where the rounding is known"
        )));
    }
    let mut dims = t.dims().to_vec();
    if scatter {
        let rows = *dims
            .first()
            .ok_or_else(|| Error::Comm(format!("{name}: a 0-d tensor has no dim 0 to scatter")))?;
        if !rows.is_multiple_of(size) {
            return Err(Error::Comm(format!(
                "{name}: dim 0 of {} does not split into {size} equal parts",
                super::describe(t)
            )));
        }
        dims[0] = rows / size;
    }
    Ok(dims)
}
