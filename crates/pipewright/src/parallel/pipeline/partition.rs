//! Which layers each pipeline stage owns.
//!
//! Two ways to say it, as in the seeds: torchgpipe's `balance` counts layers per stage; Varuna
//! splits only at cut points, so with cut points a balance counts *segments* (the runs of layers
//! between consecutive cut points) and, of the n cut points, the P-1 that fall between stages
//! are activated and the others ignored. Without a balance, stages get as equal a share as the
//! units allow (earlier stages take the remainder).

use std::ops::Range;

use crate::model::Sequential;
use crate::{invalid, Result};

/// Splits `units` items into `stages` contiguous groups as evenly as possible.
pub fn uniform_balance(units: usize, stages: usize) -> Result<Vec<usize>> {
    if stages == 0 {
        return Err(invalid!("a pipeline needs at least one stage"));
    }
    if stages > units {
        return Err(invalid!(
            "{stages} stages cannot each get one of {units} units (the model's layers, or \
             its segments between cut points): a pipeline has pp x virtual stages (2 a rank \
             under zbv and dualpipev); use at most {units} stages: fewer pipeline ranks or \
             virtual stages, or a deeper model"
        ));
    }
    Ok((0..stages)
        .map(|s| units / stages + usize::from(s < units % stages))
        .collect())
}

/// `balance` (units per stage) as a run says it: layers per model stage (what a summary
/// records), with the segments between cut points beside where the model has them
/// (`2,3 layers per model stage (2,2 segments between cut points)`).
pub fn describe_balance(model: &Sequential, balance: &[usize]) -> Result<String> {
    let list =
        |v: &mut dyn Iterator<Item = usize>| v.map(|n| n.to_string()).collect::<Vec<_>>().join(",");
    let ranges = partition(model, balance.len(), Some(balance))?;
    let layers = list(&mut ranges.iter().map(|r| r.len()));
    Ok(match model.cut_points().is_empty() {
        true => format!("{layers} layers per model stage"),
        false => format!(
            "{layers} layers per model stage ({} segments between cut points)",
            list(&mut balance.iter().copied())
        ),
    })
}

/// The boundaries of the units a balance counts: every layer boundary, or only the cut points
/// (with 0 and the model's length at the ends).
pub fn unit_bounds(model: &Sequential) -> Vec<usize> {
    if model.cut_points().is_empty() {
        (0..=model.len()).collect()
    } else {
        std::iter::once(0)
            .chain(model.cut_points().iter().copied())
            .chain(std::iter::once(model.len()))
            .collect()
    }
}

/// Per-layer `costs` summed over the units a balance counts (see [`unit_bounds`]).
pub fn unit_costs(model: &Sequential, costs: &[f64]) -> Vec<f64> {
    unit_bounds(model)
        .windows(2)
        .map(|w| costs[w[0]..w[1]].iter().sum())
        .collect()
}

/// Layer ranges of `stages` stages of `model`: from `balance` if given, else uniform; over
/// segments between cut points if the model has any, else over layers.
pub fn partition(
    model: &Sequential,
    stages: usize,
    balance: Option<&[usize]>,
) -> Result<Vec<Range<usize>>> {
    let bounds = unit_bounds(model);
    let units = bounds.len() - 1;
    let what = if model.cut_points().is_empty() {
        "layers"
    } else {
        "segments between cut points"
    };
    let balance = match balance {
        Some(b) => {
            if b.len() != stages {
                return Err(invalid!(
                    "balance {b:?} has {} entries for {stages} stages",
                    b.len()
                ));
            }
            if let Some(s) = b.iter().position(|&n| n == 0) {
                return Err(invalid!("balance {b:?} leaves stage {s} empty: every stage needs at least one of the {what}"));
            }
            let total: usize = b.iter().sum();
            if total != units {
                return Err(invalid!(
                    "balance {b:?} sums to {total} but the model has {units} {what}: make it sum to {units}"
                ));
            }
            b.to_vec()
        }
        None => uniform_balance(units, stages).map_err(|e| invalid!("{e} ({what})"))?,
    };
    let mut start = 0;
    Ok(balance
        .iter()
        .map(|&n| {
            let r = bounds[start]..bounds[start + n];
            start += n;
            r
        })
        .collect())
}
