//! Which run a directory belongs to. A run owns its run directory and its checkpoint
//! directory: each holds an owner file (`.pipewright-run`, the run's id and its run
//! directory) written when the run first makes or claims it. Another run is refused there with
//! what to do, and so is a directory that is not a run's (`--out /etc`, a folder of a user's
//! pictures): a run writes only into directories that are new, empty or its own. The lock
//! ([`super::RunLock`]) keeps two live processes apart; the owner file keeps one run after
//! another apart.
//!
//! Directories written before owner files existed are taken over by the run that goes on in
//! them (a resume or a restarted attempt), never by a new one.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::{invalid, Error, Result};

/// The owner file's name inside a run or checkpoint directory.
pub const OWNER_FILE: &str = ".pipewright-run";

/// What an owner file says.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    /// The run's id: made once, when its run directory is made.
    pub run: String,
    /// The run's directory, as it was given.
    pub dir: PathBuf,
}

impl Owner {
    /// The owner `dir` names, if it holds an owner file (an unreadable one is an error: the
    /// directory is damaged or not pipewright's).
    pub fn of(dir: &Path) -> Result<Option<Self>> {
        let path = dir.join(OWNER_FILE);
        match std::fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text).map(Some).map_err(|e| {
                Error::State(format!(
                    "`{}` is damaged ({e}): remove it if `{}` is yours to write into",
                    path.display(),
                    dir.display()
                ))
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io("cannot read", &path, e)),
        }
    }

    fn write(&self, into: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self)
            .map_err(|e| invalid!("cannot write the owner file: {e}"))?;
        crate::runtime::files::write_atomic(&into.join(OWNER_FILE), text.as_bytes())
    }
}

/// A new run id: the time in nanoseconds and the process, in hex.
fn new_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{nanos:x}-{:x}", std::process::id())
}

/// Whether `dir` holds nothing but what claiming it writes (the lock, the owner file) or what
/// `pipewright launch` writes there before the run's first rank starts (its heartbeats, its
/// record of attempts).
fn empty_but_ours(dir: &Path) -> Result<bool> {
    let entries = match std::fs::read_dir(dir) {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(true),
        Err(e) => return Err(Error::io("cannot read", dir, e)),
    };
    Ok(entries.flatten().all(|e| {
        matches!(
            e.file_name().to_str(),
            Some(n) if [
                OWNER_FILE,
                super::lock::LOCK_FILE,
                crate::distributed::HEARTBEAT_DIR,
                crate::distributed::LAUNCH_RECORD,
            ]
            .contains(&n)
        )
    }))
}

/// Fails unless `dir` may become a run directory: it does not exist, is empty, or already
/// holds a run (which [`super::RunDir`] then opens or refuses) or an owner file. `flag` names
/// where the path came from, for the message. Call it before anything is written there.
pub fn check_run_dir(dir: &Path, flag: &str) -> Result<()> {
    // A path that is no directory is for making it to refuse, saying why.
    if !dir.is_dir()
        || empty_but_ours(dir)?
        || super::RunDir::holds_run(dir)
        || Owner::of(dir)?.is_some()
    {
        return Ok(());
    }
    Err(invalid!(
        "{flag} `{}` is not empty and is not a pipewright run directory: a run writes its \
         files (scalars, images, checkpoints) only into a new or empty directory, or goes on in \
         its own; give {flag} a new directory",
        dir.display()
    ))
}

/// The run that owns the run directory `dir`: read from its owner file, or made and written
/// there when it has none (a new run, or one of before owner files that goes on).
pub fn claim_run_dir(dir: &Path) -> Result<Owner> {
    if let Some(o) = Owner::of(dir)? {
        return Ok(o);
    }
    let owner = Owner {
        run: new_id(),
        dir: dir.to_path_buf(),
    };
    owner.write(dir)?;
    Ok(owner)
}

/// Claims the checkpoint directory `dir` for the run `me` (whose run directory's owner it is):
/// its own already, or new or empty, or, for a run that `goes_on` (resumed or restarted),
/// checkpoints saved before owner files existed. Another run's checkpoints, or a directory of
/// other files, are refused with what to do.
pub fn claim_checkpoint_dir(dir: &Path, me: &Owner, goes_on: bool) -> Result<()> {
    match Owner::of(dir)? {
        Some(o) if o.run == me.run => return Ok(()),
        Some(o) => {
            return Err(invalid!(
                "--checkpoint-dir `{}` holds the checkpoints of another run (its run directory \
                 `{}`): saving there would replace them and move its `latest`. Give this run a \
                 checkpoint directory of its own, or go on with that run (`--out {} --resume \
                 latest`); to start from one of its checkpoints, pass it to --resume and keep \
                 --checkpoint-dir for this run's own",
                dir.display(),
                o.dir.display(),
                o.dir.display()
            ))
        }
        None => {}
    }
    let legacy = goes_on && crate::engine::checkpoint::newest_intact(dir)?.is_some();
    if !(empty_but_ours(dir)? || legacy) {
        return Err(invalid!(
            "--checkpoint-dir `{}` is not empty and holds no checkpoints of this run: a run \
             saves only into a new or empty directory, or its own; give --checkpoint-dir a new \
             directory",
            dir.display()
        ));
    }
    me.write(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("pw-owner-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn what_the_launcher_makes_first_leaves_a_directory_new() {
        let d = tmp("launched");
        std::fs::create_dir_all(d.join(crate::distributed::HEARTBEAT_DIR)).unwrap();
        check_run_dir(&d, "--out").unwrap();
        std::fs::write(d.join("notes.txt"), "mine").unwrap();
        let e = check_run_dir(&d, "--out").unwrap_err().to_string();
        assert!(e.contains("is not a pipewright run directory"), "{e}");
        // A path that is no directory is left for making it to refuse.
        check_run_dir(&d.join("notes.txt"), "--out").unwrap();
    }

    #[test]
    fn a_checkpoint_directory_is_its_owners_alone() {
        let (run, other) = (tmp("run"), tmp("other"));
        let (me, them) = (claim_run_dir(&run).unwrap(), claim_run_dir(&other).unwrap());
        assert_ne!(me.run, them.run);
        assert_eq!(
            claim_run_dir(&run).unwrap(),
            me,
            "read back, not made again"
        );
        let ck = tmp("ck");
        claim_checkpoint_dir(&ck, &me, false).unwrap();
        claim_checkpoint_dir(&ck, &me, true).unwrap();
        let e = claim_checkpoint_dir(&ck, &them, true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("holds the checkpoints of another run"), "{e}");
        let full = tmp("full");
        std::fs::write(full.join("data.bin"), "x").unwrap();
        let e = claim_checkpoint_dir(&full, &me, true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("holds no checkpoints of this run"), "{e}");
    }
}
