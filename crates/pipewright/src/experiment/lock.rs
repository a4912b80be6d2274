//! One run per run directory: the process that makes or reopens a run directory holds its
//! lock file (`.lock`: the owner's pid and host) until the run ends, and a second run into it
//! is a clear error instead of two runs interleaving their files.
//!
//! A lock is stale, and taken over, when its owner is gone: the pid no longer runs on this
//! host, or the job is a restarted attempt (`PIPEWRIGHT_RESTART` > 0: the launcher ended the
//! attempt before, on whatever host). A lock held on another host by a first attempt cannot be
//! checked from here: the error says how to remove it.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The lock file's name inside a run directory.
pub const LOCK_FILE: &str = ".lock";

/// A held run-directory lock; dropping it removes the file.
#[derive(Debug)]
pub struct RunLock {
    path: PathBuf,
    mine: String,
}

/// Whether the lock text `held` (`pid host`) names a process that still runs.
fn alive(held: &str) -> bool {
    let mut it = held.split_whitespace();
    let (Some(pid), Some(h)) = (it.next().and_then(|p| p.parse::<u32>().ok()), it.next()) else {
        return false;
    };
    if crate::distributed::Env::from_env().restart > 0 {
        return false;
    }
    if h != crate::runtime::hostname() {
        return true;
    }
    pid != std::process::id() && Path::new(&format!("/proc/{pid}")).exists()
}

impl RunLock {
    /// Takes the lock of the run directory `dir` (which must exist) for this process.
    pub fn acquire(dir: &Path) -> Result<Self> {
        let path = dir.join(LOCK_FILE);
        let mine = format!("{} {}", std::process::id(), crate::runtime::hostname());
        for _ in 0..3 {
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(mut f) => {
                    f.write_all(mine.as_bytes())
                        .map_err(|e| Error::io("cannot write", &path, e))?;
                    return Ok(Self { path, mine });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let held = std::fs::read_to_string(&path).unwrap_or_default();
                    if alive(&held) {
                        return Err(crate::invalid!(
                            "`{}` is in use by another run (process {}): wait for it to end or \
                             choose another directory (if that process is gone, remove `{}`)",
                            dir.display(),
                            held.trim(),
                            path.display()
                        ));
                    }
                    // Stale: its owner is gone. Remove it and try again.
                    let _ = std::fs::remove_file(&path);
                }
                Err(e) => return Err(Error::io("cannot create", &path, e)),
            }
        }
        Err(crate::invalid!(
            "cannot take the lock `{}`: another process keeps making it",
            path.display()
        ))
    }
}

impl Drop for RunLock {
    fn drop(&mut self) {
        // Only our own lock: a stale-lock takeover by a later run is not undone.
        if std::fs::read_to_string(&self.path).is_ok_and(|h| h == self.mine) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}
