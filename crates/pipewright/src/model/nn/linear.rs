//! Fully connected layer.

use candle_core::{Tensor, Var};

use super::{join, Module};
use crate::model::deferred::{WeightGradQueue, Work};
use crate::model::init::Init;
use crate::model::Cx;
use crate::model::WeightLayout;
use crate::{kernels, Error, Result};

/// `y = x W^T + b` over the last dimension; any leading dimensions.
#[derive(Clone, Debug)]
pub struct Linear {
    name: String,
    weight: Var,
    bias: Option<Var>,
    layout: WeightLayout,
    in_features: usize,
    out_features: usize,
    /// Outputs whose bias cannot change the model's output (see [`Linear::inert_bias`]).
    inert_bias: Option<std::ops::Range<usize>>,
    /// GELU applied to the input first (see [`Linear::gelu_input`]).
    gelu_input: bool,
}

impl Linear {
    /// PyTorch's default initialisation: uniform(+-1/sqrt(in)) for weight and bias.
    pub fn new(init: &Init, name: &str, inp: usize, out: usize, bias: bool) -> Result<Self> {
        let bound = 1.0 / (inp as f64).sqrt();
        let w = init.uniform(&join(name, "weight"), &[out, inp], bound)?;
        let b = if bias {
            Some(init.uniform(&join(name, "bias"), &[out], bound)?)
        } else {
            None
        };
        Self::from_vars(name, w, b, WeightLayout::OutIn)
    }

    /// Normal(0, std) weight and zero bias, stored `(in, out)` as GPT-2's `Conv1D`.
    pub fn conv1d(init: &Init, name: &str, inp: usize, out: usize, std: f64) -> Result<Self> {
        let w = init.normal(&join(name, "weight"), &[inp, out], std)?;
        let b = init.constant(&[out], 0.0)?;
        Self::from_vars(name, w, Some(b), WeightLayout::InOut)
    }

    /// A linear layer from existing variables.
    pub fn from_vars(
        name: &str,
        weight: Var,
        bias: Option<Var>,
        layout: WeightLayout,
    ) -> Result<Self> {
        let (a, b) = weight.dims2()?;
        let (inp, out) = match layout {
            WeightLayout::OutIn => (b, a),
            WeightLayout::InOut => (a, b),
        };
        if let Some(bias) = &bias {
            if bias.dims() != [out] {
                return Err(Error::Layer {
                    layer: name.into(),
                    msg: format!("bias shape {:?} does not match {out} outputs", bias.dims()),
                });
            }
        }
        Ok(Self {
            name: name.to_string(),
            weight,
            bias,
            layout,
            in_features: inp,
            out_features: out,
            inert_bias: None,
            gelu_input: false,
        })
    }

    /// The weight, stored as [`Linear::layout`] says.
    pub fn weight(&self) -> &Var {
        &self.weight
    }

    /// Declares that the bias of `outputs` cannot change what the model computes, so its exact
    /// gradient is zero: attention's key bias, which shifts every score of a query's row by
    /// the same amount, and softmax ignores such shifts. That part of the bias is added as a
    /// constant, so its gradient is an exact zero rather than rounding noise (which AdamW,
    /// dividing by the noise's own size, would turn into full-size steps that differ between
    /// any two ways of summing the same numbers).
    pub fn inert_bias(mut self, outputs: std::ops::Range<usize>) -> Self {
        self.inert_bias = Some(outputs);
        self
    }

    /// Applies GPT-2's GELU (tanh form) to the input before the product: `gelu(x) W + b`, the
    /// second layer of a transformer's MLP with its activation folded in. On the CPU the
    /// activation is computed inside the fused product and never stored (the backward computes
    /// it again with its slope); elsewhere it is [`crate::model::nn::gelu`] then the product.
    pub fn gelu_input(mut self) -> Self {
        self.gelu_input = true;
        self
    }

    /// The bias, if any.
    pub fn bias(&self) -> Option<&Var> {
        self.bias.as_ref()
    }

    /// How the weight stores its features.
    pub fn layout(&self) -> WeightLayout {
        self.layout
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Input features.
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Output features.
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// [`Linear::forward`], or with its weight gradient deferred to `cx`'s queue.
    pub fn forward_cx(&self, x: &Tensor, cx: &Cx) -> Result<Tensor> {
        match &cx.weight_grads {
            None => self.forward(x),
            Some(q) => self.run(x, Some((q, cx.micro_batch))),
        }
    }

    /// `x W^T + b` over the last dimension of `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.run(x, None)
    }

    fn run(&self, x: &Tensor, defer: Option<(&WeightGradQueue, usize)>) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        if dims.last() != Some(&self.in_features) {
            return Err(Error::Layer {
                layer: self.name.clone(),
                msg: format!(
                    "expects last dimension {}, got input of shape {dims:?}",
                    self.in_features
                ),
            });
        }
        let bias = self.bias_tensor()?;
        let out_in = self.layout == WeightLayout::OutIn;
        if kernels::fused(x)
            && self.weight.dtype() == x.dtype()
            && bias.as_ref().is_none_or(|b| b.dtype() == x.dtype())
        {
            let w = self.weight.as_tensor();
            let Some((q, mb)) = defer else {
                return Ok(kernels::linear::linear(
                    x,
                    w,
                    bias.as_ref(),
                    out_in,
                    self.gelu_input,
                )?);
            };
            return self.deferred_fused(x, bias.as_ref(), (q, mb));
        }
        let activated;
        let x = if self.gelu_input {
            activated = super::gelu(x)?;
            &activated
        } else {
            x
        };
        let rows: usize = dims[..dims.len() - 1].iter().product();
        let x2 = x.reshape((rows, self.in_features))?;
        let weight = match defer {
            Some(_) => self.weight.as_tensor().detach(),
            None => self.weight.as_tensor().clone(),
        };
        if defer.is_none() && bias.is_none() && aligns(self.out_features, x) {
            let y = padded_product(&x2, &weight, self.layout)?;
            let mut out_dims = dims;
            let last = out_dims.len() - 1;
            out_dims[last] = y.dim(1)?;
            return Ok(y.reshape(out_dims)?.narrow(last, 0, self.out_features)?);
        }
        let w = match self.layout {
            WeightLayout::OutIn => weight.t()?,
            WeightLayout::InOut => weight,
        };
        let mut y = match defer {
            // No graph: the tap gives the input its gradient, and the weight's waits.
            Some(_) => x2.detach().matmul(&w)?,
            None => x2.matmul(&w)?,
        };
        if let Some((q, mb)) = defer {
            let work = Work::Matmul {
                layout: self.layout,
                gelu: false,
            };
            y = q.tap(
                y,
                &x2,
                self.weight.as_tensor(),
                None,
                mb,
                &join(&self.name, "weight"),
                work,
            )?;
        }
        if let Some(b) = &bias {
            y = add_bias(&y, b)?;
        }
        let mut out_dims = dims;
        *out_dims.last_mut().unwrap() = self.out_features;
        Ok(y.reshape(out_dims)?)
    }

    /// The fused product (bias and GELU of the input inside, as the undeferred forward
    /// computes it) with no graph, tapped so the input and the bias get their gradients in the
    /// input pass and the weight's waits in `q`: the graph keeps the input and the output only,
    /// as the fused linear's does, where a bias added after the tap and a GELU computed before
    /// it kept three more tensors (a GPT block's deferred forward held 1.8 times its fused one).
    fn deferred_fused(
        &self,
        x: &Tensor,
        bias: Option<&Tensor>,
        (q, mb): (&WeightGradQueue, usize),
    ) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let rows: usize = dims[..dims.len() - 1].iter().product();
        let x2 = x.reshape((rows, self.in_features))?;
        let w = self.weight.as_tensor();
        let out_in = self.layout == WeightLayout::OutIn;
        let y = kernels::linear::linear(
            &x2.detach(),
            &w.detach(),
            bias.map(Tensor::detach).as_ref(),
            out_in,
            self.gelu_input,
        )?;
        let work = Work::Matmul {
            layout: self.layout,
            gelu: self.gelu_input,
        };
        let name = join(&self.name, "weight");
        let y = q.tap(y, &x2, w, bias, mb, &name, work)?;
        let mut out_dims = dims;
        *out_dims.last_mut().unwrap() = self.out_features;
        Ok(y.reshape(out_dims)?)
    }

    /// The bias as the output adds it: with the inert part (see [`Linear::inert_bias`]) a
    /// constant, so its gradient is an exact zero.
    fn bias_tensor(&self) -> Result<Option<Tensor>> {
        let Some(b) = &self.bias else { return Ok(None) };
        let b = b.as_tensor();
        Ok(Some(match &self.inert_bias {
            Some(r) if !r.is_empty() => {
                let n = self.out_features;
                let parts = [
                    b.narrow(0, 0, r.start)?,
                    b.narrow(0, r.start, r.len())?.detach(),
                    b.narrow(0, r.end, n - r.end)?,
                ];
                Tensor::cat(&parts, 0)?
            }
            _ => b.clone(),
        }))
    }
}

/// Output features are padded to a multiple of this by [`padded_product`].
const ALIGN_OUT: usize = 64;

/// Whether a product of `out` features for `x` is computed padded ([`padded_product`]): on a
/// GPU, for at least 1024 outputs whose rows are not a multiple of 16 bytes. GPT-2's
/// vocabulary of 50257 makes the head's logits such rows, and cuBLAS then leaves its Hopper
/// tensor-core kernels for old ones (the profile's `cutlass_75` products: 15.4 ms of a 108 ms
/// step on an H200). nanoGPT pads the vocabulary to 50304, Megatron to a multiple of 128 in
/// the model and its checkpoints; here only the product is padded.
fn aligns(out: usize, x: &Tensor) -> bool {
    !x.device().is_cpu() && out >= 1024 && !(out * x.dtype().size_in_bytes()).is_multiple_of(16)
}

/// `x (rows, in)` times the weight (`(out, in)` for [`WeightLayout::OutIn`], `(in, out)` for
/// `InOut`) padded with zeros to a multiple of [`ALIGN_OUT`] outputs: `(rows, padded)`, whose
/// first `out` columns are `x W^T` and the rest zeros. The caller keeps the view of those
/// columns: the model, its checkpoints and its logits keep their size, and the padding never
/// reaches the loss (the cross-entropy reads the view's rows in place). The backward gives the
/// weight the first `out` rows of the padded weight's gradient.
pub(crate) fn padded_product(x: &Tensor, weight: &Tensor, layout: WeightLayout) -> Result<Tensor> {
    let out_dim = match layout {
        WeightLayout::OutIn => 0,
        WeightLayout::InOut => 1,
    };
    let out = weight.dim(out_dim)?;
    let pad = out.next_multiple_of(ALIGN_OUT) - out;
    let w = if pad == 0 {
        weight.clone()
    } else {
        let mut dims = weight.dims().to_vec();
        dims[out_dim] = pad;
        let zeros = Tensor::zeros(dims, weight.dtype(), weight.device())?;
        Tensor::cat(&[weight, &zeros], out_dim)?
    };
    Ok(match layout {
        WeightLayout::OutIn => x.matmul(&w.t()?)?,
        WeightLayout::InOut => x.matmul(&w)?,
    })
}

/// `y + b` on every row: on the CPU and a GPU a fused op whose backward sums the bias gradient
/// over contiguous rows (on the CPU, the deferred weight-gradient path, whose product stays
/// separate).
pub(crate) fn add_bias(y: &Tensor, b: &Tensor) -> Result<Tensor> {
    if kernels::fused_or_gpu(y) && b.dtype() == y.dtype() {
        return Ok(kernels::bias::bias_add(y, b)?);
    }
    Ok(y.broadcast_add(b)?)
}

impl Module for Linear {
    fn params(&self) -> Vec<(String, Var)> {
        let mut v = vec![(join(&self.name, "weight"), self.weight.clone())];
        if let Some(b) = &self.bias {
            v.push((join(&self.name, "bias"), b.clone()));
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};

    use super::{padded_product, WeightLayout};
    use crate::kernels::strided_rows;
    use crate::model::nn::cross_entropy;

    fn ramp(shape: &[usize], k: f32) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|i| (i as f32 * k).sin() * 2.0).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        let d = (a - b).unwrap().abs().unwrap().flatten_all().unwrap();
        d.max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    /// The padded product's view, through the cross-entropy, against the plain product: the
    /// loss, and the input's and the weight's gradients (both weight layouts; 1e-5 absolute:
    /// the products sum in other blocks).
    #[test]
    fn a_padded_product_trains_as_the_plain_one() {
        let (b, t, inp, out) = (2, 3, 8, 37);
        let targets = Tensor::new(&[[0u32, 36, 5], [17, 2, 30]], &Device::Cpu).unwrap();
        for layout in [WeightLayout::OutIn, WeightLayout::InOut] {
            let dims = match layout {
                WeightLayout::OutIn => [out, inp],
                WeightLayout::InOut => [inp, out],
            };
            let x = Var::from_tensor(&ramp(&[b * t, inp], 0.37)).unwrap();
            let w = Var::from_tensor(&ramp(&dims, 0.11)).unwrap();
            let plain = match layout {
                WeightLayout::OutIn => x.matmul(&w.t().unwrap()).unwrap(),
                WeightLayout::InOut => x.matmul(&w).unwrap(),
            };
            let padded = padded_product(&x, &w, layout).unwrap();
            assert_eq!(padded.dims(), &[b * t, 64]);
            let view = padded
                .reshape((b, t, 64))
                .unwrap()
                .narrow(2, 0, out)
                .unwrap();
            assert_eq!(strided_rows(view.layout()), Some((b * t, out, 64)));
            assert!(max_diff(&view.reshape((b * t, out)).unwrap(), &plain) < 1e-5);
            let l_pad = cross_entropy(&view, &targets).unwrap();
            let l_plain = cross_entropy(&plain.reshape((b, t, out)).unwrap(), &targets).unwrap();
            assert!(max_diff(&l_pad, &l_plain) < 1e-5);
            let (g_pad, g_plain) = (l_pad.backward().unwrap(), l_plain.backward().unwrap());
            for v in [&x, &w] {
                let (a, p) = (g_pad.get(v).unwrap(), g_plain.get(v).unwrap());
                assert_eq!(a.dims(), v.dims());
                assert!(max_diff(a, p) < 1e-5, "{layout:?}: {}", max_diff(a, p));
            }
        }
    }

    #[test]
    fn rows_at_one_stride_are_recognised() {
        let t = Tensor::zeros((2, 3, 10), DType::F32, &Device::Cpu).unwrap();
        assert_eq!(strided_rows(t.layout()), Some((6, 10, 10)));
        let v = t.narrow(2, 0, 7).unwrap();
        assert_eq!(strided_rows(v.layout()), Some((6, 7, 10)));
        // Rows of a middle slice: every leading dimension must step by the rows'.
        assert_eq!(strided_rows(t.narrow(1, 0, 2).unwrap().layout()), None);
        assert_eq!(strided_rows(t.transpose(0, 1).unwrap().layout()), None);
        assert_eq!(strided_rows(t.transpose(1, 2).unwrap().layout()), None);
        let one = Tensor::zeros((1, 1, 5), DType::F32, &Device::Cpu).unwrap();
        assert_eq!(strided_rows(one.layout()), Some((1, 5, 5)));
        let wide = Tensor::zeros((4, 1), DType::F32, &Device::Cpu).unwrap();
        assert_eq!(
            strided_rows(wide.broadcast_as((4, 6)).unwrap().layout()),
            None
        );
    }
}
