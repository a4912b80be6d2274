//! The planner's prediction for a run's own layout, kept in the run directory
//! (`prediction.json`) so that its report draws the predicted step beside the measured one:
//! the step time, MFU, each pipeline rank's peak memory and the simulated timeline (each
//! action as its printed form and its start and end in seconds).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::parallel::pipeline::schedule::Action;
use crate::parallel::pipeline::timeline::Span;
use crate::parallel::pipeline::Simulation;
use crate::plan::{Estimate, Hardware};
use crate::{invalid, Error, Result};

/// The file's name in a run directory.
pub const FILE: &str = "prediction.json";

/// What the planner predicted for a run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// The hardware file it assumed (its name).
    pub hardware: String,
    /// The device's peak FLOP/s the MFU is over.
    pub peak_flops: f64,
    /// Seconds of a step.
    pub step_s: f64,
    /// The model's FLOPs over the step and every rank's peak, when known.
    pub mfu: Option<f64>,
    /// Idle share of the pipeline (the simulation's).
    pub bubble: f64,
    /// Each pipeline rank's peak allocated bytes: what the rank itself allocates (the
    /// hardware's runtime memory, a CUDA context's say, left out), as `train`'s allocator
    /// counts a rank's live bytes.
    pub peak_bytes: Vec<f64>,
    /// Per pipeline rank, its actions: `(action, start s, end s)`.
    pub spans: Vec<Vec<(String, f64, f64)>>,
    /// The simulated pipeline's makespan in seconds.
    pub makespan: f64,
}

impl Prediction {
    /// The prediction of `e` and its simulation `sim` on `hw` (MFU over `peak_flops`).
    pub fn new(hw: &Hardware, peak_flops: f64, e: &Estimate, sim: &Simulation) -> Self {
        let runtime = hw.runtime_bytes() as f64;
        Self {
            hardware: hw.name.clone(),
            peak_flops,
            step_s: e.step_s,
            mfu: e.mfu,
            bubble: e.bubble,
            peak_bytes: e.peak_bytes.iter().map(|b| b - runtime).collect(),
            spans: sim
                .spans
                .iter()
                .map(|row| {
                    row.iter()
                        .map(|s| (s.action.to_string(), s.start, s.end))
                        .collect()
                })
                .collect(),
            makespan: sim.makespan,
        }
    }

    /// Writes it into the run directory `dir` (atomically).
    pub fn save(&self, dir: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self).map_err(|e| invalid!("{e}"))?;
        crate::runtime::files::write_atomic(&dir.join(FILE), text.as_bytes())
    }

    /// Reads `path` (none when it does not exist).
    pub fn load(path: &Path) -> Result<Option<Self>> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io("cannot read", path, e)),
        };
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| invalid!("{} is malformed: {e}", path.display()))
    }

    /// The predicted timeline as a simulation (for drawing beside a measured one).
    pub fn simulation(&self) -> Result<Simulation> {
        let spans = self
            .spans
            .iter()
            .map(|row| {
                row.iter()
                    .map(|(a, start, end)| {
                        Ok(Span {
                            start: *start,
                            end: *end,
                            action: a.parse::<Action>()?,
                        })
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Simulation {
            peak_in_flight: vec![0; spans.len()],
            bubble: self.bubble,
            spans,
            makespan: self.makespan,
        })
    }
}
