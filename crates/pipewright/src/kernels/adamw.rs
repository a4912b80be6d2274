//! AdamW in one pass per parameter: the parameter updated in place and both moments written
//! while each element is read once, with exactly the f32 arithmetic, operation for operation,
//! of the composed update in `nn::optim::adamw` (so the trajectories stay bit-for-bit those of
//! the `torch.optim` fixtures).

use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Storage, Tensor};

use super::{par_elems, slice, Out};

const NAME: &str = "pipewright-adamw";

/// One step's coefficients, rounded to f32 as candle's `affine` rounds them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AdamWStep {
    pub beta1: f64,
    pub beta2: f64,
    /// `1 / sqrt(1 - beta2^t)`.
    pub inv_bc2_sqrt: f64,
    pub eps: f64,
    /// `lr / (1 - beta1^t)`.
    pub step_size: f64,
}

/// One parameter of an [`update_all`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Param<'a> {
    /// The parameter, updated in place.
    pub p: &'a Tensor,
    /// Its f32 gradient.
    pub g: &'a Tensor,
    /// Its moments (none before the first step).
    pub m: Option<&'a Tensor>,
    pub v: Option<&'a Tensor>,
    /// `1 - lr * weight_decay` when this parameter decays.
    pub decay: Option<f64>,
}

/// Whether [`update_all`] takes `p`: a contiguous f32 parameter on the CPU or (in the `cuda`
/// build) a GPU.
pub(crate) fn applies(p: &Tensor) -> bool {
    (p.device().is_cpu() || (cfg!(feature = "cuda") && p.device().is_cuda()))
        && p.dtype() == DType::F32
        && p.is_contiguous()
}

/// Updates each parameter in place from its gradient and moments and returns its new
/// moments, in order. On a GPU, parameters of one device are one launch.
pub(crate) fn update_all(
    ps: &[Param<'_>],
    c: AdamWStep,
) -> candle_core::Result<Vec<(Tensor, Tensor)>> {
    #[cfg(feature = "cuda")]
    if let Some(first) = ps.first().filter(|f| f.p.device().is_cuda()) {
        if ps
            .iter()
            .all(|q| q.p.device().same_device(first.p.device()))
        {
            return cuda::update_all(ps, c);
        }
    }
    ps.iter().map(|q| update_cpu(q, c)).collect()
}

fn update_cpu(q: &Param<'_>, c: AdamWStep) -> candle_core::Result<(Tensor, Tensor)> {
    let p = q.p;
    let g = q.g.contiguous()?;
    let (m, v) = (
        q.m.map(Tensor::contiguous).transpose()?,
        q.v.map(Tensor::contiguous).transpose()?,
    );
    let n = p.elem_count();
    let (sg, lg) = g.storage_and_layout();
    let gs = cpu_f32(&sg, lg)?;
    let ms = m.as_ref().map(|m| m.storage_and_layout());
    let vs = v.as_ref().map(|v| v.storage_and_layout());
    let ms = ms.as_ref().map(|(s, l)| cpu_f32(s, l)).transpose()?;
    let vs = vs.as_ref().map(|(s, l)| cpu_f32(s, l)).transpose()?;
    for (what, len) in [
        ("gradient", Some(gs.len())),
        ("exp_avg", ms.map(<[f32]>::len)),
        ("exp_avg_sq", vs.map(<[f32]>::len)),
    ] {
        if let Some(len) = len.filter(|&l| l != n) {
            candle_core::bail!("{NAME}: {what} holds {len} elements, the parameter {n}");
        }
    }
    let op = Update {
        g: gs,
        m: ms,
        v: vs,
        c,
        decay: q.decay,
        out: std::sync::Mutex::new(None),
    };
    p.inplace_op1(&op)?;
    let (m1, v1) = op.out.into_inner().unwrap().expect("the CPU update ran");
    let dev = p.device();
    Ok((
        Tensor::from_vec(m1, p.shape(), dev)?,
        Tensor::from_vec(v1, p.shape(), dev)?,
    ))
}

fn cpu_f32<'a>(s: &'a Storage, l: &Layout) -> candle_core::Result<&'a [f32]> {
    match s {
        Storage::Cpu(c) => slice(c, l, NAME),
        _ => candle_core::bail!("{NAME}: expects CPU tensors"),
    }
}

struct Update<'a> {
    g: &'a [f32],
    m: Option<&'a [f32]>,
    v: Option<&'a [f32]>,
    c: AdamWStep,
    decay: Option<f64>,
    out: std::sync::Mutex<Option<(Vec<f32>, Vec<f32>)>>,
}

impl InplaceOp1 for Update<'_> {
    fn name(&self) -> &'static str {
        NAME
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
        let (a, b) = l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg(format!("{NAME}: parameter not contiguous")))?;
        let p = match s {
            CpuStorage::F32(p) => &mut p[a..b],
            other => candle_core::bail!(
                "{NAME}: expects an f32 parameter, got {:?}",
                candle_core::backend::BackendStorage::dtype(other)
            ),
        };
        let n = p.len();
        let f = |x: f64| x as f32;
        let c = self.c;
        let k = Coeffs {
            decay: self.decay.map(f),
            b1: f(c.beta1),
            c1: f(1.0 - c.beta1),
            b2: f(c.beta2),
            c2: f(1.0 - c.beta2),
            inv: f(c.inv_bc2_sqrt),
            eps: f(c.eps),
            step: f(c.step_size),
        };
        // Before the first step the moments are zero, which gives the same bits as the
        // composed update's first step (0 * b + 0 + x = x, and x is never -0).
        let zeros = match (self.m, self.v) {
            (Some(_), Some(_)) => Vec::new(),
            _ => vec![0f32; n],
        };
        let (m0, v0) = (self.m.unwrap_or(&zeros), self.v.unwrap_or(&zeros));
        let (mut m1, mut v1) = (Out::<f32>::new(n), Out::<f32>::new(n));
        let (mo, vo, po) = (m1.rows(), v1.rows(), super::Rows(p.as_mut_ptr()));
        par_elems(n, |r| {
            // SAFETY: blocks are disjoint and within `n`, for all three buffers.
            let (p, m, v) = unsafe { (po.get(r.clone()), mo.get(r.clone()), vo.get(r.clone())) };
            let (g, m0, v0) = (&self.g[r.clone()], &m0[r.clone()], &v0[r]);
            k.apply(p, m, v, g, m0, v0);
        });
        // SAFETY: the blocks covered `0..n` of both moments.
        let moments = unsafe { (m1.into_vec(n), v1.into_vec(n)) };
        *self.out.lock().unwrap() = Some(moments);
        Ok(())
    }
}

/// One step's f32 coefficients.
#[derive(Clone, Copy)]
struct Coeffs {
    decay: Option<f32>,
    b1: f32,
    c1: f32,
    b2: f32,
    c2: f32,
    inv: f32,
    eps: f32,
    step: f32,
}

impl Coeffs {
    /// The update of one block, compiled for AVX-512 and AVX2 too and chosen at run time.
    fn apply(
        &self,
        p: &mut [f32],
        m: &mut [f32],
        v: &mut [f32],
        g: &[f32],
        m0: &[f32],
        v0: &[f32],
    ) {
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f")]
            unsafe fn avx512(
                c: &Coeffs,
                a: (&mut [f32], &mut [f32], &mut [f32]),
                b: (&[f32], &[f32], &[f32]),
            ) {
                c.update(a, b)
            }
            #[target_feature(enable = "avx2")]
            unsafe fn avx2(
                c: &Coeffs,
                a: (&mut [f32], &mut [f32], &mut [f32]),
                b: (&[f32], &[f32], &[f32]),
            ) {
                c.update(a, b)
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has AVX-512F.
                return unsafe { avx512(self, (p, m, v), (g, m0, v0)) };
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2.
                return unsafe { avx2(self, (p, m, v), (g, m0, v0)) };
            }
        }
        self.update((p, m, v), (g, m0, v0))
    }

    /// Each line is one of the composed update's tensor ops (affine: `x * mul + add`); without
    /// fused multiply-adds (Rust never contracts), so the bits are the composed ones.
    #[inline(always)]
    fn update(
        &self,
        (p, m, v): (&mut [f32], &mut [f32], &mut [f32]),
        (g, m0, v0): (&[f32], &[f32], &[f32]),
    ) {
        let c = *self;
        for (((((pk, mk), vk), &g), &m0), &v0) in p.iter_mut().zip(m).zip(v).zip(g).zip(m0).zip(v0)
        {
            let mut x = *pk;
            if let Some(d) = c.decay {
                x = x * d + 0.0;
            }
            let m1 = (m0 * c.b1 + 0.0) + (g * c.c1 + 0.0);
            let v1 = (v0 * c.b2 + 0.0) + ((g * g) * c.c2 + 0.0);
            let denom = (v1.sqrt() * c.inv + 0.0) * 1.0 + c.eps;
            *pk = x - ((m1 / denom) * c.step + 0.0);
            *mk = m1;
            *vk = v1;
        }
    }
}

/// The same on a CUDA device (kernels/cuda/adamw.cu), every parameter in one launch: each
/// updated in place, the new moments written into two fresh buffers (the old ones may be held
/// elsewhere, by a checkpoint being written, say), each parameter's a view of its part.
#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::cuda_backend::cudarc::driver::DeviceRepr;
    use candle_core::{DType, Device, Shape, Tensor};

    use super::{AdamWStep, Param, NAME};
    use crate::kernels::gpu::{self, tensor_addr, PushKernelArg};
    use crate::kernels::gpu_table::{parts, Table};

    /// adamw.cu's `Coeffs`.
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Coeffs {
        b1: f32,
        c1: f32,
        b2: f32,
        c2: f32,
        inv: f32,
        eps: f32,
        step: f32,
    }
    // SAFETY: plain old data laid out as the kernel's struct.
    unsafe impl DeviceRepr for Coeffs {}

    /// `q`'s gradient and moments, contiguous and checked against its parameter.
    fn inputs(q: &Param<'_>) -> candle_core::Result<[Option<Tensor>; 3]> {
        let n = q.p.elem_count();
        if q.p.dtype() != DType::F32 || !q.p.is_contiguous() {
            candle_core::bail!(
                "{NAME}: expects contiguous f32 parameters, got {:?}",
                q.p.dtype()
            );
        }
        let check = |what: &str, t: Option<&Tensor>| {
            let Some(t) = t else { return Ok(None) };
            if t.elem_count() != n || t.dtype() != DType::F32 {
                candle_core::bail!(
                    "{NAME}: {what} is {:?} {:?}, the parameter {n} f32",
                    t.dims(),
                    t.dtype()
                );
            }
            t.contiguous().map(Some)
        };
        let fresh = q.m.is_none() || q.v.is_none();
        Ok([
            check("the gradient", Some(q.g))?,
            check("exp_avg", q.m.filter(|_| !fresh))?,
            check("exp_avg_sq", q.v.filter(|_| !fresh))?,
        ])
    }

    pub(super) fn update_all(
        ps: &[Param<'_>],
        c: AdamWStep,
    ) -> candle_core::Result<Vec<(Tensor, Tensor)>> {
        let Device::Cuda(dev) = ps[0].p.device() else {
            candle_core::bail!("{NAME}: expects GPU parameters");
        };
        let ins: Vec<[Option<Tensor>; 3]> = ps.iter().map(inputs).collect::<Result<_, _>>()?;
        // Before a parameter's first step its moments are zero: the new ones start as the old.
        let fresh = ins.iter().any(|i| i[1].is_none());
        let shapes: Vec<&Shape> = ps.iter().map(|q| q.p.shape()).collect();
        let m1 = parts(ps[0].p, DType::F32, &shapes, fresh, NAME)?;
        let v1 = parts(ps[0].p, DType::F32, &shapes, fresh, NAME)?;
        let mut table = Table::new(usize::MAX);
        for ((q, [g, m, v]), ((m1q, _), (v1q, _))) in ps.iter().zip(&ins).zip(m1.iter().zip(&v1)) {
            let addr = |t: &Option<Tensor>, own: u64| match t {
                Some(t) => tensor_addr(t, NAME),
                None => Ok(own),
            };
            let p = [
                tensor_addr(q.p, NAME)?,
                addr(g, 0)?,
                addr(m, *m1q)?,
                addr(v, *v1q)?,
                *m1q,
                *v1q,
            ];
            table.push(
                p,
                q.p.elem_count(),
                q.decay.unwrap_or(1.0) as f32,
                q.decay.is_some(),
            );
        }
        let out = m1
            .into_iter()
            .zip(v1)
            .map(|((_, m), (_, v))| (m, v))
            .collect();
        let Some((items, count, cfg)) = table.upload(dev, NAME)? else {
            return Ok(out);
        };
        let f = |x: f64| x as f32;
        let k = Coeffs {
            b1: f(c.beta1),
            c1: f(1.0 - c.beta1),
            b2: f(c.beta2),
            c2: f(1.0 - c.beta2),
            inv: f(c.inv_bc2_sqrt),
            eps: f(c.eps),
            step: f(c.step_size),
        };
        let kernel = gpu::func(dev, &gpu::ADAMW, "adamw", DType::F32)?;
        gpu::launch(&kernel, cfg, table.blocks(), |b| {
            b.arg(&items).arg(&count).arg(&k);
        })?;
        Ok(out)
    }
}
