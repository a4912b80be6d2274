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

use crate::topology::Layout;
use crate::{Error, Result};

/// The version of the format this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// What a tensor of a checkpoint is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// A trained parameter (its f32 master).
    Param,
    /// Optimizer state of a parameter (`<name>.exp_avg`, `<name>.momentum_buffer`, ...),
    /// split as the parameter is.
    Optimizer,
    /// Non-trained model state (BatchNorm running statistics).
    Buffer,
}

/// One stored part of a tensor: the bytes `begin..end` of `file` hold part `index` of `count`
/// along `axis` (in `stride` blocks, see [`crate::shard::part`]); a whole tensor is part 0 of 1.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Part {
    pub file: String,
    pub begin: u64,
    pub end: u64,
    pub shape: Vec<usize>,
    pub axis: usize,
    pub stride: usize,
    pub index: usize,
    pub count: usize,
    /// SHA-256 of the part's bytes.
    pub sha256: String,
}

/// One tensor of the model's state, layout-free: its global name's whole shape and its parts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    pub kind: Kind,
    pub shape: Vec<usize>,
    pub dtype: String,
    pub parts: Vec<Part>,
}

/// `manifest.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format_version: u32,
    /// SHA-256 over the model's parameter names and whole shapes (see [`fingerprint`]).
    pub fingerprint: String,
    pub layout: Layout,
    pub precision: String,
    pub world: usize,
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
        Ok(m)
    }

    /// The parameters' (name, whole shape), sorted by name.
    pub fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        self.tensors
            .iter()
            .filter(|(_, e)| e.kind == Kind::Param)
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

/// Lower-case hexadecimal.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of `bytes`, in hex.
pub fn sha256(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// A tensor's elements as little-endian f32 bytes.
pub fn f32_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let v: Vec<f32> = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    Ok(v.iter().flat_map(|x| x.to_le_bytes()).collect())
}

/// A tensor to write: (name, shape, f32 bytes).
pub type Blob = (String, Vec<usize>, Vec<u8>);

/// Where a blob landed: its absolute byte range in the file and its SHA-256.
pub type Range = (u64, u64, String);

/// Writes `blobs` as one safetensors file at `path` (fsynced) and returns each blob's
/// [`Range`], and the whole file's SHA-256.
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
    for (name, shape, bytes) in blobs {
        let end = at + bytes.len() as u64;
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [at, end]}),
        );
        at = end;
    }
    let mut h = serde_json::Value::Object(header).to_string().into_bytes();
    while !(h.len() + 8).is_multiple_of(8) {
        h.push(b' ');
    }
    let start = 8 + h.len() as u64;
    let mut file_hash = Sha256::new();
    let mut f = std::fs::File::create(path).map_err(|e| Error::io("cannot create", path, e))?;
    let mut put = |b: &[u8]| -> Result<()> {
        file_hash.update(b);
        f.write_all(b)
            .map_err(|e| Error::io("cannot write", path, e))
    };
    put(&(h.len() as u64).to_le_bytes())?;
    put(&h)?;
    let mut ranges = Vec::with_capacity(blobs.len());
    let mut at = start;
    for (_, _, bytes) in blobs {
        put(bytes)?;
        ranges.push((at, at + bytes.len() as u64, sha256(bytes)));
        at += bytes.len() as u64;
    }
    f.sync_all()
        .map_err(|e| Error::io("cannot sync", path, e))?;
    Ok((ranges, hex(&file_hash.finalize())))
}

/// Reads part `p` of tensor `name` from the checkpoint in `dir`, checking its checksum.
pub fn read_part(dir: &Path, name: &str, p: &Part) -> Result<Tensor> {
    let path = dir.join(&p.file);
    let mut f = std::fs::File::open(&path).map_err(|e| Error::io("cannot open", &path, e))?;
    let mut bytes = vec![0u8; (p.end - p.begin) as usize];
    f.seek(SeekFrom::Start(p.begin))
        .and_then(|_| f.read_exact(&mut bytes))
        .map_err(|e| Error::io("cannot read", &path, e))?;
    if sha256(&bytes) != p.sha256 {
        return Err(Error::State(format!(
            "`{}` is damaged: the bytes of tensor `{name}` do not match their checksum",
            path.display()
        )));
    }
    let n: usize = p.shape.iter().product();
    if bytes.len() != 4 * n {
        return Err(Error::State(format!(
            "`{}`: tensor `{name}` has {} bytes for shape {:?}",
            path.display(),
            bytes.len(),
            p.shape
        )));
    }
    let v: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok(Tensor::from_vec(v, p.shape.as_slice(), &Device::Cpu)?)
}

/// SHA-256 of a whole file, in hex.
pub fn file_sha256(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).map_err(|e| Error::io("cannot open", path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .map_err(|e| Error::io("cannot read", path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}
