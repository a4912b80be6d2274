//! [`PipelineSpec`]: the pipeline section of a run, which schedule it runs, how its layers
//! split over the stages ([`Balance`]), what it recomputes and how batch norm's statistics
//! move. The executor's [`PipelineOptions`](super::PipelineOptions) holds it whole.

use serde::{Deserialize, Serialize};

use super::recompute::Recompute;
use super::schedule::{Schedule, ScheduleKind};
use crate::runtime::flag_values::positive;
use crate::{invalid, Error, Result};

/// How layers are split over the model stages: parsed from `3,2`, `time` (or `auto`) and
/// `size`, and serialized as that text (`--balance`'s value); a spec written before reads too
/// (`{"layers": [3, 2]}`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Balance {
    /// Layers (or segments between cut points) per model stage.
    Layers(Vec<usize>),
    /// Profiled on one micro-batch: the split whose slowest stage is least.
    Time,
    /// Profiled on one micro-batch: the split whose largest stage is least.
    Size,
}

impl std::str::FromStr for Balance {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.trim() {
            "time" | "auto" => Self::Time,
            "size" => Self::Size,
            list => Self::Layers(
                list.split(',')
                    .map(|n| n.trim().parse::<usize>())
                    .collect::<std::result::Result<_, _>>()
                    .map_err(|_| {
                        invalid!("balance `{list}`: give layers per stage (3,2), time or size")
                    })?,
            ),
        })
    }
}

impl std::fmt::Display for Balance {
    /// What [`Balance::from_str`](std::str::FromStr) reads back: `3,2`, `time` or `size`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Layers(l) => {
                let list: Vec<String> = l.iter().map(usize::to_string).collect();
                f.write_str(&list.join(","))
            }
            Self::Time => f.write_str("time"),
            Self::Size => f.write_str("size"),
        }
    }
}

impl Serialize for Balance {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Balance {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        /// The two ways a balance has been written.
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Written {
            Text(String),
            Layers { layers: Vec<usize> },
        }
        match Written::deserialize(d)? {
            Written::Text(t) => t.parse().map_err(serde::de::Error::custom),
            Written::Layers { layers } => Ok(Self::Layers(layers)),
        }
    }
}

/// A schedule's name as a record holds it; `file PATH`, which `train` recorded for a schedule
/// file before the file had a field of its own, reads as the default (1F1B).
fn schedule_name<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<ScheduleKind, D::Error> {
    let name = std::borrow::Cow::<str>::deserialize(d)?;
    match name.starts_with("file ") {
        true => Ok(ScheduleKind::OneFOneB),
        false => name.parse().map_err(serde::de::Error::custom),
    }
}

/// The schedule a pipeline is built with: its kind, model stages per rank and which
/// micro-batches recompute. What the planner chooses for a candidate, and the core of a run's
/// pipeline section (serialized flat there: `"schedule"`, `"virtual_stages"`, `"recompute"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::Args)]
pub struct ScheduleChoice {
    /// Pipeline schedule: gpipe, 1f1b, interleaved, zb1 (zero-bubble H1), zbv (zero-bubble
    /// V: two stages per rank, the first and last on rank 0) or dualpipev (DeepSeek's, at
    /// least 2 x pp chunks).
    #[arg(
        id = "schedule",
        help_heading = "Parallelism",
        long = "schedule",
        value_name = "SCHEDULE",
        default_value = "1f1b"
    )]
    #[serde(rename = "schedule", deserialize_with = "schedule_name")]
    pub kind: ScheduleKind,
    /// Model chunks per pipeline stage (interleaved schedule).
    #[arg(help_heading = "Parallelism", long = "virtual", value_name = "VIRTUAL", default_value_t = 1, value_parser = positive)]
    pub virtual_stages: usize,
    /// Activation recomputation: always, except_last or never.
    #[arg(help_heading = "Parallelism", long, default_value = "never")]
    pub recompute: Recompute,
}

impl Default for ScheduleChoice {
    /// 1F1B, one stage per rank, nothing recomputed.
    fn default() -> Self {
        Self {
            kind: ScheduleKind::OneFOneB,
            virtual_stages: 1,
            recompute: Recompute::Never,
        }
    }
}

impl ScheduleChoice {
    /// Model stages each pipeline rank holds.
    pub fn stages_per_rank(&self) -> usize {
        self.kind.stages_per_rank(self.virtual_stages)
    }
}

impl std::fmt::Display for ScheduleChoice {
    /// `1f1b v1`: the schedule and its stages per rank, as the planner's tables name them.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} v{}", self.kind, self.virtual_stages)
    }
}

/// The pipeline section of a run (serialized flat into its run's spec). Its fields are
/// `train`'s flags of the same names (clap's derive; the schedule file, a path the program
/// reads into `custom_schedule`, is the program's own flag).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, clap::Args)]
pub struct PipelineSpec {
    /// The built schedule, its stages per rank and what is recomputed.
    #[command(flatten)]
    #[serde(flatten)]
    pub schedule: ScheduleChoice,
    /// A schedule given as data (`--schedule-file`: saved by `pipewright schedule --save`,
    /// edited or written by hand, or dumped by PyTorch): when set, it replaces `schedule` and
    /// `virtual_stages`. Recorded as its text; runs recorded before it had none.
    #[arg(skip)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub custom_schedule: Option<Schedule>,
    /// Layers (or segments between cut points) per model stage: a list (`3,2`), or `time`
    /// (`auto`) or `size` to profile the model on one micro-batch here and take the balance
    /// whose slowest (largest) stage is least. Uniform when not given.
    #[arg(help_heading = "Parallelism", long)]
    pub balance: Option<Balance>,
    /// Deferred batch norm: BatchNorm running statistics move once per batch, over all
    /// micro-batches (as whole-batch statistics would).
    #[arg(help_heading = "Parallelism", long)]
    pub deferred_batch_norm: bool,
}

impl Default for PipelineSpec {
    /// 1F1B, one stage per rank, a uniform split, nothing recomputed.
    fn default() -> Self {
        Self {
            schedule: ScheduleChoice::default(),
            custom_schedule: None,
            balance: None,
            deferred_batch_norm: false,
        }
    }
}

impl PipelineSpec {
    /// The schedule a pipeline of `pp` ranks runs over `micro_batches`: the given one
    /// (checked to fit, complete and deadlock-free), else the built one.
    pub fn schedule_for(&self, pp: usize, micro_batches: usize) -> Result<Schedule> {
        let s = Schedule::for_pipeline(
            self.custom_schedule.as_ref(),
            self.schedule.kind,
            self.schedule.virtual_stages,
            pp,
            micro_batches,
        )?;
        if self.custom_schedule.is_some() {
            s.validate()?;
        }
        Ok(s)
    }

    /// Layers per model stage when the balance is a list; `None` is uniform. A balance still
    /// to be profiled is an error: resolve it into layers first, the same on every rank.
    pub fn layers(&self) -> Result<Option<&[usize]>> {
        match &self.balance {
            None => Ok(None),
            Some(Balance::Layers(l)) => Ok(Some(l)),
            Some(b) => Err(invalid!(
                "the balance `{b:?}` is measured, not given: resolve it into layers per stage \
                 first (TrainSpec::resolve_balance, the same on every rank)"
            )),
        }
    }
}
