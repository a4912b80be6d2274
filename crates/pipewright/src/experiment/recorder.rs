//! pystematic's Recorder: scalars to TensorBoard and to `scalars.csv`.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::tfevents::EventWriter;
use crate::{Error, Result};

/// One row of the training log.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScalarRow {
    pub step: u64,
    pub loss: f64,
    pub lr: f64,
    /// The task's metric, when it was evaluated at this step.
    pub metric: Option<f64>,
}

/// Writes `scalars.csv` (`step,loss,lr,metric`) and TensorBoard events side by side.
pub struct Recorder {
    csv_path: PathBuf,
    csv: BufWriter<File>,
    events: EventWriter,
    metric_tag: String,
}

impl Recorder {
    /// `metric_tag` names the metric in TensorBoard (`metric/accuracy`).
    pub fn create(dir: &Path, metric_tag: &str) -> Result<Self> {
        let csv_path = dir.join("scalars.csv");
        let file = File::create(&csv_path).map_err(|e| Error::io("cannot create", &csv_path, e))?;
        let mut csv = BufWriter::new(file);
        writeln!(csv, "step,loss,lr,metric")
            .map_err(|e| Error::io("cannot write", &csv_path, e))?;
        Ok(Self {
            csv_path,
            csv,
            events: EventWriter::create(dir)?,
            metric_tag: metric_tag.to_string(),
        })
    }

    /// Goes on with the run in `dir` from step `from` (a resumed run): `scalars.csv` keeps its
    /// rows of the steps before `from` (a later row would be a duplicate) and grows from
    /// there; TensorBoard events go to a new events file.
    pub fn resume(dir: &Path, metric_tag: &str, from: u64) -> Result<Self> {
        let csv_path = dir.join("scalars.csv");
        let old = std::fs::read_to_string(&csv_path).unwrap_or_default();
        let mut kept = String::from("step,loss,lr,metric\n");
        for line in old.lines().skip(1) {
            let step = line.split(',').next().and_then(|s| s.parse::<u64>().ok());
            if step.is_some_and(|s| s < from) {
                kept.push_str(line);
                kept.push('\n');
            }
        }
        let tmp = dir.join(".scalars.csv.tmp");
        std::fs::write(&tmp, kept).map_err(|e| Error::io("cannot write", &tmp, e))?;
        std::fs::rename(&tmp, &csv_path)
            .map_err(|e| Error::io("cannot rename into", &csv_path, e))?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(&csv_path)
            .map_err(|e| Error::io("cannot open", &csv_path, e))?;
        Ok(Self {
            csv_path,
            csv: BufWriter::new(file),
            events: EventWriter::create(dir)?,
            metric_tag: metric_tag.to_string(),
        })
    }

    /// Writes one row (and its TensorBoard scalars).
    pub fn record(&mut self, row: ScalarRow) -> Result<()> {
        let metric = row.metric.map(|m| m.to_string()).unwrap_or_default();
        writeln!(self.csv, "{},{},{},{}", row.step, row.loss, row.lr, metric)
            .map_err(|e| Error::io("cannot write", &self.csv_path, e))?;
        let mut s = vec![("train/loss", row.loss as f32), ("train/lr", row.lr as f32)];
        if let Some(m) = row.metric {
            s.push((self.metric_tag.as_str(), m as f32));
        }
        self.events.scalars(row.step, &s)
    }

    pub fn flush(&mut self) -> Result<()> {
        self.csv
            .flush()
            .map_err(|e| Error::io("cannot write", &self.csv_path, e))?;
        self.events.flush()
    }
}
