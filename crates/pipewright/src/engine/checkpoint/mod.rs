//! Checkpoints that outlive layouts (Varuna's `checkpoint` / `load_checkpoint`, PyTorch's
//! distributed checkpoint): a run saved at one pp x tp x dp resumes at any other.
//!
//! One directory per checkpoint, `<root>/step-NNNNNNNN/`:
//! - `manifest.json` ([`format::Manifest`]): the format version, the model's fingerprint, the
//!   layout, precision and world it was saved from, the step, and for every tensor its global
//!   name, whole shape and parts (file, byte range, split, checksum); a SHA-256 per file.
//! - `rank-NNNNN.safetensors`: what one writing rank owns (the first data-parallel replica
//!   writes; a whole tensor is written by the first tensor-parallel rank, a shard by its own):
//!   parameters as f32 masters, optimizer state under `<param>.exp_avg` ..., buffers.
//! - `state.json`: the step, the optimizer's step, the learning-rate schedule, the loss scaler,
//!   the seed (dropout masks and data order are functions of seed, step and micro-batch) and
//!   whatever the caller adds (data-loader position, recorder counters).
//!
//! Written into a temporary directory, fsynced, renamed, and only then `<root>/latest` updated
//! (atomically); the oldest checkpoints beyond `keep` go after that ([`save`]). Loading
//! ([`load::Reader`]) reads the parts a rank needs and slices or assembles them for its split.

pub mod fallback;
pub mod format;
pub mod hf;
pub mod load;
pub mod save;
pub mod state;

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

pub use fallback::{newest_intact, Intact, Skipped};
pub use format::{EntryKind, Manifest};
pub use hf::HfWeights;
pub use load::Reader;
pub use save::{step_dir, Header, Held, Snapshot, TensorPart, Written};
pub use state::{Owned, Restored};

use crate::distributed::comm::Communicator;
use crate::{Error, Result};

/// How to save.
#[derive(Clone, Debug, Default)]
pub struct CheckpointOptions {
    /// Keep the newest `keep` checkpoints of the directory (`None`: keep all).
    pub keep: Option<usize>,
    /// Stored in the manifest as it is (the CLI stores the model's configuration).
    pub meta: serde_json::Value,
    /// Added to `state.json` under `extra` (the CLI stores its data and recorder position).
    pub extra: serde_json::Value,
}

/// Every member's `bytes`, in rank order (just `bytes` without a communicator).
pub(crate) fn gather_bytes(
    comm: Option<&dyn Communicator>,
    bytes: Vec<u8>,
) -> Result<Vec<Vec<u8>>> {
    let Some(c) = comm else {
        return Ok(vec![bytes]);
    };
    let t = Tensor::from_vec(bytes.clone(), bytes.len(), &Device::Cpu)?;
    c.all_gather(&t)?
        .into_iter()
        .map(|t| Ok(t.to_vec1::<u8>()?))
        .collect()
}

/// Every rank's `mine`, or the first error if any rank failed (collective): so that all ranks
/// fail together instead of some waiting on the others.
pub(crate) fn agree(
    comm: Option<&dyn Communicator>,
    mine: Result<Vec<u8>>,
) -> Result<Vec<Vec<u8>>> {
    let msg = match &mine {
        Ok(b) => [&[0u8][..], b].concat(),
        Err(e) => [&[1u8][..], e.to_string().as_bytes()].concat(),
    };
    let all = gather_bytes(comm, msg)?;
    for (r, m) in all.iter().enumerate() {
        if m.first() == Some(&1) {
            let why = String::from_utf8_lossy(&m[1..]).to_string();
            return Err(match mine {
                Err(e) => e,
                Ok(_) => Error::State(format!("checkpoint: rank {r} failed: {why}")),
            });
        }
    }
    Ok(all.into_iter().map(|m| m[1..].to_vec()).collect())
}

/// The steps of the complete checkpoints in `root` (`step-NNNNNNNN` directories with a
/// manifest), unordered.
pub fn list(root: &Path) -> Result<Vec<u64>> {
    let rd = match std::fs::read_dir(root) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io("cannot list", root, e)),
    };
    let mut out = Vec::new();
    for e in rd {
        let e = e.map_err(|e| Error::io("cannot list", root, e))?;
        let name = e.file_name().to_string_lossy().to_string();
        if let Some(n) = name
            .strip_prefix("step-")
            .and_then(|s| s.parse::<u64>().ok())
        {
            if e.path().join("manifest.json").exists() {
                out.push(n);
            }
        }
    }
    Ok(out)
}

/// The checkpoint `path` names: `path` itself when it holds a manifest, else the one its
/// `latest` file names.
pub fn resolve(path: &Path) -> Result<PathBuf> {
    if path.join("manifest.json").exists() {
        return Ok(path.to_path_buf());
    }
    let latest = path.join("latest");
    match std::fs::read_to_string(&latest) {
        Ok(name) => {
            // A step directory of this root: never one of another run, nor outside it.
            let dir = crate::runtime::files::inside(path, name.trim())?;
            if dir.join("manifest.json").exists() {
                Ok(dir)
            } else {
                Err(Error::State(format!(
                    "`{}` names `{}`, which is not a complete checkpoint",
                    latest.display(),
                    name.trim()
                )))
            }
        }
        Err(_) => Err(Error::State(format!(
            "no checkpoint at `{}`: it holds neither a manifest.json nor a latest file",
            path.display()
        ))),
    }
}

/// What [`verify`] found.
#[derive(Clone, Debug, PartialEq)]
pub struct Verified {
    /// The checkpoint checked.
    pub dir: PathBuf,
    /// Files whose checksums matched.
    pub files: usize,
    /// Tensors read whole.
    pub tensors: usize,
    /// Bytes of tensor data.
    pub bytes: u64,
}

/// Checks a checkpoint: every file's checksum, every tensor part's checksum, and that each
/// tensor's parts are complete. The error names the file and tensor.
pub fn verify(path: &Path) -> Result<Verified> {
    let r = Reader::open(path)?;
    let m = r.manifest();
    for (f, sum) in &m.files {
        let p = crate::runtime::files::inside(r.dir(), f)?;
        let found = if f.ends_with(".safetensors") {
            format::file_sha256(&p)
        } else {
            std::fs::read(&p)
                .map(|b| crate::runtime::digest::sha256(&b))
                .map_err(|e| Error::io("cannot read", &p, e))
        };
        if found.as_ref().ok() != Some(sum) {
            // Name the tensor whose bytes changed, when it is one.
            for (name, e) in &m.tensors {
                for part in e.parts.iter().filter(|p| &p.file == f) {
                    format::read_part(r.dir(), name, part)?;
                }
            }
            return Err(Error::State(format!(
                "`{}` is damaged: it does not match its checksum",
                p.display()
            )));
        }
    }
    for name in m.tensors.keys() {
        r.read_whole(name)?;
    }
    Ok(Verified {
        dir: r.dir().to_path_buf(),
        files: m.files.len(),
        tensors: m.tensors.len(),
        bytes: m.bytes(),
    })
}

/// A save whose files are being written in a background thread; [`finish`] completes it
/// (collectively).
pub struct Pending {
    root: PathBuf,
    header: Header,
    handle: std::thread::JoinHandle<Result<Written>>,
}

/// Starts a save: phase 1 now (collective), the file writes in a background thread.
pub fn start(
    comm: Option<&dyn Communicator>,
    root: &Path,
    header: Header,
    snap: Snapshot,
) -> Result<Pending> {
    save::prepare(comm, root, header.step)?;
    let (r, step) = (root.to_path_buf(), header.step);
    let handle = std::thread::spawn(move || save::write(&r, step, &snap));
    Ok(Pending {
        root: root.to_path_buf(),
        header,
        handle,
    })
}

/// Waits for the background writes of `p` and publishes the checkpoint (collective).
pub fn finish(comm: Option<&dyn Communicator>, p: Pending) -> Result<PathBuf> {
    let written = p
        .handle
        .join()
        .map_err(|_| Error::State("checkpoint: the writing thread panicked".into()))
        .and_then(|w| w);
    save::finish(comm, &p.root, &p.header, written)
}

/// A synchronous save (collective): [`start`] and [`finish`] at once.
pub fn save_now(
    comm: Option<&dyn Communicator>,
    root: &Path,
    header: Header,
    snap: Snapshot,
) -> Result<PathBuf> {
    let pending = start(comm, root, header, snap)?;
    finish(comm, pending)
}
