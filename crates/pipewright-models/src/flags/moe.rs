//! The flags of a mixture of experts (`--n-experts --top-k --moe-every --shared-experts
//! --moe-hidden --aux-loss-coef`, and `--ep` that splits it): the [`MoeConfig`] they make and
//! the combinations refused before any rank starts.

use pipewright::{invalid, Result};

use super::args::TrainArgs;
use crate::moe::{MoeConfig, MoeNames};

/// The mixture the flags ask for (`None` without `--n-experts`), its experts `hidden` wide
/// unless `--moe-hidden` says otherwise (Mixtral's names, its renormalised top k).
pub(super) fn mixture(a: &TrainArgs, hidden: usize) -> Option<MoeConfig> {
    a.n_experts.map(|n_experts| MoeConfig {
        n_experts,
        top_k: a.top_k,
        hidden: a.moe_hidden.unwrap_or(hidden),
        shared: a.shared_experts,
        norm_topk: true,
        aux_coef: a.aux_loss_coef,
        names: MoeNames::Mixtral,
        every: a.moe_every,
    })
}

/// Fails on a mixture flag without `--n-experts`, or on a layout the mixture cannot take
/// (`d`: the flags' defaults).
pub(super) fn check(a: &TrainArgs, d: &TrainArgs) -> Result<()> {
    let needs: [(bool, &str); 4] = [
        (
            a.n_experts.is_none()
                && (a.top_k, a.moe_every, a.shared_experts, a.aux_loss_coef)
                    != (d.top_k, d.moe_every, d.shared_experts, d.aux_loss_coef)
                || a.n_experts.is_none() && a.moe_hidden.is_some(),
            "--top-k, --moe-every, --shared-experts, --moe-hidden and --aux-loss-coef shape a \
             mixture of experts: give --n-experts",
        ),
        (
            a.n_experts.is_none() && a.ep > 1,
            "--ep splits the experts of a mixture: give --n-experts (and --model llama)",
        ),
        (
            a.n_experts.is_some_and(|e| !e.is_multiple_of(a.ep)),
            "--ep must divide --n-experts: each expert-parallel rank holds as many experts",
        ),
        (
            a.n_experts.is_some() && (a.tp > 1 || a.cp > 1),
            "--n-experts runs at --tp 1 and --cp 1 for now (experts do not split over \
             tensor-parallel ranks yet): use --pp and --dp",
        ),
    ];
    if let Some((_, why)) = needs.iter().find(|(bad, _)| *bad) {
        return Err(invalid!("{why}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::args::{defaults, ModelKind, TrainArgs};
    use crate::ModelConfig;

    /// `--n-experts` makes the Llama's blocks mixtures (every `--moe-every`th), sized by the
    /// flags; the mixture's flags are refused without it, on another model, or split over tp,
    /// and `--ep` without experts or not dividing them.
    #[test]
    fn the_mixture_flags_make_a_mixture_of_experts_llama() {
        let mut a = defaults();
        a.model = ModelKind::Llama;
        (a.n_experts, a.top_k, a.moe_every, a.shared_experts) = (Some(4), 1, 2, 1);
        let (ModelConfig::Llama { llama, .. }, _, _) = a.model_and_task().unwrap() else {
            panic!("a Llama")
        };
        let m = llama.moe.unwrap();
        assert_eq!((m.n_experts, m.top_k, m.every, m.shared), (4, 1, 2, 1));
        assert_eq!((m.hidden, m.at(0), m.at(1)), (llama.hidden, false, true));
        let refused = |a: &TrainArgs, says: &str| {
            let e = a.model_and_task().err().unwrap().to_string();
            assert!(e.contains(says), "{e}");
        };
        a.tp = 2;
        refused(&a, "--n-experts runs at --tp 1");
        (a.tp, a.dp, a.ep) = (1, 3, 3);
        refused(&a, "--ep must divide --n-experts");
        (a.dp, a.ep) = (1, 1);
        a.model = ModelKind::Gpt;
        refused(&a, "does not use --n-experts");
        a.model = ModelKind::Llama;
        a.n_experts = None;
        refused(&a, "give --n-experts");
        (a.top_k, a.moe_every, a.shared_experts, a.dp, a.ep) = (2, 1, 0, 2, 2);
        refused(&a, "--ep splits the experts");
    }
}
