//! The on-disk format: `manifest.json` (what every tensor is and where its parts lie, with
//! checksums), `state.json` (counters and schedules) and safetensors files, one per writing
//! rank. Tensors are stored as f32 (parameters as their f32 masters), so a checkpoint loads
//! into any precision.

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::distributed::topology::Layout;
use crate::runtime::digest::{hex, sha256};
use crate::{Error, Result};

/// The version of the format this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// What a tensor of a checkpoint is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EntryKind {
    /// A trained parameter (its f32 master).
    Param,
    /// Optimizer state of a parameter (`<name>.exp_avg`, `<name>.momentum_buffer`, ...),
    /// split as the parameter is.
    Optimizer,
    /// Non-trained model state (BatchNorm running statistics).
    Buffer,
}

/// One stored part of a tensor: the bytes `begin..end` of `file` hold part `index` of `count`
/// along `axis` (in `stride` blocks, see [`crate::parallel::tensor_parallel::part`]); a whole tensor is part 0 of 1.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Part {
    /// The file holding it, in the checkpoint's directory.
    pub file: String,
    /// Its first byte in the file.
    pub begin: u64,
    /// One past its last byte.
    pub end: u64,
    /// The part's shape.
    pub shape: Vec<usize>,
    /// The split axis (0 for a whole tensor).
    pub axis: usize,
    /// Blocks of the axis split separately (GPT's q|k|v: 3).
    pub stride: usize,
    /// Which part this is.
    pub index: usize,
    /// Of how many.
    pub count: usize,
    /// SHA-256 of the part's bytes.
    pub sha256: String,
}

/// One tensor of the model's state, layout-free: its global name's whole shape and its parts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// Parameter, optimizer state or buffer.
    pub kind: EntryKind,
    /// The whole tensor's shape.
    pub shape: Vec<usize>,
    /// As stored (`F32`).
    pub dtype: String,
    /// Its parts, by index.
    pub parts: Vec<Part>,
}

/// `manifest.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT_VERSION`] of the writer.
    pub format_version: u32,
    /// SHA-256 over the model's parameter names and whole shapes (see [`fingerprint`]).
    pub fingerprint: String,
    /// The layout it was saved from.
    pub layout: Layout,
    /// The precision it was trained in (`f32`, `bf16`, `f16`).
    pub precision: String,
    /// Ranks of the saving job.
    pub world: usize,
    /// Steps taken when it was saved.
    pub step: u64,
    /// Every tensor by global name.
    pub tensors: BTreeMap<String, TensorEntry>,
    /// SHA-256 of every file of the checkpoint but the manifest.
    pub files: BTreeMap<String, String>,
    /// What the caller stored beside (the CLI: the model's configuration).
    #[serde(default)]
    pub meta: serde_json::Value,
}

impl Manifest {
    /// Reads `<dir>/manifest.json`.
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join("manifest.json");
        let bytes = std::fs::read(&path).map_err(|e| Error::io("cannot read", &path, e))?;
        let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| {
            Error::State(format!(
                "`{}` is not a checkpoint manifest ({e}): the checkpoint is damaged",
                path.display()
            ))
        })?;
        if m.format_version != FORMAT_VERSION {
            return Err(Error::State(format!(
                "`{}` has format version {}, this pipewright reads {FORMAT_VERSION}",
                path.display(),
                m.format_version
            )));
        }
        m.check().map_err(|why| {
            Error::State(format!(
                "`{}` is damaged or was not written by pipewright: {why}",
                path.display()
            ))
        })?;
        Ok(m)
    }

    /// Every file a part names is one of the checkpoint's files and a plain file name; every
    /// tensor is F32 and every part's byte range matches its shape of f32s, without overflow.
    fn check(&self) -> std::result::Result<(), String> {
        for f in self.files.keys() {
            crate::runtime::files::inside(Path::new("."), f)
                .map_err(|_| format!("file `{f}` is not a plain name"))?;
        }
        for (name, e) in &self.tensors {
            // Parts are f32 (masters and optimizer state); another dtype would be read as f32.
            if e.dtype != "F32" {
                return Err(format!(
                    "tensor `{name}` is stored as {}, and checkpoints hold F32",
                    e.dtype
                ));
            }
            for p in &e.parts {
                if !self.files.contains_key(&p.file) {
                    return Err(format!(
                        "tensor `{name}` lies in `{}`, not a file of it",
                        p.file
                    ));
                }
                let bytes = p
                    .shape
                    .iter()
                    .try_fold(4u64, |n, d| n.checked_mul(*d as u64))
                    .ok_or_else(|| format!("tensor `{name}` has a part of shape {:?}", p.shape))?;
                if p.end.checked_sub(p.begin) != Some(bytes) {
                    return Err(format!(
                        "tensor `{name}` has bytes {}..{} for shape {:?}",
                        p.begin, p.end, p.shape
                    ));
                }
            }
        }
        Ok(())
    }

    /// The parameters' (name, whole shape), sorted by name.
    pub fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        self.tensors
            .iter()
            .filter(|(_, e)| e.kind == EntryKind::Param)
            .map(|(n, e)| (n.clone(), e.shape.clone()))
            .collect()
    }

    /// Bytes of stored tensor data.
    pub fn bytes(&self) -> u64 {
        self.tensors
            .values()
            .flat_map(|e| &e.parts)
            .map(|p| p.end - p.begin)
            .sum()
    }
}

/// The fingerprint of a model: SHA-256 over its parameters' names and whole shapes, in name
/// order (so every layout of the model has the same one).
pub fn fingerprint(params: &[(String, Vec<usize>)]) -> String {
    let mut sorted = params.to_vec();
    sorted.sort();
    let mut h = Sha256::new();
    for (n, s) in sorted {
        h.update(format!("{n} {s:?} F32\n").as_bytes());
    }
    hex(&h.finalize())
}

// Files hold little-endian f32; this build writes and reads its own f32 memory as is.
#[cfg(target_endian = "big")]
compile_error!("pipewright checkpoints assume a little-endian machine");

/// A tensor's elements as f32, in row-major order (one copy).
pub fn f32_data(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)
}

/// A tensor to write: (name, shape, f32 elements).
pub type Blob<'a> = (&'a str, &'a [usize], &'a [f32]);

/// Where a blob landed: its absolute byte range in the file and its SHA-256.
pub type Range = (u64, u64, String);

/// The checksum of a checkpoint file: SHA-256 over its first `data_start` bytes (length and
/// header) followed by the SHA-256 digests of its tensors' bytes in file order. Any changed
/// byte changes it, and every byte is hashed once (the tensors' digests name a damaged
/// tensor).
fn file_checksum(head: &[u8], part_digests: &[Vec<u8>]) -> String {
    let mut h = Sha256::new();
    h.update(head);
    for d in part_digests {
        h.update(d);
    }
    hex(&h.finalize())
}

/// Writes `blobs` as one safetensors file at `path` (fsynced) and returns each blob's
/// [`Range`], and the file's checksum.
pub fn write_safetensors(path: &Path, blobs: &[Blob]) -> Result<(Vec<Range>, String)> {
    write_safetensors_with(path, blobs, None)
}

/// [`write_safetensors`] with the file's `__metadata__` (Hugging Face's loaders want
/// `{"format": "pt"}`).
pub fn write_safetensors_with(
    path: &Path,
    blobs: &[Blob],
    metadata: Option<serde_json::Value>,
) -> Result<(Vec<Range>, String)> {
    let mut header = serde_json::Map::new();
    if let Some(m) = metadata {
        header.insert("__metadata__".into(), m);
    }
    let mut at = 0u64;
    for (name, shape, data) in blobs {
        let end = at + 4 * data.len() as u64;
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [at, end]}),
        );
        at = end;
    }
    let mut h = serde_json::Value::Object(header).to_string().into_bytes();
    while !(h.len() + 8).is_multiple_of(8) {
        h.push(b' ');
    }
    let head = [&(h.len() as u64).to_le_bytes()[..], &h].concat();
    let mut f = std::io::BufWriter::with_capacity(
        8 << 20,
        std::fs::File::create(path).map_err(|e| Error::io("cannot create", path, e))?,
    );
    let mut put = |b: &[u8]| {
        f.write_all(b)
            .map_err(|e| Error::io("cannot write", path, e))
    };
    put(&head)?;
    // The digests are computed beside the writes, on the other core.
    let digests: Vec<Vec<u8>> = std::thread::scope(|s| {
        let hashing = s.spawn(|| {
            blobs
                .iter()
                .map(|(_, _, d)| Sha256::digest(bytemuck::cast_slice::<f32, u8>(d)).to_vec())
                .collect::<Vec<_>>()
        });
        let written = blobs
            .iter()
            .try_for_each(|(_, _, d)| put(bytemuck::cast_slice(d)));
        let digests = hashing.join().expect("hashing does not panic");
        written.map(|_| digests)
    })?;
    let file = f
        .into_inner()
        .map_err(|e| Error::io("cannot write", path, e.into_error()))?;
    file.sync_all()
        .map_err(|e| Error::io("cannot sync", path, e))?;
    let mut ranges = Vec::with_capacity(blobs.len());
    let mut at = head.len() as u64;
    for ((_, _, data), d) in blobs.iter().zip(&digests) {
        let len = 4 * data.len() as u64;
        ranges.push((at, at + len, hex(d)));
        at += len;
    }
    Ok((ranges, file_checksum(&head, &digests)))
}

/// Reads part `p` of tensor `name` from the checkpoint in `dir`, checking its checksum.
pub fn read_part(dir: &Path, name: &str, p: &Part) -> Result<Tensor> {
    let path = crate::runtime::files::inside(dir, &p.file)?;
    let n = p
        .shape
        .iter()
        .try_fold(1usize, |n, d| n.checked_mul(*d))
        .filter(|n| p.end.checked_sub(p.begin) == n.checked_mul(4).map(|b| b as u64))
        .ok_or_else(|| {
            Error::State(format!(
                "`{}`: tensor `{name}` has bytes {}..{} for shape {:?}",
                path.display(),
                p.begin,
                p.end,
                p.shape
            ))
        })?;
    let mut f = std::fs::File::open(&path).map_err(|e| Error::io("cannot open", &path, e))?;
    // Only what the file holds is allocated.
    let len = f
        .metadata()
        .map_err(|e| Error::io("cannot read", &path, e))?
        .len();
    if p.end > len {
        return Err(Error::State(format!(
            "`{}` is damaged: tensor `{name}` lies at bytes {}..{} of a file of {len}",
            path.display(),
            p.begin,
            p.end
        )));
    }
    let mut v = vec![0f32; n];
    f.seek(SeekFrom::Start(p.begin))
        .and_then(|_| f.read_exact(bytemuck::cast_slice_mut(&mut v)))
        .map_err(|e| Error::io("cannot read", &path, e))?;
    if sha256(bytemuck::cast_slice(&v)) != p.sha256 {
        return Err(Error::State(format!(
            "`{}` is damaged: the bytes of tensor `{name}` do not match their checksum",
            path.display()
        )));
    }
    Ok(Tensor::from_vec(v, p.shape.as_slice(), &Device::Cpu)?)
}

/// The checksum of a safetensors file written by [`write_safetensors`] (see
/// `file_checksum`), recomputed from its bytes.
pub fn file_sha256(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).map_err(|e| Error::io("cannot read", path, e))?;
    let damaged = || {
        Error::State(format!(
            "`{}` is damaged: its header is unreadable",
            path.display()
        ))
    };
    let n = bytes
        .get(..8)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map(u64::from_le_bytes)
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(damaged)?;
    let head = bytes.get(..8usize.saturating_add(n)).ok_or_else(damaged)?;
    let header: serde_json::Value = serde_json::from_slice(&head[8..]).map_err(|_| damaged())?;
    let mut ranges: Vec<(usize, usize)> = header
        .as_object()
        .ok_or_else(damaged)?
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(_, v)| {
            let o = &v["data_offsets"];
            Some((o[0].as_u64()? as usize, o[1].as_u64()? as usize))
        })
        .collect::<Option<_>>()
        .ok_or_else(damaged)?;
    ranges.sort();
    let data = &bytes[8 + n..];
    let digests = ranges
        .iter()
        .map(|&(b, e)| Some(Sha256::digest(data.get(b..e)?).to_vec()))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(damaged)?;
    Ok(file_checksum(head, &digests))
}
