//! Copies of tensor storage for custom ops whose output is a value they already have: the
//! tensor-parallel collectives (their result was computed before the op) and the deferred
//! weight-gradient tap (an identity); and a tensor's memory given back and filled again in
//! place ([`release`], [`refill`]: ZeRO-3's parameters between their uses). Written once over
//! candle's backend traits, so the same code serves the CPU and the GPU.

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, CudaStorage, InplaceOp1, Layout, Shape, Storage, Tensor};

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

/// Gives `t`'s memory back: its storage (shared with every clone and view of it, and with the
/// graphs that hold it) becomes empty, its shape stays. Nothing may read it until [`refill`]:
/// ZeRO-3 releases a layer's parameters after each use, and fills them before the next.
pub(crate) fn release(t: &Tensor) -> crate::Result<()> {
    Ok(t.inplace_op1(&Release)?)
}

/// Fills `t`'s storage, in place, with a new one holding `value` (same element count and
/// dtype): what [`release`] took, or a new value, seen by every graph that holds `t`.
pub(crate) fn refill(t: &Tensor, value: &Tensor) -> crate::Result<()> {
    if value.elem_count() != t.elem_count() || value.dtype() != t.dtype() {
        return Err(crate::invalid!(
            "refilling a {:?} tensor of shape {:?} with a {:?} value of shape {:?}",
            t.dtype(),
            t.dims(),
            value.dtype(),
            value.dims()
        ));
    }
    Ok(t.inplace_op1(&Refill(value.clone()))?)
}

struct Release;

fn emptied<S>(s: &S) -> candle_core::Result<S>
where
    S: BackendStorage,
    S::Device: BackendDevice<Storage = S>,
{
    s.device().zeros_impl(&Shape::from(0usize), s.dtype())
}

impl InplaceOp1 for Release {
    fn name(&self) -> &'static str {
        "release"
    }
    fn cpu_fwd(&self, s: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        *s = emptied(s)?;
        Ok(())
    }
    fn cuda_fwd(&self, s: &mut CudaStorage, _: &Layout) -> candle_core::Result<()> {
        *s = emptied(s)?;
        Ok(())
    }
}

struct Refill(Tensor);

impl InplaceOp1 for Refill {
    fn name(&self) -> &'static str {
        "refill"
    }
    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
        check_plain(l)?;
        *s = copy_of(&self.0, self.name(), cpu)?.0;
        Ok(())
    }
    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> candle_core::Result<()> {
        check_plain(l)?;
        *s = copy_of(&self.0, self.name(), cuda)?.0;
        Ok(())
    }
}

/// A refilled storage is read from its start in row-major order: only a tensor that owns its
/// whole storage so (a parameter) can be refilled.
fn check_plain(l: &Layout) -> candle_core::Result<()> {
    if l.start_offset() != 0 || !l.is_contiguous() {
        candle_core::bail!("refill: only a contiguous tensor at offset 0 can be refilled")
    }
    Ok(())
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

    #[test]
    fn a_released_tensor_holds_nothing_until_refilled_and_its_graph_sees_the_new_value() {
        let w = candle_core::Var::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu).unwrap();
        let x = candle_core::Var::new(&[[1f32, 1.]], &Device::Cpu).unwrap();
        // A graph that holds the weight, built before it is released.
        let y = x
            .matmul(&w.as_tensor().t().unwrap())
            .unwrap()
            .sum_all()
            .unwrap();
        let held = |t: &Tensor| match &*t.storage_and_layout().0 {
            candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) => v.len(),
            _ => unreachable!("an f32 tensor on the CPU"),
        };
        super::release(w.as_tensor()).unwrap();
        assert_eq!(held(w.as_tensor()), 0);
        let v = Tensor::new(&[[10f32, 20.], [30., 40.]], &Device::Cpu).unwrap();
        super::refill(w.as_tensor(), &v).unwrap();
        assert_eq!(held(w.as_tensor()), 4);
        assert_eq!(w.to_vec2::<f32>().unwrap(), v.to_vec2::<f32>().unwrap());
        // d(sum(x W^T))/dx sums W's rows: the backward reads the refilled storage.
        let g = y.backward().unwrap();
        let gx = g.get(x.as_tensor()).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(gx, vec![vec![40., 60.]]);
        let wrong = Tensor::new(&[1f32, 2., 3.], &Device::Cpu).unwrap();
        assert!(super::refill(w.as_tensor(), &wrong).is_err());
    }
}
