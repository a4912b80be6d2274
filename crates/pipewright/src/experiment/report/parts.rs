//! The report's section on a metric's parts: a blend's held-out perplexity of each dataset
//! beside the blended one, at every evaluation. Runs that record no parts have none of these
//! tags, and the page then has no such section.

use super::html::{escape, table};
use super::{chart, RunRecord, Series};

/// What starts the tag of one part of the metric: `metric/<name>`.
pub const METRIC_PART_PREFIX: &str = "metric/";

/// The section, or nothing when no run recorded parts of its metric.
pub fn section(runs: &[RunRecord]) -> String {
    let mut series = Vec::new();
    let mut rows = vec![vec![
        "run".to_string(),
        "part".into(),
        "at the last evaluation".into(),
    ]];
    for r in runs {
        for (tag, points) in &r.tags {
            let Some(part) = tag.strip_prefix(METRIC_PART_PREFIX) else {
                continue;
            };
            series.push(Series {
                name: format!("{} {part}", r.name),
                points: points.clone(),
            });
            let last = points
                .last()
                .map_or(String::new(), |p| format!("{:.4}", p.1));
            rows.push(vec![r.name.clone(), part.to_string(), last]);
        }
    }
    if series.is_empty() {
        return String::new();
    }
    format!(
        "<section id=\"metric-parts\"><h2>Metric by dataset</h2><div class=\"charts\">{}</div>\
         <p>{}</p>{}</section>",
        chart("held-out metric by dataset", "metric", true, series),
        escape("Each blended dataset's held-out metric (the run's metric blends them by weight):"),
        table("metric-parts", &rows)
    )
}
