//! The report's section on a mixture of experts' balance: the load-balancing loss beside the
//! loss, each mixture's most loaded expert over the mean (1 is even) per logged step, and the
//! last logged step's tokens per expert, layer by layer. Runs without mixtures have none of
//! these tags, and the page then has no such section.

use super::html::{escape, table};
use super::{chart, RunRecord, Series};

/// The model's load-balancing loss (before its coefficient).
pub const AUX_LOSS_TAG: &str = "moe/aux_loss";
/// What starts the tags of one mixture: `moe/<layer>/<what>`.
pub const EXPERT_LOAD_PREFIX: &str = "moe/";
/// A mixture's most loaded expert's tokens over the mean.
pub const MAX_OVER_MEAN: &str = "max_over_mean";
/// What starts one expert's tokens tag after the layer: `expert_<e>`.
const EXPERT: &str = "expert_";

/// The mixtures' layers a run logged, in the order of their tags.
fn layers(r: &RunRecord) -> Vec<String> {
    let end = format!("/{MAX_OVER_MEAN}");
    r.tags
        .keys()
        .filter_map(|t| t.strip_prefix(EXPERT_LOAD_PREFIX)?.strip_suffix(&end))
        .map(String::from)
        .collect()
}

/// The section, or nothing when no run has a mixture of experts.
pub fn section(runs: &[RunRecord]) -> String {
    if runs.iter().all(|r| !r.tags.contains_key(AUX_LOSS_TAG)) {
        return String::new();
    }
    let aux: Vec<Series> = runs
        .iter()
        .filter_map(|r| {
            Some(Series {
                name: r.name.clone(),
                points: r.tags.get(AUX_LOSS_TAG)?.clone(),
            })
        })
        .collect();
    let mut balance = Vec::new();
    let mut rows = vec![vec![
        "run".to_string(),
        "layer".into(),
        "tokens per expert".into(),
    ]];
    for r in runs {
        for layer in layers(r) {
            let tag = format!("{EXPERT_LOAD_PREFIX}{layer}/{MAX_OVER_MEAN}");
            balance.push(Series {
                name: format!("{} {layer}", r.name),
                points: r.tags[&tag].clone(),
            });
            rows.push(vec![r.name.clone(), layer.clone(), last_tokens(r, &layer)]);
        }
    }
    format!(
        "<section id=\"experts\"><h2>Experts</h2><div class=\"charts\">{}{}</div>\
         <p>{}</p>{}</section>",
        chart("load-balancing loss", "auxiliary loss", false, aux),
        chart("expert load", "max over mean", false, balance),
        escape("Tokens per expert at the last logged step (a token counts once for each of its top-k experts):"),
        table("experts", &rows)
    )
}

/// A mixture's tokens per expert at the run's last logged step, expert by expert.
fn last_tokens(r: &RunRecord, layer: &str) -> String {
    let start = format!("{EXPERT_LOAD_PREFIX}{layer}/{EXPERT}");
    let mut tokens: Vec<(usize, f64)> = r
        .tags
        .iter()
        .filter_map(|(t, v)| {
            let e = t.strip_prefix(&start)?.parse().ok()?;
            Some((e, v.last()?.1))
        })
        .collect();
    tokens.sort_by_key(|(e, _)| *e);
    let list: Vec<String> = tokens.iter().map(|(_, t)| format!("{t:.0}")).collect();
    list.join(" ")
}
