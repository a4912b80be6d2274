//! Evaluation through the pipeline (Varuna's `evaluate`): one forward of a batch in evaluation
//! mode through every stage in turn, the loss on the last stage, both given to every rank.

use candle_core::{DType, Device, Tensor};

use super::stage::PipelineStage;
use super::transfer::{recv_activation, send_activation};
use crate::distributed::comm::{Pending, ReduceOp};
use crate::model::batch::Batch;
use crate::model::{Activation, Cx, KvCache};
use crate::parallel::loss::output_in_f32;
use crate::parallel::tensor_parallel::whole_output;
use crate::Result;

/// What [`super::Pipeline::forward_only`] gives every rank of the pipeline.
#[derive(Clone, Debug)]
pub struct ForwardOnly {
    /// The loss summed over the batch and the count it averages over, when asked for.
    pub loss: Option<(f64, usize)>,
    /// The model output in f32, whole (gathered over the tensor-parallel group), when asked
    /// for.
    pub output: Option<Tensor>,
}

impl PipelineStage {
    /// Runs `batch` as one micro-batch through every stage in evaluation mode (collective over
    /// the pipeline). With `with_loss` the batch must hold the loss's targets.
    pub fn forward_only(
        &self,
        batch: &Batch,
        with_loss: bool,
        with_output: bool,
    ) -> Result<ForwardOnly> {
        self.forward_cached(batch, with_loss, with_output, None)
    }

    /// [`PipelineStage::forward_only`] through a key/value cache of this rank's stages: the
    /// batch's tokens follow the cached ones (incremental decoding). The caller advances the
    /// cache after the call.
    pub fn forward_cached(
        &self,
        batch: &Batch,
        with_loss: bool,
        with_output: bool,
        cache: Option<&KvCache>,
    ) -> Result<ForwardOnly> {
        let last = self.stage_count() - 1;
        let mut sends: Vec<Pending<()>> = Vec::new();
        let (mut loss, mut output) = (None, None);
        for (k, stage) in &self.own {
            let k = *k;
            let x = if k == 0 {
                Activation::from_batch(batch, self.input_names(), "model stage 0")?
            } else {
                let recv = |src, tag| self.recv_timed(src, tag);
                let msg = self.tags.activation(0, k - 1, false);
                recv_activation(&recv, self.rank_of(k - 1), msg, &self.device)?
            };
            let imports = self.import_skips(k, 0)?;
            let mut cx = Cx::eval();
            cx.kv_cache = cache.cloned();
            let (y, exports) = self
                .skips
                .run(stage, (k, k == last), x, &imports, &mut cx, None)?;
            self.export_skips(0, &exports, &mut sends)?;
            if k < last {
                let (to, msg) = (self.rank_of(k + 1), self.tags.activation(0, k, false));
                sends.extend(send_activation(self.comm.as_ref(), &y, to, msg)?);
                continue;
            }
            let y = output_in_f32(y, &mut cx)?;
            if with_loss {
                let (sum, count) = self.loss.sum(&y, batch, &cx, &self.tp)?;
                loss = Some((sum.to_dtype(DType::F64)?.to_scalar::<f64>()?, count));
            }
            if with_output {
                let t = y.into_tensor("model output")?;
                output = Some(whole_output(&t, &cx, &self.tp)?);
            }
        }
        for s in sends {
            s.wait()?;
        }
        let owner = self.rank_of(last);
        let loss = if with_loss {
            let (s, n) = loss.unwrap_or((0.0, 0));
            let t = Tensor::new(&[s, n as f64], &Device::Cpu)?;
            let v = self.comm.all_reduce(&t, ReduceOp::Sum)?.to_vec1::<f64>()?;
            Some((v[0], v[1] as usize))
        } else {
            None
        };
        let output = if with_output {
            // Ranks without the last stage contribute an empty f32 tensor.
            let mine = match output {
                Some(y) => y.to_device(&Device::Cpu)?,
                None => Tensor::zeros(0, DType::F32, &Device::Cpu)?,
            };
            let mut all = self.comm.all_gather(&mine)?;
            Some(all.swap_remove(owner).to_device(&self.device)?)
        } else {
            None
        };
        Ok(ForwardOnly { loss, output })
    }
}
