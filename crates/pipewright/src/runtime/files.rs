//! Where a command may write: never over what it did not make. A command that writes a new
//! file or directory (`ckpt export`, `ckpt reshard`, a sweep's directory) takes a path that
//! does not exist yet, or an empty directory, and refuses anything else with the fix
//! ([`ensure_new`]). A command that writes one file of a kind it can recognise (a report page,
//! a trace, a drawn schedule, a profile, a hardware description) replaces only a file of that
//! kind, so that a rerun updates its output and never turns a run's scalars into HTML
//! ([`ensure_replaceable`]).

use std::path::Path;

use crate::{invalid, Error, Result};

/// Fails unless `path` is free for a command to write: it does not exist, or it is an empty
/// directory. `flag` names where the path came from (`--out`), for the message.
pub fn ensure_new(path: &Path, flag: &str) -> Result<()> {
    let meta = match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io("cannot read", path, e)),
        Ok(m) => m,
    };
    let empty_dir = meta.is_dir()
        && std::fs::read_dir(path)
            .map_err(|e| Error::io("cannot read", path, e))?
            .next()
            .is_none();
    if empty_dir {
        return Ok(());
    }
    Err(invalid!(
        "{flag} `{}` already exists{}: it is written only as a new path or an empty directory, \
         so that nothing is overwritten: choose another or remove it",
        path.display(),
        if meta.is_dir() {
            " and holds files"
        } else {
            ""
        }
    ))
}

/// Fails unless `path` is free for a command that writes `what` (one file): it does not
/// exist, or it is a file of that kind, which `ours` recognises by its text (what an earlier
/// run of the command wrote, which a rerun replaces). Anything else, a run's scalars, a
/// checkpoint's part, a directory, is refused with the fix before any work is done; a file of
/// its kind that is replaced is said on stderr. `flag` names where the path came from
/// (`--out`).
pub fn ensure_replaceable(
    path: &Path,
    flag: &str,
    what: &str,
    ours: impl Fn(&str) -> bool,
) -> Result<()> {
    let meta = match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io("cannot read", path, e)),
        Ok(m) => m,
    };
    // What these commands write is small: a larger file is not one of theirs.
    let text = (meta.is_file() && meta.len() <= 256 << 20)
        .then(|| std::fs::read_to_string(path).ok())
        .flatten();
    if text.as_deref().is_some_and(ours) {
        // Said, so that a rerun's replacing an earlier output is never a surprise.
        eprintln!(
            "note: {flag} `{}` replaces {what} written there before",
            path.display()
        );
        return Ok(());
    }
    Err(invalid!(
        "{flag} `{}` already exists and is not {what}: it would be overwritten; choose another \
         path or remove it",
        path.display()
    ))
}

/// The nearest directory of `path` or above it that holds a checkpoint (`manifest.json`) or,
/// with `live`, a run in progress (its `.lock`): writing there would mix a new output into a
/// checkpoint, or into files another run is writing and pruning.
pub fn inside_other(path: &Path, live: bool) -> Option<(std::path::PathBuf, &'static str)> {
    path.ancestors()
        .filter(|a| !a.as_os_str().is_empty())
        .find_map(|a| {
            if a.join("manifest.json").exists() {
                Some((a.to_path_buf(), "a checkpoint"))
            } else if live && a != path && a.join(".lock").exists() {
                Some((a.to_path_buf(), "the directory of a run in progress"))
            } else {
                None
            }
        })
}

/// `dir/name` for a file that a stored description (a checkpoint's manifest, its `latest`)
/// names: `name` must be a plain file name (one component: no separator, not `.` or `..`, not
/// absolute), and the path must stay inside `dir` once symlinks are followed, so that a
/// damaged or hostile description never reads outside its directory.
pub fn inside(dir: &Path, name: &str) -> Result<std::path::PathBuf> {
    let mut parts = Path::new(name).components();
    let plain = matches!(
        (parts.next(), parts.next()),
        (Some(std::path::Component::Normal(_)), None)
    );
    if !plain {
        return Err(Error::State(format!(
            "`{}` names `{name}`, which is not a file of that directory: it is damaged or was \
             not written by pipewright",
            dir.display()
        )));
    }
    let path = dir.join(name);
    if let (Ok(real), Ok(root)) = (path.canonicalize(), dir.canonicalize()) {
        if !real.starts_with(&root) {
            return Err(Error::State(format!(
                "`{}` leads outside `{}` (to `{}`): refused",
                path.display(),
                dir.display(),
                real.display()
            )));
        }
    }
    Ok(path)
}

/// Writes `bytes` to `path` whole or not at all: into `.NAME.tmp` beside it, then renamed over
/// it, so a reader (or a run killed while writing) never sees half a file. A missing directory
/// on the way is made (`--out runs/new/report.html`).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    if let Some(dir) = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty() && !d.exists())
    {
        std::fs::create_dir_all(dir).map_err(|e| Error::io("cannot create", dir, e))?;
    }
    let name = path
        .file_name()
        .map_or_else(|| "file".into(), |n| n.to_string_lossy().into_owned());
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    std::fs::write(&tmp, bytes).map_err(|e| Error::io("cannot write", &tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io("cannot rename into", path, e))
}
