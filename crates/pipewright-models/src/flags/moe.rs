//! The flags of a mixture of experts (`--n-experts --top-k --moe-every --shared-experts
//! --moe-hidden --aux-loss-coef`, and `--ep` that splits it): the [`MoeConfig`] they make and
//! the combinations refused before any rank starts.

use std::path::Path;

use pipewright::{invalid, Result};

use super::args::TrainArgs;
use crate::moe::{MoeConfig, MoeNames};
use crate::ModelConfig;

/// The mixture the flags ask for (`None` without `--n-experts`), its experts `hidden` wide
/// unless `--moe-hidden` says otherwise (Mixtral's names, its renormalised top k).
pub(super) fn mixture(a: &TrainArgs, hidden: usize) -> Option<MoeConfig> {
    a.sizes.n_experts.map(|n_experts| MoeConfig {
        n_experts,
        top_k: a.sizes.top_k,
        moe_hidden: a.sizes.moe_hidden.unwrap_or(hidden),
        shared_experts: a.sizes.shared_experts,
        norm_topk: true,
        aux_loss_coef: a.sizes.aux_loss_coef,
        names: MoeNames::Mixtral,
        moe_every: a.sizes.moe_every,
    })
}

/// Fails on a mixture flag without `--n-experts`, or on a layout the mixture cannot take
/// (`d`: the flags' defaults).
pub(super) fn check(a: &TrainArgs, d: &TrainArgs) -> Result<()> {
    if a.sizes.init_from.is_some() {
        // A pretrained model's mixture is the directory's, whatever the flags say.
        let shape = [
            ("--top-k", a.sizes.top_k != d.sizes.top_k),
            ("--moe-every", a.sizes.moe_every != d.sizes.moe_every),
            (
                "--shared-experts",
                a.sizes.shared_experts != d.sizes.shared_experts,
            ),
            ("--moe-hidden", a.sizes.moe_hidden.is_some()),
        ];
        let given: Vec<&str> = shape.iter().filter(|(_, g)| *g).map(|(f, _)| *f).collect();
        if !given.is_empty() {
            return Err(invalid!(
                "--init-from takes the mixture's shape (experts, top-k, which blocks, shared \
                 experts, widths) from the directory's config.json: drop {}",
                given.join(", ")
            ));
        }
    }
    let needs: [(bool, &str); 4] = [
        (
            a.sizes.n_experts.is_none()
                && (
                    a.sizes.top_k,
                    a.sizes.moe_every,
                    a.sizes.shared_experts,
                    a.sizes.aux_loss_coef,
                ) != (
                    d.sizes.top_k,
                    d.sizes.moe_every,
                    d.sizes.shared_experts,
                    d.sizes.aux_loss_coef,
                )
                || a.sizes.n_experts.is_none() && a.sizes.moe_hidden.is_some(),
            "--top-k, --moe-every, --shared-experts, --moe-hidden and --aux-loss-coef shape a \
             mixture of experts: give --n-experts",
        ),
        (
            a.sizes.n_experts.is_none() && a.sizes.init_from.is_none() && a.parallel.layout.ep > 1,
            "--ep splits the experts of a mixture: give --n-experts (and --model llama)",
        ),
        (
            a.sizes
                .n_experts
                .is_some_and(|e| !e.is_multiple_of(a.parallel.layout.ep)),
            "--ep must divide --n-experts: each expert-parallel rank holds as many experts",
        ),
        (
            a.sizes.n_experts.is_some() && a.parallel.sequence_parallel,
            "--n-experts does not run under --sequence-parallel yet: drop it (tensor, context \
             and expert parallelism all apply)",
        ),
    ];
    if let Some((_, why)) = needs.iter().find(|(bad, _)| *bad) {
        return Err(invalid!("{why}"));
    }
    Ok(())
}

/// Fails when the mixture flags disagree with the pretrained model `model` of `dir`
/// (`--init-from`): `--n-experts` given and not the directory's count, `--ep` that does not
/// divide its experts or with no mixture to split.
pub(super) fn check_pretrained(a: &TrainArgs, dir: &Path, model: &ModelConfig) -> Result<()> {
    let experts = match model {
        ModelConfig::Llama { llama, .. } => llama.moe.map(|m| m.n_experts),
        _ => None,
    };
    let file = dir.join("config.json");
    match (experts, a.sizes.n_experts) {
        (Some(e), Some(n)) if e != n => Err(invalid!(
            "`{}` has {e} experts per mixture but --n-experts says {n}: drop --n-experts (the \
             directory gives the sizes)",
            file.display()
        )),
        (None, Some(_)) => Err(invalid!(
            "`{}` holds a model without mixtures of experts: drop --n-experts",
            file.display()
        )),
        (None, None) if a.parallel.layout.ep > 1 => Err(invalid!(
            "--ep splits the experts of a mixture, and `{}` has none: drop --ep",
            file.display()
        )),
        (Some(e), _) if !e.is_multiple_of(a.parallel.layout.ep) => Err(invalid!(
            "--ep {} does not divide the {e} experts of `{}`: choose a divisor",
            a.parallel.layout.ep,
            file.display()
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::super::args::{defaults, ModelKind, TrainArgs};
    use crate::ModelConfig;

    /// `--n-experts` makes the Llama's blocks mixtures (every `--moe-every`th), sized by the
    /// flags; the mixture's flags are refused without it, on another model, or under sequence
    /// parallelism, and `--ep` without experts or not dividing them.
    #[test]
    fn the_mixture_flags_make_a_mixture_of_experts_llama() {
        let mut a = defaults();
        a.model = ModelKind::Llama;
        (
            a.sizes.n_experts,
            a.sizes.top_k,
            a.sizes.moe_every,
            a.sizes.shared_experts,
        ) = (Some(4), 1, 2, 1);
        let (ModelConfig::Llama { llama, .. }, _, _) = a.model_and_task().unwrap() else {
            panic!("a Llama")
        };
        let m = llama.moe.unwrap();
        assert_eq!(
            (m.n_experts, m.top_k, m.moe_every, m.shared_experts),
            (4, 1, 2, 1)
        );
        assert_eq!(
            (m.moe_hidden, m.at(0), m.at(1)),
            (llama.hidden, false, true)
        );
        let refused = |a: &TrainArgs, says: &str| {
            let e = a.model_and_task().err().unwrap().to_string();
            assert!(e.contains(says), "{e}");
        };
        (a.parallel.layout.tp, a.parallel.sequence_parallel) = (2, true);
        refused(&a, "--n-experts does not run under --sequence-parallel");
        (
            a.parallel.layout.tp,
            a.parallel.sequence_parallel,
            a.parallel.layout.dp,
            a.parallel.layout.ep,
        ) = (1, false, 3, 3);
        refused(&a, "--ep must divide --n-experts");
        (a.parallel.layout.dp, a.parallel.layout.ep) = (1, 1);
        a.model = ModelKind::Gpt;
        refused(&a, "does not use --n-experts");
        a.model = ModelKind::Llama;
        a.sizes.n_experts = None;
        refused(&a, "give --n-experts");
        (
            a.sizes.top_k,
            a.sizes.moe_every,
            a.sizes.shared_experts,
            a.parallel.layout.dp,
            a.parallel.layout.ep,
        ) = (2, 1, 0, 2, 2);
        refused(&a, "--ep splits the experts");
    }

    /// A Hugging Face directory whose experts disagree with the flags is refused, naming both.
    #[test]
    fn a_pretrained_mixture_must_agree_with_the_flags() {
        let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        let check = |name: &str, a: &TrainArgs| {
            let dir = fixtures.join(name);
            let model = crate::hf::config_from_dir(&dir).unwrap();
            super::check_pretrained(a, &dir, &model).map_err(|e| e.to_string())
        };
        let mut a = defaults();
        a.parallel.layout.ep = 2;
        assert!(check("hf-mixtral", &a).is_ok());
        // The mixture's shape flags are the directory's: refused with --init-from, by name
        // (they asked for --n-experts, which was then refused too).
        let mut b = defaults();
        (b.model, b.sizes.top_k) = (ModelKind::Llama, 1);
        b.sizes.init_from = Some(fixtures.join("hf-mixtral"));
        let e = super::check(&b, &defaults()).unwrap_err().to_string();
        assert!(
            e.contains("from the directory's config.json: drop --top-k"),
            "{e}"
        );
        a.sizes.n_experts = Some(8);
        let e = check("hf-mixtral", &a).unwrap_err();
        assert!(
            e.contains("has 4 experts per mixture but --n-experts says 8"),
            "{e}"
        );
        (a.sizes.n_experts, a.parallel.layout.ep) = (None, 3);
        let e = check("hf-mixtral", &a).unwrap_err();
        assert!(e.contains("--ep 3 does not divide the 4 experts"), "{e}");
        a.parallel.layout.ep = 2;
        let e = check("hf-llama", &a).unwrap_err();
        assert!(e.contains("has none: drop --ep"), "{e}");
    }
}
