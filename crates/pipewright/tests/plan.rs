//! Profiling and balancing a model: a layer far larger than the others gets a stage of its
//! own by size, and is the slowest by time.

use candle_core::{DType, Device, Tensor, Var};
use pipewright::model::{Activation, Cx, Layer, LayerSpec, Sequential};
use pipewright::nn::{Linear, Module};
use pipewright::plan::{balance_by, profile_layers, By};
use pipewright::{Batch, Build, Result};

struct Dense(Linear, String);

impl Layer for Dense {
    fn name(&self) -> &str {
        &self.1
    }
    fn forward(&self, x: Activation, _cx: &mut Cx) -> Result<Activation> {
        Ok(self.0.forward(&x.into_tensor(&self.1)?)?.tanh()?.into())
    }
    fn params(&self) -> Vec<(String, Var)> {
        self.0.params()
    }
}

fn model(widths: &[usize]) -> Sequential {
    let mut m = Sequential::new();
    for (i, w) in widths.windows(2).enumerate() {
        let (inp, out) = (w[0], w[1]);
        let name = format!("l{i}");
        m.push(LayerSpec::new(name.clone(), move |b: &Build| {
            Ok(
                Box::new(Dense(Linear::new(b, &name, inp, out, true)?, name.clone()))
                    as Box<dyn Layer>,
            )
        }));
    }
    m
}

#[test]
fn a_huge_layer_is_isolated_by_size_and_slowest_by_time() {
    // l2 is 512 x 512; the others at most 16 x 512.
    let m = model(&[16, 16, 512, 512, 16, 16]);
    let x = Tensor::ones((64, 16), DType::F32, &Device::Cpu).unwrap();
    let sample = Batch::input(x);
    let costs = profile_layers(&m, &Build::cpu(0), &sample, 3).unwrap();
    assert_eq!(costs.len(), 5);
    assert_eq!(costs[2].param_bytes, (512 * 512 + 512) * 4);
    assert_eq!(costs[0].activation_bytes, 64 * 16 * 4);
    assert!(costs[2].time() > costs[0].time(), "{costs:?}");
    let b = balance_by(By::Size, &m, &Build::cpu(0), &sample, 3).unwrap();
    assert_eq!(b, vec![2, 1, 2], "l2 alone");
}
