//! pystematic's Recorder: scalars by tag, images and figures, hyperparameters, written as
//! TensorBoard events and as files: `scalars.csv` (the training log: `step,loss,lr,metric`),
//! `tags.csv` (every other scalar: `count,tag,value`) and `images/<tag>-<count>.png`. Its
//! counter (`step()`, `count()`) is the step every record is filed under and is state a
//! checkpoint of the context saves, so that a resumed run goes on counting. Only the master
//! rank makes one.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::context::Stateful;
use super::image::{LinePlot, RgbImage};
use super::tfevents::{EventWriter, HParam};
use crate::{invalid, Error, Result};

/// One row of the training log.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScalarRow {
    /// The step (counted from 0).
    pub step: u64,
    /// The step's loss.
    pub loss: f64,
    /// The learning rate it used.
    pub lr: f64,
    /// The task's metric, when it was evaluated at this step.
    pub metric: Option<f64>,
}

const LOG_HEADER: &str = "step,loss,lr,metric";
const TAGS_HEADER: &str = "count,tag,value";

/// Size of a figure's picture.
pub const FIGURE_SIZE: (u32, u32) = (640, 400);

/// Writes the run's scalars, images and hyperparameters.
pub struct Recorder {
    dir: PathBuf,
    log: Csv,
    tags: Csv,
    events: EventWriter,
    metric_tag: String,
    count: u64,
}

/// A CSV file appended to a whole row at a time: each row is one `write` of the complete line
/// to a file opened for appending, so a run killed at any moment (SIGKILL, a second Ctrl-C)
/// leaves whole rows, never a torn one.
struct Csv {
    path: PathBuf,
    out: File,
}

/// The rows after the header of a CSV file's `text` that end in a newline (a run killed while
/// writing, or one still being written, may end in a torn line), without it.
pub fn whole_rows(text: &str) -> impl Iterator<Item = &str> {
    text.split_inclusive('\n')
        .skip(1)
        .filter(|l| l.ends_with('\n'))
        .map(str::trim_end)
}

impl Csv {
    /// Opens `path` keeping its whole rows (as many columns as `header`) whose first column is
    /// below `from` (none: a new file).
    fn open(path: PathBuf, header: &str, from: Option<u64>) -> Result<Self> {
        let columns = header.split(',').count();
        let mut kept = format!("{header}\n");
        if let Some(from) = from {
            let old = std::fs::read_to_string(&path).unwrap_or_default();
            // A row is whole when it ends in a newline and has every column.
            for line in whole_rows(&old) {
                let first = line.split(',').next().and_then(|s| s.parse::<u64>().ok());
                if first.is_some_and(|s| s < from) && line.split(',').count() == columns {
                    kept.push_str(line);
                    kept.push('\n');
                }
            }
        }
        crate::runtime::files::write_atomic(&path, kept.as_bytes())?;
        let out = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(|e| Error::io("cannot open", &path, e))?;
        Ok(Self { path, out })
    }

    fn row(&mut self, text: std::fmt::Arguments) -> Result<()> {
        let line = format!("{text}\n");
        self.out
            .write_all(line.as_bytes())
            .map_err(|e| Error::io("cannot write", &self.path, e))
    }

    fn flush(&mut self) -> Result<()> {
        self.out
            .flush()
            .map_err(|e| Error::io("cannot write", &self.path, e))
    }
}

impl Recorder {
    /// A recorder writing into `dir`; `metric_tag` names the training log's metric in
    /// TensorBoard (`metric/accuracy`).
    pub fn create(dir: &Path, metric_tag: &str) -> Result<Self> {
        Self::open(dir, metric_tag, None)
    }

    /// Goes on with the run in `dir` from step `from` (a resumed run): the CSV files keep
    /// their rows before `from` (a later row would be a duplicate) and grow from there; the
    /// counter starts at `from`; TensorBoard events go to a new events file.
    pub fn resume(dir: &Path, metric_tag: &str, from: u64) -> Result<Self> {
        Self::open(dir, metric_tag, Some(from))
    }

    fn open(dir: &Path, metric_tag: &str, from: Option<u64>) -> Result<Self> {
        Ok(Self {
            dir: dir.to_path_buf(),
            log: Csv::open(dir.join("scalars.csv"), LOG_HEADER, from)?,
            tags: Csv::open(dir.join("tags.csv"), TAGS_HEADER, from)?,
            events: EventWriter::create(dir)?,
            metric_tag: metric_tag.to_string(),
            count: from.unwrap_or(0),
        })
    }

    /// Writes one row of the training log (and its TensorBoard scalars).
    pub fn record(&mut self, row: ScalarRow) -> Result<()> {
        let metric = row.metric.map(|m| m.to_string()).unwrap_or_default();
        self.log.row(format_args!(
            "{},{},{},{metric}",
            row.step, row.loss, row.lr
        ))?;
        let mut s = vec![("train/loss", row.loss as f32), ("train/lr", row.lr as f32)];
        if let Some(m) = row.metric {
            s.push((self.metric_tag.as_str(), m as f32));
        }
        self.events.scalars(row.step, &s)
    }

    /// Moves the counter on by one (pystematic's `step()`).
    pub fn step(&mut self) {
        self.count += 1;
    }

    /// The counter: the step every record is filed under.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Sets the counter (a training loop's own step).
    pub fn set_count(&mut self, count: u64) {
        self.count = count;
    }

    /// A scalar under any tag at the current count.
    pub fn scalar(&mut self, tag: &str, value: f64) -> Result<()> {
        self.tags
            .row(format_args!("{},{tag},{value}", self.count))?;
        self.events.scalars(self.count, &[(tag, value as f32)])
    }

    /// The run's hyperparameters (TensorBoard's hparams dashboard, and `hparams.json`).
    pub fn params(&mut self, params: &Value) -> Result<()> {
        let map = params
            .as_object()
            .ok_or_else(|| invalid!("hyperparameters are an object of values, not {params}"))?;
        let hp: Vec<(String, HParam)> = map
            .iter()
            .filter_map(|(k, v)| {
                let h = match v {
                    Value::Number(n) => HParam::Number(n.as_f64()?),
                    Value::String(s) => HParam::Text(s.clone()),
                    Value::Bool(b) => HParam::Bool(*b),
                    _ => return None,
                };
                Some((k.clone(), h))
            })
            .collect();
        self.events.hparams(&hp)?;
        let path = self.dir.join("hparams.json");
        std::fs::write(&path, params.to_string()).map_err(|e| Error::io("cannot write", &path, e))
    }

    /// An image at the current count: `images/<tag>-<count>.png` and a TensorBoard image.
    /// Returns the file's path.
    pub fn image(&mut self, tag: &str, img: &RgbImage) -> Result<PathBuf> {
        let png = img.png()?;
        let dir = self.dir.join("images");
        std::fs::create_dir_all(&dir).map_err(|e| Error::io("cannot create", &dir, e))?;
        let file = format!("{}-{}.png", tag.replace(['/', '\\', ' '], "_"), self.count);
        let path = dir.join(file);
        std::fs::write(&path, &png).map_err(|e| Error::io("cannot write", &path, e))?;
        self.events
            .image(self.count, tag, (img.width, img.height), &png)?;
        Ok(path)
    }

    /// A line plot drawn as an image ([`FIGURE_SIZE`]) at the current count.
    pub fn figure(&mut self, tag: &str, plot: &LinePlot) -> Result<PathBuf> {
        self.image(tag, &plot.render(FIGURE_SIZE.0, FIGURE_SIZE.1))
    }

    /// Writes what is buffered (CSV rows, TensorBoard events) to the files.
    pub fn flush(&mut self) -> Result<()> {
        self.log.flush()?;
        self.tags.flush()?;
        self.events.flush()
    }
}

impl Stateful for Recorder {
    fn state_dict(&self) -> Result<Value> {
        Ok(json!({ "count": self.count }))
    }

    fn load_state_dict(&mut self, state: &Value) -> Result<()> {
        self.count = state["count"]
            .as_u64()
            .ok_or_else(|| invalid!("a recorder's state holds its count, not {state}"))?;
        Ok(())
    }
}
