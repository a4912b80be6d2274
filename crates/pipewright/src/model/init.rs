//! Parameter initialisation keyed by global parameter name.
//!
//! Every parameter draws its values from a random stream seeded by (run seed, init key), where
//! the key is the parameter's global name unless a layer says otherwise (a tied weight uses its
//! partner's key). So a rank that builds only layers 5..9 gets exactly the values a serial run
//! gives those layers: initialisation never depends on how a model is split.

use candle_core::{DType, Device, Tensor, Var};
use rand::Rng;

use crate::runtime::seed::{normal_vec, rng_for};
use crate::Result;

/// Where and how layers create their parameters.
#[derive(Clone, Debug)]
pub struct Init {
    /// Where tensors are made.
    pub device: Device,
    /// Their element type.
    pub dtype: DType,
    /// The run's seed, mixed with each tensor's name.
    pub seed: u64,
}

impl Init {
    /// Initialises on `device` in `dtype` from `seed`.
    pub fn new(device: Device, dtype: DType, seed: u64) -> Self {
        Self {
            device,
            dtype,
            seed,
        }
    }

    /// A CPU f32 initialiser.
    pub fn cpu(seed: u64) -> Self {
        Self::new(Device::Cpu, DType::F32, seed)
    }

    /// Elements of a parameter `key` of `shape`, once it is known to fit: a large one's f64
    /// draws and tensor are checked against the memory available before either is allocated.
    fn elements(&self, key: &str, shape: &[usize]) -> Result<usize> {
        let n = shape
            .iter()
            .try_fold(1usize, |n, d| n.checked_mul(*d))
            .ok_or_else(|| crate::invalid!("parameter `{key}` of shape {shape:?} is too large"))?;
        let bytes = n as f64 * (8 + self.dtype.size_in_bytes()) as f64;
        // Reading the system's free memory for every small parameter would cost more than the
        // parameter: only one that could matter is checked.
        if bytes < (64 << 20) as f64 {
            return Ok(n);
        }
        crate::runtime::memory::check_fits(
            bytes,
            &format!("parameter `{key}` of shape {shape:?}"),
            "make the model smaller",
        )?;
        Ok(n)
    }

    fn var(&self, values: Vec<f64>, shape: &[usize]) -> Result<Var> {
        let t = Tensor::from_vec(values, shape, &Device::Cpu)?
            .to_dtype(self.dtype)?
            .to_device(&self.device)?;
        Ok(Var::from_tensor(&t)?)
    }

    /// Normal(0, std) values drawn from the stream of `key`.
    pub fn normal(&self, key: &str, shape: &[usize], std: f64) -> Result<Var> {
        let n = self.elements(key, shape)?;
        let mut rng = rng_for(self.seed, key);
        self.var(normal_vec(&mut rng, n, 0.0, std), shape)
    }

    /// Uniform(-bound, bound) values drawn from the stream of `key` (PyTorch's default for
    /// linear and convolution layers uses bound = 1/sqrt(fan_in)).
    pub fn uniform(&self, key: &str, shape: &[usize], bound: f64) -> Result<Var> {
        let n = self.elements(key, shape)?;
        let mut rng = rng_for(self.seed, key);
        let v = (0..n)
            .map(|_| (rng.random::<f64>() * 2.0 - 1.0) * bound)
            .collect();
        self.var(v, shape)
    }

    /// A parameter filled with one value.
    pub fn constant(&self, shape: &[usize], value: f64) -> Result<Var> {
        let n = self.elements("constant", shape)?;
        self.var(vec![value; n], shape)
    }
}
