//! One page per run (or per sweep): `pipewright report RUN... --out report.html` and
//! `train --report`. A self-contained HTML file that opens offline in any browser: the loss,
//! learning-rate and metric curves of every run overlaid (log scale for the loss), the
//! throughput and MFU per logged step, a mixture of experts' balance (its load-balancing loss
//! and tokens per expert), the measured pipeline timeline beside the planner's
//! prediction, memory per rank predicted beside measured, the launch history, and the
//! parameters and summaries as tables. What a run lacks (a trace, a summary while it runs) the
//! page says, with what to do.

pub mod chart;
pub mod experts;
pub mod html;
pub mod parts;
pub mod prediction;
pub mod run;

use std::fmt::Write;
use std::path::Path;

pub use chart::{LineChart, Series};
pub use prediction::Prediction;
pub use run::{Logged, RunRecord};

use crate::parallel::pipeline::timeline::svg_panels_wide;
use crate::parallel::pipeline::Simulation;
use crate::Result;
use html::{escape, key_table, table, value_text};

/// The tags `train` logs per logged step beside the training log.
pub const STEP_SECONDS_TAG: &str = "perf/step_seconds";
/// Items (tokens, or images) per second of the logged step.
pub const THROUGHPUT_TAG: &str = "perf/items_per_second";

fn chart(title: &str, y: &str, log_y: bool, series: Vec<Series>) -> String {
    LineChart {
        title: title.into(),
        x_label: "step".into(),
        y_label: y.into(),
        log_y,
        series,
    }
    .svg()
}

fn series_of(runs: &[RunRecord], f: impl Fn(&RunRecord) -> Vec<(f64, f64)>) -> Vec<Series> {
    runs.iter()
        .map(|r| Series {
            name: r.name.clone(),
            points: f(r),
        })
        .filter(|s| !s.points.is_empty())
        .collect()
}

fn mib(b: f64) -> String {
    format!("{:.1} MiB", b / 1048576.0)
}

/// The training curves: loss (log scale), learning rate, metric.
fn curves(runs: &[RunRecord]) -> String {
    let loss = series_of(runs, |r| {
        r.logged.iter().map(|l| (l.step, l.loss)).collect()
    });
    let lr = series_of(runs, |r| r.logged.iter().map(|l| (l.step, l.lr)).collect());
    let metric = series_of(runs, |r| {
        r.logged
            .iter()
            .filter_map(|l| Some((l.step, l.metric?)))
            .collect()
    });
    format!(
        "<section id=\"curves\"><h2>Training curves</h2><div class=\"charts\">{}{}{}</div></section>",
        chart("loss", "loss", true, loss),
        chart("learning rate", "learning rate", false, lr),
        chart("metric", "metric", false, metric)
    )
}

/// Throughput and MFU per logged step. The MFU of a step is the prediction's MFU scaled by
/// predicted over measured step time (the model's FLOPs are the prediction's).
fn throughput(runs: &[RunRecord]) -> String {
    let rate = series_of(runs, |r| {
        r.tags.get(THROUGHPUT_TAG).cloned().unwrap_or_default()
    });
    let mfu = series_of(runs, |r| {
        let (Some(p), Some(secs)) = (&r.prediction, r.tags.get(STEP_SECONDS_TAG)) else {
            return Vec::new();
        };
        let Some(m) = p.mfu else { return Vec::new() };
        secs.iter()
            .filter(|(_, s)| *s > 0.0)
            .map(|&(x, s)| (x, 100.0 * m * p.step_s / s))
            .collect()
    });
    let peaks: Vec<String> = runs
        .iter()
        .filter_map(|r| {
            let p = r.prediction.as_ref()?;
            Some(format!(
                "{}: MFU over {:.3e} FLOP/s per device ({})",
                r.name, p.peak_flops, p.hardware
            ))
        })
        .collect();
    let note = if peaks.is_empty() {
        "<p class=\"missing\">MFU needs the planner's prediction (prediction.json, written by \
         `train` for a GPT)</p>"
            .to_string()
    } else {
        format!("<p>{}</p>", escape(&peaks.join("; ")))
    };
    format!(
        "<section id=\"throughput\"><h2>Throughput</h2><div class=\"charts\">{}{}</div>{note}</section>",
        chart("throughput", "items per second", false, rate),
        chart("MFU", "MFU %", false, mfu)
    )
}

/// Measured and predicted pipeline timelines, with each stage's idle share.
fn timelines(runs: &[RunRecord]) -> String {
    let mut s = String::from("<section id=\"timeline\"><h2>Pipeline timeline</h2>");
    for r in runs {
        let mut panels: Vec<(String, Simulation)> = Vec::new();
        if let Some(t) = &r.trace {
            panels.push((
                format!("{}: measured (last traced step)", r.name),
                t.clone(),
            ));
        }
        match r.prediction.as_ref().map(Prediction::simulation) {
            Some(Ok(p)) => panels.push((format!("{}: predicted", r.name), p)),
            Some(Err(e)) => {
                let _ = write!(s, "<p class=\"missing\">{}</p>", escape(&e.to_string()));
            }
            None => {}
        }
        if panels.is_empty() {
            let _ = write!(
                s,
                "<p class=\"missing\">{}: no timeline (neither a trace nor a prediction)</p>",
                escape(&r.name)
            );
            continue;
        }
        let refs: Vec<(&str, &Simulation)> = panels.iter().map(|(t, p)| (t.as_str(), p)).collect();
        let _ = write!(
            s,
            "<div class=\"timeline\">{}</div>",
            svg_panels_wide(&refs, 1000.0)
        );
        let mut rows = vec![vec!["timeline".to_string(), "stage".into(), "idle".into()]];
        for (title, p) in &panels {
            for (k, idle) in p.idle_per_stage().iter().enumerate() {
                rows.push(vec![
                    title.clone(),
                    k.to_string(),
                    format!("{:.1} %", idle * 100.0),
                ]);
            }
        }
        s.push_str(&table("bubble", &rows));
        s.push_str(
            "<p>idle: the share of this one step's time (the last traced step, or the \
             prediction's); the summary's bubble_per_stage is the share of all steps' time.</p>",
        );
    }
    s.push_str("</section>");
    s
}

/// Memory per rank: the measured allocated peaks beside the prediction's.
fn memory(runs: &[RunRecord]) -> String {
    let mut rows = vec![vec![
        "run".to_string(),
        "rank".into(),
        "allocated peak (measured)".into(),
        "predicted".into(),
    ]];
    for r in runs {
        let measured: Vec<f64> = r
            .summary
            .as_ref()
            .and_then(|s| s.get("rank_training_peak_allocated_bytes"))
            .and_then(|v| v.as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter_map(|v| v.as_f64())
            .collect();
        let predicted = r
            .prediction
            .as_ref()
            .map(|p| p.peak_bytes.clone())
            .unwrap_or_default();
        for k in 0..measured.len().max(predicted.len()) {
            rows.push(vec![
                r.name.clone(),
                k.to_string(),
                measured.get(k).map_or("–".into(), |b| mib(*b)),
                // The prediction is per pipeline rank: ranks pp..world repeat them.
                predicted
                    .get(k % predicted.len().max(1))
                    .map_or("–".into(), |b| mib(*b)),
            ]);
        }
        if let Some(b) = r.summary_f64("training_peak_memory_bytes") {
            rows.push(vec![
                r.name.clone(),
                "process (resident)".into(),
                mib(b),
                "–".into(),
            ]);
        }
    }
    format!(
        "<section id=\"memory\"><h2>Memory</h2>{}</section>",
        table("memory", &rows)
    )
}

/// The launch history: attempts, their worlds and what they resumed from, how they ended.
fn launches(runs: &[RunRecord]) -> String {
    let mut rows = vec![vec![
        "run".to_string(),
        "attempt".into(),
        "world".into(),
        "resumed from".into(),
        "seconds".into(),
        "ended because".into(),
    ]];
    for r in runs {
        let mut world = None;
        for a in &r.attempts {
            let get = |k: &str| a.get(k).map(value_text).unwrap_or_default();
            let w = get("world");
            let morph = match &world {
                Some(old) if *old != w => format!("{w} (morphed from {old})"),
                _ => w.clone(),
            };
            world = Some(w);
            let secs = match (a.get("started"), a.get("ended")) {
                (Some(s), Some(e)) => format!(
                    "{:.1}",
                    e.as_f64().unwrap_or(0.0) - s.as_f64().unwrap_or(0.0)
                ),
                _ => String::new(),
            };
            // Newer checkpoints the attempt passed over as damaged, each with why.
            let skipped: Vec<String> = a
                .get("skipped")
                .and_then(|s| s.as_array())
                .map(|s| s.iter().map(value_text).collect())
                .unwrap_or_default();
            let from = match skipped.is_empty() {
                true => get("resumed_from"),
                false => format!("{} ({})", get("resumed_from"), skipped.join("; ")),
            };
            rows.push(vec![
                r.name.clone(),
                get("attempt"),
                morph,
                from,
                secs,
                get("ended_because"),
            ]);
        }
    }
    let body = if rows.len() == 1 {
        "<p>No launch history (launch.json): these runs were not started by `pipewright launch`.</p>"
            .to_string()
    } else {
        table("launch", &rows)
    };
    format!("<section id=\"launch\"><h2>Launch history</h2>{body}</section>")
}

/// The names of the runs that have `file`, and what it holds: one column each of a table.
fn having<'a>(
    runs: &'a [RunRecord],
    file: impl Fn(&'a RunRecord) -> Option<&'a serde_json::Map<String, serde_json::Value>>,
) -> (
    Vec<String>,
    Vec<&'a serde_json::Map<String, serde_json::Value>>,
) {
    runs.iter()
        .filter_map(|r| Some((r.name.clone(), file(r)?)))
        .unzip()
}

/// The page for `runs`.
pub fn render(runs: &[RunRecord]) -> String {
    let names: Vec<String> = runs.iter().map(|r| r.name.clone()).collect();
    let mut body = String::new();
    let missing: Vec<String> = runs
        .iter()
        .flat_map(|r| r.missing.iter().map(move |m| format!("{}: {m}", r.name)))
        .collect();
    if !missing.is_empty() {
        let items: String = missing
            .iter()
            .map(|m| format!("<li>{}</li>", escape(m)))
            .collect();
        let _ = write!(
            body,
            "<section id=\"missing\"><h2>Missing</h2><ul class=\"missing\">{items}</ul></section>"
        );
    }
    let (with_summary, summaries) = having(runs, |r| r.summary.as_ref());
    let _ = write!(
        body,
        "<section id=\"summary\"><h2>Summary</h2>{}</section>",
        if summaries.is_empty() {
            "<p class=\"missing\">No run has finished (no summary.json).</p>".to_string()
        } else {
            key_table("summary", &with_summary, &summaries)
        }
    );
    body.push_str(&curves(runs));
    body.push_str(&throughput(runs));
    body.push_str(&experts::section(runs));
    body.push_str(&parts::section(runs));
    body.push_str(&timelines(runs));
    body.push_str(&memory(runs));
    body.push_str(&launches(runs));
    let (with_params, params) = having(runs, |r| r.parameters.as_ref());
    let _ = write!(
        body,
        "<section id=\"parameters\"><h2>Parameters</h2>{}</section>",
        key_table("parameters", &with_params, &params)
    );
    html::page(&format!("pipewright report: {}", names.join(", ")), &body)
}

/// Reads every run directory of `dirs` and writes their page to `out` (atomically), which must
/// be new or a page written before ([`crate::runtime::files::ensure_replaceable`]).
pub fn write_report(dirs: &[&Path], out: &Path) -> Result<Vec<RunRecord>> {
    crate::runtime::files::ensure_replaceable(
        out,
        "--out",
        "a pipewright report page",
        html::is_page,
    )?;
    let runs = dirs
        .iter()
        .map(|d| RunRecord::read(d))
        .collect::<Result<Vec<_>>>()?;
    crate::runtime::files::write_atomic(out, render(&runs).as_bytes())?;
    Ok(runs)
}
