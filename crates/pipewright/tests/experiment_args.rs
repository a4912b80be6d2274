//! A program's own typed flags as an experiment's parameters (`Experiment::args`, as
//! `pipewright train` declares its flags): precedence with a parameters file through the
//! flags' own checks, aliases of standard parameters, an exact run directory that is reopened
//! only when the run goes on, and a rank count from the program's layout.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use clap::Args;
use pipewright::experiment::{Context, Experiment};
use pipewright::Result;
use serde::{Deserialize, Serialize};

/// The program's flags.
#[derive(Args, Clone, Debug, Serialize, Deserialize)]
struct Sizes {
    /// Layers of the model.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    layers: u32,
    /// Ranks of the layout.
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// A flag without a value.
    #[arg(long)]
    wide: bool,
    /// The run directory itself.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn program<F: Fn(&mut Context) -> Result<()> + Sync>(body: F) -> Experiment<F> {
    Experiment::new("sizes", body)
        .args::<Sizes>()
        .alias("random_seed", "seed")
        .run_dir("out")
        .world(|p| Ok(p.args::<Sizes>()?.ranks))
}

fn argv(extra: &[&str]) -> Vec<String> {
    std::iter::once("sizes")
        .chain(extra.iter().copied())
        .map(String::from)
        .collect()
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pw-exparg-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn typed_flags_take_defaults_then_the_file_then_the_command_line() {
    let e = program(|_| Ok(()));
    let p = e.parse(argv(&[])).unwrap();
    let s: Sizes = p.args().unwrap();
    assert_eq!((s.layers, s.ranks, s.wide, s.out), (2, 1, false, None));
    let p = e
        .parse(argv(&["--seed", "3", "--layers", "5", "--wide"]))
        .unwrap();
    assert_eq!(p.int("random_seed").unwrap(), 3, "--seed is --random-seed");
    let s: Sizes = p.args().unwrap();
    assert_eq!((s.layers, s.wide), (5, true));

    let dir = tmp("file");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("p.json");
    std::fs::write(
        &file,
        r#"{"layers": 7, "ranks": 2, "wide": true, "random_seed": 9}"#,
    )
    .unwrap();
    let f = file.to_str().unwrap();
    let s: Sizes = e
        .parse(argv(&["--params-file", f]))
        .unwrap()
        .args()
        .unwrap();
    assert_eq!((s.layers, s.ranks, s.wide), (7, 2, true));
    let p = e
        .parse(argv(&["--params-file", f, "--layers", "9"]))
        .unwrap();
    let s: Sizes = p.args().unwrap();
    assert_eq!((s.layers, s.ranks), (9, 2), "the command line wins");
    assert_eq!(p.int("random_seed").unwrap(), 9);

    // A file's value meets the flag's own check, and names the file.
    std::fs::write(&file, r#"{"layers": 0}"#).unwrap();
    let err = e
        .parse(argv(&["--params-file", f]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("p.json") && err.contains("--layers"), "{err}");
    std::fs::write(&file, r#"{"depth": 3}"#).unwrap();
    let err = e
        .parse(argv(&["--params-file", f]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("no parameter `depth`"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();

    // A field named like a parameter is refused.
    let clash = Experiment::new("clash", |_: &mut Context| Ok(()))
        .param(pipewright::experiment::Param::int("layers", 1, "again"))
        .args::<Sizes>();
    let err = clash.parse(argv(&[])).unwrap_err().to_string();
    assert!(err.contains("`layers`"), "{err}");
}

#[test]
fn the_layout_sets_the_ranks_and_out_the_exact_directory() {
    let seen = AtomicUsize::new(0);
    let e = program(|cx| {
        seen.fetch_add(cx.get_num_processes(), Ordering::SeqCst);
        Ok(())
    });
    let out = tmp("out");
    let o = out.to_str().unwrap();
    let dir = e
        .run(&e.parse(argv(&["--ranks", "3", "--out", o])).unwrap())
        .unwrap();
    assert_eq!(dir, out);
    assert_eq!(seen.load(Ordering::SeqCst), 9, "3 ranks, each seeing 3");
    assert!(Path::new(&out).join("parameters.json").exists());
    // A second run into it is refused; one that goes on from a checkpoint reopens it.
    let err = e
        .run(&e.parse(argv(&["--out", o])).unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("already holds a run"), "{err}");
    let again = e
        .parse(argv(&["--out", o, "--checkpoint", "latest"]))
        .unwrap();
    assert_eq!(e.run(&again).unwrap(), out);
    std::fs::remove_dir_all(out).unwrap();
}
