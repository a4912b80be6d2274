//! Saving, collectively and atomically: every rank snapshots what it owns ([`Snapshot`]); the
//! writing ranks write their safetensors files into `<root>/.step-NNNNNNNN.tmp` (this part may
//! run in a background thread); then rank 0 gathers what each wrote, writes `state.json` and
//! `manifest.json`, renames the directory to `step-NNNNNNNN`, and only then points `latest`
//! at it and removes the oldest checkpoints beyond `keep`. A failure anywhere removes the
//! temporary directory, leaves earlier checkpoints as they were, and is reported by every rank.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use super::agree;
use super::format::{
    f32_data, fingerprint, write_safetensors, Blob, EntryKind, Manifest, Part, TensorEntry,
    FORMAT_VERSION,
};
use crate::distributed::comm::Communicator;
use crate::distributed::topology::Layout;
use crate::{Error, Result};

/// How a tensor of a snapshot is split: part `index` of `count` along `axis` in `stride`
/// blocks (part 0 of 1 when whole).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorPart {
    /// The split axis.
    pub axis: usize,
    /// Blocks of the axis split separately.
    pub stride: usize,
    /// Which part.
    pub index: usize,
    /// Of how many.
    pub count: usize,
}

impl TensorPart {
    /// A whole tensor.
    pub const WHOLE: TensorPart = TensorPart {
        axis: 0,
        stride: 1,
        index: 0,
        count: 1,
    };
}

/// One tensor a rank holds: its global name, kind, whole shape, split, and its part's shape
/// and values (a copy, so training can go on while it is written).
#[derive(Clone, Debug)]
pub struct Held {
    /// Global name.
    pub name: String,
    /// Parameter, optimizer state or buffer.
    pub kind: EntryKind,
    /// The whole tensor's shape.
    pub whole: Vec<usize>,
    /// Which part of it this rank holds.
    pub split: TensorPart,
    /// The part's shape.
    pub shape: Vec<usize>,
    /// The part's values, row-major.
    pub data: Vec<f32>,
}

impl Held {
    /// Copies `t`'s values.
    pub fn new(
        name: &str,
        kind: EntryKind,
        whole: Vec<usize>,
        split: TensorPart,
        t: &Tensor,
    ) -> Result<Self> {
        Ok(Self {
            name: name.to_string(),
            kind,
            whole,
            split,
            shape: t.dims().to_vec(),
            data: f32_data(t)?,
        })
    }
}

/// What one rank contributes to a checkpoint.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// World rank (names the file).
    pub rank: usize,
    /// The tensors this rank writes (empty on ranks that write nothing).
    pub tensors: Vec<Held>,
    /// Every parameter this rank holds (written or not) with its whole shape.
    pub params: Vec<(String, Vec<usize>)>,
}

/// What the checkpoint describes besides tensors.
#[derive(Clone, Debug)]
pub struct Header {
    /// The saving job's layout.
    pub layout: Layout,
    /// Its precision.
    pub precision: String,
    /// Its ranks.
    pub world: usize,
    /// Steps taken (names the directory).
    pub step: u64,
    /// `state.json`.
    pub state: serde_json::Value,
    /// Stored in the manifest as it is.
    pub meta: serde_json::Value,
    /// Checkpoints kept after this one is complete (`None`: all).
    pub keep: Option<usize>,
}

/// What a rank wrote: its file's name and checksum and each tensor's part.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Written {
    /// The file written and its checksum (none on ranks that write nothing).
    pub file: Option<(String, String)>,
    /// Each tensor written: name, kind, whole shape, part.
    pub parts: Vec<(String, EntryKind, Vec<usize>, Part)>,
    /// Every parameter of the rank with its whole shape (for the fingerprint).
    pub params: Vec<(String, Vec<usize>)>,
}

/// `<root>/step-NNNNNNNN`.
pub fn step_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!("step-{step:08}"))
}

fn tmp_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!(".step-{step:08}.tmp"))
}

/// Removes the temporary directories a killed save left in `root` (`.step-N.tmp`; a save in
/// flight is always finished before the next one starts, so none is in use).
fn clear_stale(root: &Path) -> Result<()> {
    let rd = std::fs::read_dir(root).map_err(|e| Error::io("cannot list", root, e))?;
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if name.starts_with(".step-") && name.ends_with(".tmp") {
            let p = e.path();
            std::fs::remove_dir_all(&p).map_err(|e| Error::io("cannot clear", &p, e))?;
        }
    }
    Ok(())
}

/// Phase 1 (collective): rank 0 makes `root` and an empty temporary directory for `step`.
pub fn prepare(comm: Option<&dyn Communicator>, root: &Path, step: u64) -> Result<()> {
    let rank = comm.map_or(0, |c| c.rank());
    let tmp = tmp_dir(root, step);
    let mine = if rank == 0 {
        (|| {
            std::fs::create_dir_all(root)
                .map_err(|e| Error::io("cannot create checkpoint directory", root, e))?;
            clear_stale(root)?;
            std::fs::create_dir(&tmp).map_err(|e| Error::io("cannot create", &tmp, e))?;
            Ok(Vec::new())
        })()
    } else {
        Ok(Vec::new())
    };
    agree(comm, mine).map(|_| ())
}

/// Phase 2 (local, may run in a background thread): writes `snap`'s tensors, if any, into the
/// temporary directory of `step`.
pub fn write(root: &Path, step: u64, snap: &Snapshot) -> Result<Written> {
    let mut w = Written {
        params: snap.params.clone(),
        ..Default::default()
    };
    if snap.tensors.is_empty() {
        return Ok(w);
    }
    let file = format!("rank-{:05}.safetensors", snap.rank);
    let blobs: Vec<Blob> = snap
        .tensors
        .iter()
        .map(|h| (h.name.as_str(), h.shape.as_slice(), h.data.as_slice()))
        .collect();
    let (ranges, sum) = write_safetensors(&tmp_dir(root, step).join(&file), &blobs)?;
    for (h, (begin, end, sha256)) in snap.tensors.iter().zip(ranges) {
        let part = Part {
            file: file.clone(),
            begin,
            end,
            shape: h.shape.clone(),
            axis: h.split.axis,
            stride: h.split.stride,
            index: h.split.index,
            count: h.split.count,
            sha256,
        };
        w.parts
            .push((h.name.clone(), h.kind, h.whole.clone(), part));
    }
    w.file = Some((file, sum));
    Ok(w)
}

/// Phase 3 (collective): gathers what every rank wrote; rank 0 completes and publishes the
/// checkpoint. Returns its directory on every rank.
pub fn finish(
    comm: Option<&dyn Communicator>,
    root: &Path,
    header: &Header,
    written: Result<Written>,
) -> Result<PathBuf> {
    let rank = comm.map_or(0, |c| c.rank());
    let tmp = tmp_dir(root, header.step);
    let mine = written
        .and_then(|w| serde_json::to_vec(&w).map_err(|e| Error::State(format!("checkpoint: {e}"))));
    let all = match agree(comm, mine) {
        Ok(all) => all,
        Err(e) => {
            if rank == 0 {
                let _ = std::fs::remove_dir_all(&tmp);
            }
            return Err(e);
        }
    };
    let done = if rank == 0 {
        publish(root, header, &all).map(|p| p.display().to_string().into_bytes())
    } else {
        Ok(Vec::new())
    };
    if rank == 0 && done.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    let all = agree(comm, done)?;
    Ok(PathBuf::from(String::from_utf8_lossy(&all[0]).to_string()))
}

/// Rank 0: the manifest from every rank's [`Written`], `state.json`, the rename, `latest`.
fn publish(root: &Path, header: &Header, all: &[Vec<u8>]) -> Result<PathBuf> {
    let tmp = tmp_dir(root, header.step);
    let mut tensors: BTreeMap<String, TensorEntry> = BTreeMap::new();
    let mut files = BTreeMap::new();
    let mut params = BTreeMap::new();
    for bytes in all {
        let w: Written = serde_json::from_slice(bytes)
            .map_err(|e| Error::State(format!("checkpoint: a rank's report is unreadable: {e}")))?;
        if let Some((f, sum)) = w.file {
            files.insert(f, sum);
        }
        params.extend(w.params);
        for (name, kind, whole, part) in w.parts {
            let e = tensors.entry(name.clone()).or_insert_with(|| TensorEntry {
                kind,
                shape: whole.clone(),
                dtype: "F32".into(),
                parts: Vec::new(),
            });
            if e.shape != whole {
                return Err(Error::State(format!(
                    "checkpoint: ranks disagree on the shape of `{name}`: {:?} and {whole:?}",
                    e.shape
                )));
            }
            e.parts.push(part);
        }
    }
    for e in tensors.values_mut() {
        e.parts.sort_by_key(|p| p.index);
    }
    let state = serde_json::to_vec_pretty(&header.state)
        .map_err(|e| Error::State(format!("checkpoint: {e}")))?;
    write_synced(&tmp.join("state.json"), &state)?;
    files.insert("state.json".into(), crate::runtime::digest::sha256(&state));
    let params: Vec<(String, Vec<usize>)> = params.into_iter().collect();
    let manifest = Manifest {
        format_version: FORMAT_VERSION,
        fingerprint: fingerprint(&params),
        layout: header.layout,
        precision: header.precision.clone(),
        world: header.world,
        step: header.step,
        tensors,
        files,
        meta: header.meta.clone(),
    };
    let json = serde_json::to_vec_pretty(&manifest)
        .map_err(|e| Error::State(format!("checkpoint: {e}")))?;
    write_synced(&tmp.join("manifest.json"), &json)?;
    sync_dir(&tmp)?;
    let dst = step_dir(root, header.step);
    if dst.exists() {
        std::fs::remove_dir_all(&dst).map_err(|e| Error::io("cannot replace", &dst, e))?;
    }
    std::fs::rename(&tmp, &dst).map_err(|e| Error::io("cannot rename into", &dst, e))?;
    sync_dir(root)?;
    let name = format!("step-{:08}\n", header.step);
    let latest_tmp = root.join(".latest.tmp");
    write_synced(&latest_tmp, name.as_bytes())?;
    let latest = root.join("latest");
    std::fs::rename(&latest_tmp, &latest)
        .map_err(|e| Error::io("cannot rename into", &latest, e))?;
    sync_dir(root)?;
    if let Some(keep) = header.keep {
        prune(root, header.step, keep.max(1))?;
    }
    Ok(dst)
}

/// Removes the oldest complete checkpoints of `root` up to `step` (the one just saved) beyond
/// the newest `keep` of them. Those of later steps are left: after a rollback (a run resumed
/// from an earlier step) they are an abandoned run's, and counting them pruned this run's own
/// newest checkpoint, the one `latest` names.
fn prune(root: &Path, step: u64, keep: usize) -> Result<()> {
    let mut steps = super::list(root)?;
    steps.retain(|s| *s <= step);
    steps.sort();
    let n = steps.len().saturating_sub(keep);
    for s in &steps[..n] {
        let d = step_dir(root, *s);
        std::fs::remove_dir_all(&d)
            .map_err(|e| Error::io("cannot remove old checkpoint", &d, e))?;
    }
    Ok(())
}

/// Writes `bytes` to `path` and fsyncs it.
pub fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path).map_err(|e| Error::io("cannot create", path, e))?;
    f.write_all(bytes)
        .and_then(|_| f.sync_all())
        .map_err(|e| Error::io("cannot write", path, e))
}

fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| Error::io("cannot sync", dir, e))
}
