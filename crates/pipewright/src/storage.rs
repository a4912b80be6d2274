//! Copies of tensor storage for custom ops whose output is a value they already have: the
//! tensor-parallel collectives (their result was computed before the op) and the deferred
//! weight-gradient tap (an identity). Written once over candle's backend traits, so the same
//! code serves the CPU and the GPU.

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{Layout, Shape, Storage, Tensor};

/// The elements `l` selects from `s`, contiguous, in a new storage on the same device.
pub(crate) fn copy<S>(s: &S, l: &Layout) -> candle_core::Result<(S, Shape)>
where
    S: BackendStorage,
    S::Device: BackendDevice<Storage = S>,
{
    // SAFETY: `copy_strided_src` writes every element of the new storage before it is read.
    let mut out = unsafe { s.device().alloc_uninit(l.shape(), s.dtype())? };
    s.copy_strided_src(&mut out, 0, l)?;
    Ok((out, l.shape().clone()))
}

/// `t`'s elements as a new storage of the backend `S`, which `pick` takes from candle's
/// [`Storage`]; an error naming `op` when `t` lives on another device.
pub(crate) fn copy_of<S>(
    t: &Tensor,
    op: &str,
    pick: impl Fn(&Storage) -> Option<&S>,
) -> candle_core::Result<(S, Shape)>
where
    S: BackendStorage,
    S::Device: BackendDevice<Storage = S>,
{
    let (storage, layout) = t.storage_and_layout();
    let s = pick(&storage).ok_or_else(|| {
        candle_core::Error::Msg(format!(
            "{op}: its value is on {:?}, not on the device of its input",
            t.device().location()
        ))
    })?;
    copy(s, layout)
}

/// [`copy_of`]'s `pick` for the CPU.
pub(crate) fn cpu(s: &Storage) -> Option<&candle_core::CpuStorage> {
    match s {
        Storage::Cpu(c) => Some(c),
        _ => None,
    }
}

/// [`copy_of`]'s `pick` for CUDA (never matches in a build without the `cuda` feature).
pub(crate) fn cuda(s: &Storage) -> Option<&candle_core::CudaStorage> {
    match s {
        Storage::Cuda(c) => Some(c),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, IndexOp, Tensor};

    #[test]
    fn copies_what_the_layout_selects() {
        // A transposed, offset view: the copy holds its elements in row-major order.
        let t = Tensor::arange(0f32, 12., &Device::Cpu)
            .unwrap()
            .reshape((3, 4))
            .unwrap();
        let v = t.i((1.., 1..3)).unwrap().t().unwrap();
        let (s, shape) = super::copy_of(&v, "test", super::cpu).unwrap();
        let back = Tensor::from_storage(
            candle_core::Storage::Cpu(s),
            shape,
            candle_core::op::BackpropOp::none(),
            false,
        );
        assert_eq!(
            back.to_vec2::<f32>().unwrap(),
            vec![vec![5., 9.], vec![6., 10.]]
        );
    }
}
