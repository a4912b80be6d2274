//! What a [`Varuna`] measures of its steps: each step's parts and exposed communication, the
//! bubble, and (for a trace) the actions and the data-parallel communication beside them.

use candle_core::{Device, Tensor};

use super::Varuna;
use crate::distributed::comm::waited;
use crate::parallel::pipeline::{CommEvent, TraceEvent};
use crate::plan::StepParts;
use crate::Result;

impl Varuna {
    /// Keeps every executed pipeline action for [`Varuna::take_trace`] (a Chrome trace), and
    /// the data-parallel communication beside them for [`Varuna::take_comm_trace`].
    pub fn keep_trace(&mut self) {
        self.trace.get_or_insert_with(Vec::new);
    }

    /// The actions kept so far.
    pub fn take_trace(&mut self) -> Vec<TraceEvent> {
        self.trace.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// The data-parallel communication kept so far (see [`Varuna::keep_trace`]).
    pub fn take_comm_trace(&mut self) -> Vec<CommEvent> {
        std::mem::take(&mut self.comm_trace)
    }

    /// Before step `step`: keeps this thread's communication spans when tracing. After it
    /// (`done`): files them as the step's, on the pipeline's clock.
    pub(super) fn trace_comm(&mut self, step: u64, done: bool) {
        if self.trace.is_none() {
            return;
        }
        waited::keep_spans(true);
        if !done {
            waited::take_spans();
            return;
        }
        for s in waited::take_spans() {
            let start_us = self.pipeline.trace_us(s.start);
            self.comm_trace.push(CommEvent {
                step,
                what: s.what,
                start_us,
                dur_us: self.pipeline.trace_us(s.end) - start_us,
                wait_us: s.waited * 1e6,
            });
        }
    }

    /// Where each step that updated the weights spent its time on this rank, part by part
    /// (steps skipped for an overflow left out).
    pub fn step_parts(&self) -> &[StepParts] {
        &self.parts
    }

    /// Fraction of step time this rank spent not computing (between actions, or inside one
    /// waiting for a neighbour's tensor), over the steps so far.
    pub fn bubble_fraction(&self) -> f64 {
        if self.wall > 0.0 {
            (1.0 - self.busy / self.wall).max(0.0)
        } else {
            0.0
        }
    }

    /// [`Varuna::bubble_fraction`] per pipeline rank (the stage coordinate: a rank of a V or
    /// interleaved schedule holds several model stages), averaged over the ranks that share it
    /// (collective over the world).
    pub fn bubble_per_stage(&self) -> Result<Vec<f64>> {
        let me = Tensor::new(
            &[self.coords.stage as f64, self.bubble_fraction()],
            &Device::Cpu,
        )?;
        let all = self.world.all_gather(&me)?;
        let pp = self.topo.layout().pp;
        let (mut sum, mut n) = (vec![0.0; pp], vec![0usize; pp]);
        for t in all {
            let v = t.to_vec1::<f64>()?;
            let s = v[0] as usize;
            sum[s] += v[1];
            n[s] += 1;
        }
        Ok(sum
            .iter()
            .zip(&n)
            .map(|(s, n)| s / (*n).max(1) as f64)
            .collect())
    }

    /// Each rank's median time waited on data-parallel communication per step, in world rank
    /// order ([`StepParts::exposed_comm_s`]; collective over the world).
    pub fn exposed_comm_per_rank(&self) -> Result<Vec<f64>> {
        let mine = StepParts::median_of(&self.parts).exposed_comm_s;
        let all = self
            .world
            .all_gather(&Tensor::new(&[mine], &Device::Cpu)?)?;
        all.iter().map(|t| Ok(t.to_vec1::<f64>()?[0])).collect()
    }
}
