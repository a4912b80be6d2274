//! Balancing stages by cost (torchgpipe's `balance_by_time` / `balance_by_size`, over costs
//! measured or estimated elsewhere): the contiguous split of `costs` into `partitions`
//! non-empty stages whose most expensive stage is as cheap as possible. Exact, by dynamic
//! programming over prefix sums (O(n^2 p)), where torchgpipe's block partition is a heuristic
//! with the same aim.
//!
//! A balance counts items per stage, as [`crate::parallel::pipeline::partition`] takes it: layers, or
//! segments between cut points when the model has them.

use crate::{invalid, Result};

/// The most (stage, end, start) visits [`balance_cost`]'s search makes: a few seconds.
const MAX_WORK: f64 = 2e9;

/// Items per stage of the best split of `costs` over `partitions` stages. Among splits with the
/// same most expensive stage, the most even one (least sum of squared stage costs) is taken,
/// and among those the one whose earlier stages take more items (as a uniform balance gives
/// earlier stages the remainder).
pub fn balance_cost(costs: &[f64], partitions: usize) -> Result<Vec<usize>> {
    if partitions == 0 {
        return Err(invalid!("balancing needs at least one partition"));
    }
    if costs.len() < partitions {
        return Err(invalid!(
            "{} costs cannot fill {partitions} partitions: every partition needs at least one item",
            costs.len()
        ));
    }
    if let Some((i, c)) = costs
        .iter()
        .enumerate()
        .find(|(_, c)| !c.is_finite() || **c < 0.0)
    {
        return Err(invalid!(
            "cost {i} is {c}: costs must be finite and non-negative"
        ));
    }
    let n = costs.len();
    // Both passes visit every (stage, end, start): 30,000 costs over 1,000 stages ran past five
    // minutes, so a search that large is refused with what to do.
    let work = n as f64 * n as f64 * partitions as f64 / 2.0;
    if work > MAX_WORK {
        return Err(invalid!(
            "balancing {n} costs over {partitions} partitions takes about {work:.1e} steps of \
             the exact search, more than the {MAX_WORK:.0e} it is given: balance fewer items \
             (segments between cut points rather than layers) or fewer partitions"
        ));
    }
    let mut prefix = vec![0.0; n + 1];
    for (i, c) in costs.iter().enumerate() {
        prefix[i + 1] = prefix[i] + c;
    }
    // Sums of squares are compared too: costs whose square overflows would compare as inf.
    if !prefix[n].is_finite() || !(prefix[n] * prefix[n]).is_finite() {
        return Err(invalid!(
            "the costs add up to {:e}, more than a balance can compare: give them in a larger \
             unit (milliseconds rather than nanoseconds, MiB rather than bytes)",
            prefix[n]
        ));
    }
    let sum = |a: usize, b: usize| prefix[b] - prefix[a];
    // best[k][i]: the cheapest most-expensive stage splitting the first i items into k stages.
    let inf = f64::INFINITY;
    let mut best = vec![vec![inf; n + 1]; partitions + 1];
    best[0][0] = 0.0;
    for k in 1..=partitions {
        for i in k..=n - (partitions - k) {
            for j in (k - 1)..i {
                best[k][i] = best[k][i].min(best[k - 1][j].max(sum(j, i)));
            }
        }
    }
    // Then, with every stage at most that, the least sum of squares; cut[k][i] is where the
    // last stage of the first i items in k stages starts (`<=`: the latest start among ties,
    // so earlier stages take more).
    let cap = best[partitions][n] * (1.0 + 1e-12) + 1e-12;
    let mut even = vec![vec![inf; n + 1]; partitions + 1];
    let mut cut = vec![vec![0usize; n + 1]; partitions + 1];
    even[0][0] = 0.0;
    for k in 1..=partitions {
        for i in k..=n - (partitions - k) {
            for j in (k - 1)..i {
                let s = sum(j, i);
                if s > cap || even[k - 1][j] == inf {
                    continue;
                }
                let v = even[k - 1][j] + s * s;
                if v <= even[k][i] {
                    even[k][i] = v;
                    cut[k][i] = j;
                }
            }
        }
    }
    let mut out = vec![0; partitions];
    let mut i = n;
    for k in (1..=partitions).rev() {
        let j = cut[k][i];
        out[k - 1] = i - j;
        i = j;
    }
    Ok(out)
}

/// Each stage's total cost under `balance`.
pub fn stage_costs(costs: &[f64], balance: &[usize]) -> Vec<f64> {
    let mut at = 0;
    balance
        .iter()
        .map(|&n| {
            let s = costs[at..at + n].iter().sum();
            at += n;
            s
        })
        .collect()
}

/// Megatron-LM's partition of `units` (an embedding, the blocks, a head) over `stages`: the
/// blocks split evenly (the first stages take one more when they do not divide), the
/// embedding on the first stage and the head on the last, whatever each costs.
pub fn even_blocks(units: usize, stages: usize) -> Result<Vec<usize>> {
    if stages == 0 || units == 0 || (stages > 1 && units < stages + 2) {
        return Err(invalid!(
            "cannot split {units} units (an embedding, blocks and a head) evenly over {stages} \
             stages: give each stage a block at least"
        ));
    }
    if stages == 1 {
        return Ok(vec![units]);
    }
    let blocks = units - 2;
    let mut out: Vec<usize> = (0..stages)
        .map(|i| blocks / stages + usize::from(i < blocks % stages))
        .collect();
    out[0] += 1;
    out[stages - 1] += 1;
    Ok(out)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn max_stage(costs: &[f64], b: &[usize]) -> f64 {
        stage_costs(costs, b).into_iter().fold(0.0, f64::max)
    }

    /// Every split of `n` items into `p` non-empty stages.
    pub(in crate::plan) fn all_splits(n: usize, p: usize) -> Vec<Vec<usize>> {
        if p == 1 {
            return vec![vec![n]];
        }
        (1..=n - (p - 1))
            .flat_map(|first| {
                all_splits(n - first, p - 1)
                    .into_iter()
                    .map(move |mut rest| {
                        rest.insert(0, first);
                        rest
                    })
            })
            .collect()
    }

    #[test]
    fn torchgpipes_block_partition_cases() {
        assert_eq!(
            balance_cost(&[1., 2., 3., 4., 5., 6.], 2).unwrap(),
            vec![4, 2]
        );
        assert_eq!(balance_cost(&[0., 0.], 2).unwrap(), vec![1, 1]);
        assert_eq!(balance_cost(&[42.], 1).unwrap(), vec![1]);
        assert!(balance_cost(&[42.], 0).is_err());
        assert!(balance_cost(&[], 1).is_err());
        assert!(balance_cost(&[42.], 2).is_err());
        assert!(balance_cost(&[1., f64::NAN], 1).is_err());
        // Equal costs split as evenly as a uniform balance, earlier stages taking more.
        assert_eq!(balance_cost(&[1.; 7], 3).unwrap(), vec![3, 2, 2]);
        // One huge layer is isolated.
        assert_eq!(
            balance_cost(&[1., 1., 50., 1., 1.], 3).unwrap(),
            vec![2, 1, 2]
        );
    }

    #[test]
    fn the_slowest_stage_is_minimal_against_brute_force() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        for _ in 0..300 {
            let n = rng.random_range(1..=9);
            let p = rng.random_range(1..=n.min(4));
            let costs: Vec<f64> = (0..n).map(|_| rng.random_range(0..20) as f64).collect();
            let got = balance_cost(&costs, p).unwrap();
            assert_eq!(got.len(), p);
            assert_eq!(got.iter().sum::<usize>(), n);
            assert!(got.iter().all(|&k| k > 0), "{got:?}");
            let best = all_splits(n, p)
                .iter()
                .map(|b| max_stage(&costs, b))
                .fold(f64::INFINITY, f64::min);
            assert_eq!(max_stage(&costs, &got), best, "{costs:?} over {p}: {got:?}");
        }
    }

    #[test]
    fn even_blocks_put_the_embedding_first_and_the_head_last() {
        // 7 blocks over 3 stages: 3, 2, 2, with the embedding and the head around them.
        assert_eq!(even_blocks(9, 3).unwrap(), vec![4, 2, 3]);
        assert_eq!(even_blocks(9, 1).unwrap(), vec![9]);
        assert!(even_blocks(4, 3).is_err());
    }
}
