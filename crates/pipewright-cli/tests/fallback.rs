//! A damaged newest checkpoint is not the end of a run: `--resume latest` passes over it (a
//! flipped byte, a missing part, a truncated file, an empty `latest`), names it, and goes on from
//! the newest intact one, ending bit for bit where a run resumed from that one by name ends. A
//! checkpoint named explicitly stays strict.

mod common;

use std::path::{Path, PathBuf};

use common::{text, tmp, train, TINY};

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let dst = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), dst).unwrap();
        }
    }
}

/// `train TINY --steps STEPS --checkpoint-every 2 --out OUT [extra]`, which must succeed; its
/// output as text.
fn run(out: &Path, steps: &str, extra: &[&str]) -> String {
    let mut a: Vec<&str> = TINY.to_vec();
    a.extend_from_slice(&["--steps", steps, "--checkpoint-every", "2", "--out"]);
    a.push(out.to_str().unwrap());
    a.extend_from_slice(extra);
    let o = train(&a);
    assert!(o.status.success(), "{a:?}:\n{}", text(&o));
    text(&o)
}

/// The largest safetensors file of a checkpoint (a rank's tensors).
fn part(step: &Path) -> PathBuf {
    std::fs::read_dir(step)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .max_by_key(|p| p.metadata().unwrap().len())
        .unwrap()
}

fn flip_a_byte(ck: &Path) {
    let p = part(&ck.join("step-00000006"));
    let mut b = std::fs::read(&p).unwrap();
    let mid = b.len() - 9;
    b[mid] ^= 0x10;
    std::fs::write(p, b).unwrap();
}

fn remove_a_part(ck: &Path) {
    std::fs::remove_file(part(&ck.join("step-00000006"))).unwrap();
}

fn truncate_a_file(ck: &Path) {
    let p = part(&ck.join("step-00000006"));
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(p.metadata().unwrap().len() / 2).unwrap();
}

fn empty_latest(ck: &Path) {
    std::fs::write(ck.join("latest"), "").unwrap();
}

/// Every file of `a` has the bytes of the same file in `b`.
fn same_files(a: &Path, b: &Path) {
    for e in std::fs::read_dir(a).unwrap().flatten() {
        let (x, y) = (
            std::fs::read(e.path()).unwrap(),
            std::fs::read(b.join(e.file_name())),
        );
        assert_eq!(Some(x), y.ok(), "{} differs", e.path().display());
    }
}

#[test]
fn resume_latest_passes_over_a_damaged_newest_checkpoint() {
    let base = tmp("fb-base");
    run(&base, "6", &[]);
    type Damage = fn(&Path);
    let cases: [(&str, Damage, &str, &str); 4] = [
        (
            "flip",
            flip_a_byte,
            "skipped step-00000006",
            "step-00000004",
        ),
        (
            "missing",
            remove_a_part,
            "skipped step-00000006",
            "step-00000004",
        ),
        (
            "truncated",
            truncate_a_file,
            "skipped step-00000006",
            "step-00000004",
        ),
        // With no step named, the newest intact one goes on.
        ("latest", empty_latest, "skipped latest", "step-00000006"),
    ];
    for (name, damage, says, from) in cases {
        let (d, r) = (tmp(&format!("fb-{name}")), tmp(&format!("fb-{name}-ref")));
        copy_dir(&base, &d);
        copy_dir(&base, &r);
        damage(&d.join("checkpoints"));
        let said = run(&d, "8", &["--resume", "latest"]);
        assert!(said.contains(says), "{name}: {said}");
        assert!(said.contains(&format!("resuming from `")), "{name}: {said}");
        let by_name = r.join("checkpoints").join(from);
        run(&r, "8", &["--resume", by_name.to_str().unwrap()]);
        let text_of = |p: &Path| std::fs::read_to_string(p.join("scalars.csv")).unwrap();
        assert_eq!(text_of(&d), text_of(&r), "{name}: the losses of both runs");
        same_files(
            &d.join("checkpoints/step-00000008"),
            &r.join("checkpoints/step-00000008"),
        );
    }
}

#[test]
fn a_damaged_checkpoint_named_explicitly_fails() {
    let out = tmp("fb-strict");
    run(&out, "6", &[]);
    flip_a_byte(&out.join("checkpoints"));
    let named = out.join("checkpoints/step-00000006");
    let mut a: Vec<&str> = TINY.to_vec();
    a.extend_from_slice(&["--steps", "8", "--resume", named.to_str().unwrap(), "--out"]);
    a.push(out.to_str().unwrap());
    let o = train(&a);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("damaged"), "{}", text(&o));
    // And with nothing intact, latest names every checkpoint it passed over.
    for s in ["step-00000002", "step-00000004"] {
        let p = part(&out.join("checkpoints").join(s));
        std::fs::write(p, b"x").unwrap();
    }
    let mut a: Vec<&str> = TINY.to_vec();
    a.extend_from_slice(&["--steps", "8", "--resume", "latest", "--out"]);
    a.push(out.to_str().unwrap());
    let o = train(&a);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t.contains("no intact checkpoint"), "{t}");
    for s in ["step-00000002", "step-00000004", "step-00000006"] {
        assert!(t.contains(&format!("skipped {s}")), "{t}");
    }
}
