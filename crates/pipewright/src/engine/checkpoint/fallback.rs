//! What `--resume latest` (and a launcher's restart) goes on from when the newest checkpoint is
//! damaged: a flipped byte, a missing or truncated part, a `latest` that is empty or names a
//! step that is not there. A damaged newest checkpoint is not the end of a run: the newest
//! intact one saved before it is, and every checkpoint passed over is named with why. A
//! checkpoint named explicitly (`--resume DIR/step-N`) stays strict ([`super::resolve`]): it
//! loads or fails.
//!
//! "Before it" is by step, up to the step `latest` names: after a rollback (a run resumed from
//! an earlier step), checkpoints of higher steps may be left from the abandoned run, and they
//! are not this run's past. Without a readable `latest`, every complete checkpoint counts.

use std::path::{Path, PathBuf};

use super::{list, step_dir, verify};
use crate::{Error, Result};

/// A checkpoint passed over, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Skipped {
    /// Its directory's name (`step-NNNNNNNN`), or `latest` when that file itself is unusable.
    pub name: String,
    /// What is wrong with it.
    pub why: String,
}

impl std::fmt::Display for Skipped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "skipped {}: {}", self.name, self.why)
    }
}

/// The checkpoint a run goes on from, and those passed over to find it (newest first).
#[derive(Clone, Debug, PartialEq)]
pub struct Intact {
    /// The newest intact checkpoint.
    pub dir: PathBuf,
    /// The newer ones that were damaged or incomplete.
    pub skipped: Vec<Skipped>,
}

/// The step a checkpoint directory's name gives (`step-NNNNNNNN`).
fn step_of(name: &str) -> Option<u64> {
    name.strip_prefix("step-")?.parse().ok()
}

/// The newest intact checkpoint of `root` at or before the step its `latest` names, each one
/// verified ([`verify`]: every file's and tensor's checksum) before it is chosen. `root`
/// holding a manifest itself is that checkpoint, unverified (as named explicitly). `Ok(None)`
/// when `root` holds no checkpoint at all and no `latest`; an error naming every skipped one
/// when none is intact.
pub fn newest_intact(root: &Path) -> Result<Option<Intact>> {
    if root.join("manifest.json").exists() {
        return Ok(Some(Intact {
            dir: root.to_path_buf(),
            skipped: Vec::new(),
        }));
    }
    let mut skipped = Vec::new();
    let latest = root.join("latest");
    let named = match std::fs::read_to_string(&latest) {
        Ok(s) if !s.trim().is_empty() => Some(s.trim().to_string()),
        Ok(_) => {
            skipped.push(Skipped {
                name: "latest".into(),
                why: format!("`{}` is empty", latest.display()),
            });
            None
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => {
            skipped.push(Skipped {
                name: "latest".into(),
                why: Error::io("cannot read", &latest, e).to_string(),
            });
            None
        }
    };
    // A `latest` that leads outside `root` is refused, never followed or passed over.
    if let Some(n) = &named {
        crate::runtime::files::inside(root, n)?;
    }
    let limit = named.as_deref().and_then(step_of);
    if let (Some(n), None) = (&named, limit) {
        skipped.push(Skipped {
            name: "latest".into(),
            why: format!("it names `{n}`, which is not a step-NNNNNNNN checkpoint"),
        });
    }
    let mut steps = list(root)?;
    steps.retain(|s| limit.is_none_or(|l| *s <= l));
    steps.sort_unstable_by(|a, b| b.cmp(a));
    if let Some(l) = limit.filter(|l| steps.first() != Some(l)) {
        skipped.push(Skipped {
            name: format!("step-{l:08}"),
            why: "it is not a complete checkpoint (no manifest.json)".into(),
        });
    }
    if steps.is_empty() && named.is_none() && skipped.is_empty() {
        return Ok(None);
    }
    for s in steps {
        let dir = step_dir(root, s);
        match verify(&dir) {
            Ok(_) => return Ok(Some(Intact { dir, skipped })),
            Err(e) => skipped.push(Skipped {
                name: format!("step-{s:08}"),
                why: e.to_string(),
            }),
        }
    }
    let why: Vec<String> = skipped.iter().map(|s| format!("\n  {s}")).collect();
    Err(Error::State(format!(
        "no intact checkpoint in `{}` to resume from:{}",
        root.display(),
        why.concat()
    )))
}
