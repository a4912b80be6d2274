//! A run directory read for the report: whatever of its files exist (a run in progress has no
//! summary, a run without `--trace` no timeline), and a note for each one that does not.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::prediction::Prediction;
use crate::experiment::recorder::whole_rows;
use crate::parallel::pipeline::{read_chrome_trace, Simulation};
use crate::{Error, Result};

/// One logged step of `scalars.csv`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Logged {
    /// Steps done (the console's count).
    pub step: f64,
    /// The step's loss.
    pub loss: f64,
    /// Its learning rate.
    pub lr: f64,
    /// The task's metric, when evaluated at that step.
    pub metric: Option<f64>,
}

/// What the report knows of one run directory.
#[derive(Clone, Debug)]
pub struct RunRecord {
    /// The directory.
    pub dir: PathBuf,
    /// Its name on the page (the directory's last component).
    pub name: String,
    /// `parameters.json`: every parameter of the run.
    pub parameters: Option<Map<String, Value>>,
    /// `summary.json`: the finished run's results.
    pub summary: Option<Map<String, Value>>,
    /// `scalars.csv`: the training log.
    pub logged: Vec<Logged>,
    /// `tags.csv`: every other scalar, by tag, as `(step, value)`.
    pub tags: BTreeMap<String, Vec<(f64, f64)>>,
    /// The last step of the run's trace (`--trace`), measured.
    pub trace: Option<Simulation>,
    /// The planner's prediction for the run's layout (`prediction.json`).
    pub prediction: Option<Prediction>,
    /// `launch.json`'s attempts (a run under `pipewright launch`).
    pub attempts: Vec<Map<String, Value>>,
    /// What is missing, each as a sentence that says what to do.
    pub missing: Vec<String>,
}

fn object(path: &Path) -> std::result::Result<Option<Map<String, Value>>, String> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    match serde_json::from_str::<Value>(&text) {
        Ok(Value::Object(m)) => Ok(Some(m)),
        Ok(_) | Err(_) => Err(format!("{} is not a JSON object", path.display())),
    }
}

fn csv_rows(path: &Path) -> Option<Vec<Vec<String>>> {
    let text = std::fs::read_to_string(path).ok()?;
    let rows = whole_rows(&text)
        .map(|l| l.split(',').map(str::to_string).collect())
        .collect();
    Some(rows)
}

/// `scalars.csv`'s whole rows that parse (none when it is missing).
fn read_logged(dir: &Path) -> Vec<Logged> {
    csv_rows(&dir.join("scalars.csv"))
        .unwrap_or_default()
        .into_iter()
        .filter_map(|r| {
            let num = |i: usize| r.get(i).and_then(|v| v.parse::<f64>().ok());
            Some(Logged {
                step: num(0)?,
                loss: num(1)?,
                lr: num(2)?,
                metric: num(3),
            })
        })
        .collect()
}

/// `tags.csv` by tag, as `(step, value)`.
fn read_tags(dir: &Path) -> BTreeMap<String, Vec<(f64, f64)>> {
    let mut tags: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for r in csv_rows(&dir.join("tags.csv")).unwrap_or_default() {
        if let (Some(c), Some(t), Some(v)) = (r.first(), r.get(1), r.get(2)) {
            if let (Ok(c), Ok(v)) = (c.parse::<f64>(), v.parse::<f64>()) {
                tags.entry(t.clone()).or_default().push((c, v));
            }
        }
    }
    tags
}

/// The run's trace (where its parameters say, else `trace.json`), or a note in `missing`.
fn read_trace(
    dir: &Path,
    parameters: Option<&Map<String, Value>>,
    missing: &mut Vec<String>,
) -> Option<Simulation> {
    let trace_path = parameters
        .and_then(|p| p.get("trace"))
        .and_then(Value::as_str)
        .map(PathBuf::from)
        .unwrap_or_else(|| dir.join("trace.json"));
    match std::fs::read_to_string(&trace_path) {
        Ok(text) => match read_chrome_trace(&text, None) {
            Ok(sim) => Some(sim),
            Err(e) => {
                missing.push(format!(
                    "the trace {} cannot be drawn: {e}",
                    trace_path.display()
                ));
                None
            }
        },
        Err(_) => {
            missing.push(format!(
                "no trace ({}): train with --trace FILE (and --pp 2 or more) for the measured \
                 pipeline timeline",
                trace_path.display()
            ));
            None
        }
    }
}

impl RunRecord {
    /// Reads what `dir` holds. Only a path that cannot be read as a directory is an error;
    /// a directory that is not a run, or a run in progress, is a record that says what it
    /// lacks.
    pub fn read(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(Error::Invalid(format!(
                "{} is not a directory: give run directories (what `pipewright train --out` \
                 wrote)",
                dir.display()
            )));
        }
        let name = dir
            .canonicalize()
            .ok()
            .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| dir.display().to_string());
        let mut missing = Vec::new();
        let mut read = |file: &str, why: &str| match object(&dir.join(file)) {
            Ok(Some(m)) => Some(m),
            Ok(None) => {
                if !why.is_empty() {
                    missing.push(format!("no {file}: {why}"));
                }
                None
            }
            Err(e) => {
                missing.push(e);
                None
            }
        };
        let parameters = read("parameters.json", "");
        let summary = read(
            "summary.json",
            "the run is still in progress, or stopped before its end (its last logged step is drawn)",
        );
        let launch = read("launch.json", "");
        let logged = read_logged(dir);
        if parameters.is_none() && logged.is_empty() {
            let scalars = match dir.join("scalars.csv").exists() {
                true => "its scalars.csv holds no whole row of step,loss,lr,metric",
                false => "no scalars.csv",
            };
            return Err(crate::invalid!(
                "{} is not a run: it has no parameters.json and {scalars} (give a directory \
                 that `pipewright train --out` wrote)",
                dir.display()
            ));
        }
        let tags = read_tags(dir);
        let trace = read_trace(dir, parameters.as_ref(), &mut missing);
        let prediction = match Prediction::load(&dir.join(super::prediction::FILE)) {
            Ok(p) => p,
            Err(e) => {
                missing.push(e.to_string());
                None
            }
        };
        if prediction.is_none() && parameters.is_some() {
            missing.push(format!(
                "no {}: the planner made no prediction for this run (a model without shapes, or \
                 a layout the planner refuses)",
                super::prediction::FILE
            ));
        }
        let attempts = launch
            .and_then(|l| l.get("attempts").and_then(Value::as_array).cloned())
            .unwrap_or_default()
            .into_iter()
            .filter_map(|a| a.as_object().cloned())
            .collect();
        Ok(Self {
            dir: dir.to_path_buf(),
            name,
            parameters,
            summary,
            logged,
            tags,
            trace,
            prediction,
            attempts,
            missing,
        })
    }

    /// A number of the summary.
    pub fn summary_f64(&self, key: &str) -> Option<f64> {
        self.summary.as_ref()?.get(key)?.as_f64()
    }
}
