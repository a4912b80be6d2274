//! Synthetic image classification: single-channel `size x size` images of a square, a disc, a
//! triangle or a cross at a random place and scale, random brightness, Gaussian noise. Each
//! image is a function of (seed, split, index). The metric is accuracy on 512 held-out images.

use candle_core::{Device, Tensor};
use pipewright::runtime::seed::{normal_vec, rng_for};
use pipewright::{invalid, Result};
use rand::Rng;

use super::{Predict, Task, TaskShape};

pub const CLASSES: [&str; 4] = ["square", "disc", "triangle", "cross"];
const TEST: usize = 512;

/// Images of a square, a disc, a triangle or a cross to classify, drawn in process (see the
/// module's text).
pub struct Shapes {
    size: usize,
    seed: u64,
}

impl Shapes {
    /// Images of `size` x `size` pixels, drawn from `seed`.
    pub fn new(size: usize, seed: u64) -> Result<Self> {
        if size < 8 {
            return Err(invalid!(
                "shapes images must be at least 8 pixels wide, got {size}"
            ));
        }
        Ok(Self { size, seed })
    }

    /// Image and class of example `key`.
    pub fn example(&self, key: &str) -> (Vec<f32>, i64) {
        let mut rng = rng_for(self.seed, key);
        let n = self.size as i64;
        let class = rng.random_range(0..CLASSES.len());
        let r = rng.random_range(n / 5..=n / 3) as f64;
        let cx = rng.random_range(r..n as f64 - r);
        let cy = rng.random_range(r..n as f64 - r);
        let bright = rng.random_range(0.6..1.0);
        let noise = normal_vec(&mut rng, (n * n) as usize, 0.0, 0.15);
        let mut img = vec![0f32; (n * n) as usize];
        for y in 0..n {
            for x in 0..n {
                let (dx, dy) = (x as f64 + 0.5 - cx, y as f64 + 0.5 - cy);
                let inside = match class {
                    0 => dx.abs() <= r * 0.8 && dy.abs() <= r * 0.8,
                    1 => dx * dx + dy * dy <= r * r,
                    2 => dy <= r * 0.8 && dy >= -r && dx.abs() <= (dy + r) * 0.55,
                    _ => {
                        (dx.abs() <= r * 0.3 && dy.abs() <= r)
                            || (dy.abs() <= r * 0.3 && dx.abs() <= r)
                    }
                };
                let i = (y * n + x) as usize;
                img[i] = (if inside { bright } else { 0.0 } + noise[i]) as f32;
            }
        }
        (img, class as i64)
    }

    fn tensors(&self, keys: impl Iterator<Item = String>) -> Result<(Tensor, Tensor)> {
        let mut xs = Vec::new();
        let mut ys = Vec::new();
        for k in keys {
            let (img, c) = self.example(&k);
            xs.extend(img);
            ys.push(c);
        }
        let b = ys.len();
        Ok((
            Tensor::from_vec(xs, (b, 1, self.size, self.size), &Device::Cpu)?,
            Tensor::from_vec(ys, b, &Device::Cpu)?,
        ))
    }
}

impl Task for Shapes {
    fn name(&self) -> &'static str {
        "shapes"
    }

    fn shape(&self) -> TaskShape {
        TaskShape::Images {
            channels: 1,
            size: self.size,
            classes: CLASSES.len(),
        }
    }

    fn metric_name(&self) -> &'static str {
        "accuracy"
    }

    fn higher_is_better(&self) -> bool {
        true
    }

    fn batch(&self, step: u64, batch_size: usize) -> Result<(Tensor, Tensor)> {
        self.tensors((0..batch_size).map(|i| format!("shapes/train/{step}/{i}")))
    }

    fn evaluate(&self, predict: &mut Predict<'_>) -> Result<f64> {
        let mut correct = 0;
        for start in (0..TEST).step_by(128) {
            let (x, y) =
                self.tensors((start..(start + 128).min(TEST)).map(|i| format!("shapes/test/{i}")))?;
            let pred = predict(&x)?
                .argmax(1)?
                .to_dtype(candle_core::DType::I64)?
                .to_vec1::<i64>()?;
            correct += pred
                .iter()
                .zip(y.to_vec1::<i64>()?)
                .filter(|(p, t)| **p == *t)
                .count();
        }
        Ok(correct as f64 / TEST as f64)
    }
}
