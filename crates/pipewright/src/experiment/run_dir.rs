//! The run directory: created up front (so an unwritable place fails before training), never
//! silently overwritten, files written atomically (temporary file, then rename).

use std::path::{Path, PathBuf};

use crate::{invalid, Error, Result};

/// A run's directory, which every file of the run is written into atomically.
pub struct RunDir {
    path: PathBuf,
}

impl RunDir {
    /// Whether `path` holds a run: the parameters of `pipewright train` (`params.json`) or of
    /// an experiment (`parameters.json`).
    pub fn holds_run(path: &Path) -> bool {
        ["params.json", "parameters.json"]
            .iter()
            .any(|f| path.join(f).exists())
    }

    /// Creates `path` (and parents). Refuses a directory that already holds a run.
    pub fn create(path: &Path) -> Result<Self> {
        if Self::holds_run(path) {
            return Err(invalid!(
                "`{}` already holds a run: choose another directory or remove it",
                path.display()
            ));
        }
        std::fs::create_dir_all(path)
            .map_err(|e| Error::io("cannot create run directory", path, e))?;
        let probe = path.join(".pipewright-write-test");
        std::fs::write(&probe, b"")
            .map_err(|e| Error::io("cannot write into run directory", path, e))?;
        let _ = std::fs::remove_file(&probe);
        Ok(Self {
            path: path.to_path_buf(),
        })
    }

    /// Opens the run in `path` to go on with it (a resumed run); it must hold one.
    pub fn open(path: &Path) -> Result<Self> {
        if !Self::holds_run(path) {
            return Err(invalid!(
                "`{}` holds no run (no parameters) to go on with",
                path.display()
            ));
        }
        Ok(Self {
            path: path.to_path_buf(),
        })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `name` atomically.
    pub fn write(&self, name: &str, bytes: &[u8]) -> Result<PathBuf> {
        let target = self.path.join(name);
        crate::runtime::files::write_atomic(&target, bytes)?;
        Ok(target)
    }

    /// Writes a value as pretty JSON.
    pub fn write_json(&self, name: &str, value: &impl serde::Serialize) -> Result<PathBuf> {
        let s = serde_json::to_string_pretty(value)
            .map_err(|e| invalid!("cannot serialise {name}: {e}"))?;
        self.write(name, s.as_bytes())
    }
}
