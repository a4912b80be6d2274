//! `pipewright generate`: greedy decoding of the fixture GPT-2, Llama, Mixtral and Qwen3-MoE gives the tokens
//! transformers' `generate` gave (`tools/make_fixtures.py generate`) on every layout; sampling
//! with a seed gives the same tokens on every layout; a checkpoint of a corpus run generates
//! text through its tokenizer.

mod common;

use std::path::{Path, PathBuf};

use common::{corpus, run, text, tmp, train};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../pipewright-models/tests/fixtures")
}

fn ids(args: &[&str]) -> String {
    let o = run(&[&["generate"][..], args].concat());
    assert!(o.status.success(), "{args:?}: {}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    out.lines()
        .find_map(|l| l.strip_prefix("ids "))
        .unwrap_or_else(|| panic!("{out}"))
        .to_string()
}

#[test]
fn greedy_decoding_matches_transformers_on_every_layout() {
    let want: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("generate.json")).unwrap())
            .unwrap();
    for name in ["hf-gpt2", "hf-llama", "hf-mixtral", "hf-qwen3moe"] {
        let dir = fixtures().join(name);
        let prompt: Vec<String> = want[name]["prompt"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.to_string())
            .collect();
        let greedy: Vec<String> = want[name]["greedy"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.to_string())
            .collect();
        let (d, p) = (dir.to_str().unwrap(), prompt.join(","));
        let base = [
            "--init-from",
            d,
            "--prompt-ids",
            &p,
            "--max-new-tokens",
            "8",
        ];
        // A mixture of experts splits its experts, not its matrices.
        let split: &[&str] = if name.starts_with("hf-mixtral") {
            &["--ep", "2"]
        } else if name == "hf-qwen3moe" {
            &["--tp", "2", "--ep", "2"]
        } else {
            &["--tp", "2"]
        };
        let layouts = [
            &[][..],
            split,
            &[&["--pp", "2"], split].concat(),
            &[split, &["--no-kv-cache"]].concat(),
        ];
        for layout in layouts {
            let greedy_args = [&base[..], &["--temperature", "0"], layout].concat();
            assert_eq!(ids(&greedy_args), greedy.join(","), "{name} {layout:?}");
        }
        // Sampling: the seed decides, not the layout.
        let sampled = [
            &base[..],
            &["--temperature", "1.0", "--top-k", "5", "--seed", "7"],
        ]
        .concat();
        let one = ids(&sampled);
        assert_eq!(ids(&[&sampled[..], split].concat()), one, "{name}");
        assert_ne!(
            one,
            greedy.join(","),
            "{name}: sampling at temperature 1 differs from greedy"
        );
    }
}

#[test]
fn a_corpus_checkpoint_generates_text() {
    let dir = tmp("gen");
    let (tok, shards) = corpus(&dir, 400);
    let out = dir.join("run");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let o = train(&[
        "--task",
        "tokens",
        "--data",
        &s(&shards),
        "--block-size",
        "32",
        "--n-layer",
        "1",
        "--n-embd",
        "32",
        "--batch-size",
        "8",
        "--steps",
        "20",
        "--checkpoint-every",
        "20",
        "--out",
        &s(&out),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let o = run(&[
        "generate",
        "--checkpoint",
        &s(&out.join("checkpoints")),
        "--tokenizer",
        &s(&tok),
        "--prompt",
        "pub fn ",
        "--max-new-tokens",
        "12",
        "--tp",
        "2",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    let text_line = stdout.lines().nth(1).unwrap_or_default();
    assert!(
        text_line.starts_with("pub fn ") && text_line.len() > 7,
        "{stdout}"
    );
    let o = run(&[
        "generate",
        "--checkpoint",
        &s(&out.join("checkpoints")),
        "--prompt",
        "x",
    ]);
    assert!(!o.status.success() && text(&o).contains("--prompt needs --tokenizer"));
}

#[test]
fn weights_that_are_not_numbers_are_refused_not_decoded_as_zeros() {
    let dir = tmp("nan-weights");
    std::fs::create_dir_all(&dir).unwrap();
    let from = fixtures().join("hf-gpt2");
    for f in ["config.json", "generation_config.json"] {
        std::fs::copy(from.join(f), dir.join(f)).unwrap();
    }
    let cpu = candle_core::Device::Cpu;
    let mut w = candle_core::safetensors::load(from.join("model.safetensors"), &cpu).unwrap();
    let bias = &w["transformer.ln_f.bias"];
    let nan = candle_core::Tensor::full(f32::NAN, bias.dims(), &cpu).unwrap();
    w.insert("transformer.ln_f.bias".into(), nan);
    candle_core::safetensors::save(&w, dir.join("model.safetensors")).unwrap();
    let d = dir.to_str().unwrap();
    let o = run(&[
        "generate",
        "--init-from",
        d,
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "4",
    ]);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("not finite"), "{}", text(&o));
    assert!(!text(&o).contains("ids 0,0"), "{}", text(&o));
}
