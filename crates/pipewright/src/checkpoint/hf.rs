//! Pretrained weights as Hugging Face saves them: a directory with `model.safetensors`, or
//! shards listed by `model.safetensors.index.json`. The files are memory-mapped and each rank
//! copies out only its own part of each tensor ([`HfWeights::read`] with its [`Split`]), so no
//! rank ever holds the whole model. Every header is checked against its file before a byte is
//! read: a name outside the directory, an offset past the end or a shape that does not match
//! its bytes is an error naming the file.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use half::{bf16, f16};
use memmap2::Mmap;

use super::save::Split;
use crate::shard::part_len;
use crate::{Error, Result};

/// The index of a sharded checkpoint.
pub const INDEX: &str = "model.safetensors.index.json";

/// Where one tensor lies.
#[derive(Clone, Debug)]
struct Entry {
    file: usize,
    dtype: String,
    shape: Vec<usize>,
    /// Byte range in the file.
    begin: usize,
    end: usize,
}

/// A Hugging Face model directory's tensors, mapped.
pub struct HfWeights {
    dir: PathBuf,
    maps: Vec<Mmap>,
    files: Vec<PathBuf>,
    tensors: HashMap<String, Entry>,
}

fn damaged(path: &Path, why: String) -> Error {
    Error::State(format!(
        "`{}` is not a safetensors file pipewright can read: {why}",
        path.display()
    ))
}

fn dtype_bytes(dtype: &str) -> Option<usize> {
    match dtype {
        "F32" => Some(4),
        "F16" | "BF16" => Some(2),
        _ => None,
    }
}

impl HfWeights {
    /// Opens the model directory `dir` (`model.safetensors`, or the shards its index names).
    pub fn open(dir: &Path) -> Result<Self> {
        let index = dir.join(INDEX);
        let names: Vec<String> = if index.exists() {
            let text =
                std::fs::read_to_string(&index).map_err(|e| Error::io("cannot read", &index, e))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| damaged(&index, format!("not JSON ({e})")))?;
            let map = v["weight_map"]
                .as_object()
                .ok_or_else(|| damaged(&index, "no weight_map".into()))?;
            let mut files: Vec<String> = map
                .values()
                .filter_map(|f| f.as_str().map(String::from))
                .collect();
            files.sort();
            files.dedup();
            files
        } else {
            vec!["model.safetensors".into()]
        };
        let mut w = Self {
            dir: dir.to_path_buf(),
            maps: Vec::new(),
            files: Vec::new(),
            tensors: HashMap::new(),
        };
        for name in names {
            let path = crate::files::inside(dir, &name)?;
            let file = std::fs::File::open(&path).map_err(|e| {
                Error::io("not a Hugging Face model directory (config.json and model.safetensors): cannot open", &path, e)
            })?;
            // SAFETY: the map is only read; a file changed while mapped reads changed bytes,
            // never memory outside the map.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io("cannot map", &path, e))?;
            let i = w.maps.len();
            for (n, e) in header(&path, &map)? {
                w.tensors.insert(n, Entry { file: i, ..e });
            }
            w.maps.push(map);
            w.files.push(path);
        }
        Ok(w)
    }

    /// Whether it holds `name`.
    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The whole shape of `name`.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.tensors.get(name).map(|e| e.shape.as_slice())
    }

    /// Every tensor's name and shape.
    pub fn shapes(&self) -> BTreeMap<String, Vec<usize>> {
        self.tensors
            .iter()
            .map(|(n, e)| (n.clone(), e.shape.clone()))
            .collect()
    }

    /// Part `split` of tensor `name` in f32, copied out of the map: only that part's bytes are
    /// read.
    pub fn read(&self, name: &str, split: Split) -> Result<Tensor> {
        let e = self.tensors.get(name).ok_or_else(|| {
            Error::State(format!("`{}` holds no tensor `{name}`", self.dir.display()))
        })?;
        let (shape, axis) = (&e.shape, split.axis);
        if axis >= shape.len().max(1) {
            return Err(Error::State(format!(
                "`{name}` of shape {shape:?} has no axis {axis}"
            )));
        }
        let n = shape.get(axis).copied().unwrap_or(1);
        let m = part_len(n, split.stride, split.count)?;
        let block = n / split.stride;
        let ranges: Vec<(usize, usize)> = (0..split.stride)
            .map(|s| {
                (
                    s * block + split.index * m,
                    s * block + (split.index + 1) * m,
                )
            })
            .collect();
        let outer: usize = shape[..axis.min(shape.len())].iter().product();
        let inner: usize = shape.get(axis + 1..).map_or(1, |s| s.iter().product());
        let es = dtype_bytes(&e.dtype).unwrap_or(4);
        let bytes = &self.maps[e.file][e.begin..e.end];
        let mut out = Vec::with_capacity(outer * m * split.stride * inner);
        for o in 0..outer {
            for &(a, b) in &ranges {
                let from = (o * n + a) * inner * es;
                let to = (o * n + b) * inner * es;
                let chunk = &bytes[from..to];
                match e.dtype.as_str() {
                    "F32" => out.extend(
                        chunk
                            .chunks_exact(4)
                            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                    ),
                    "F16" => out.extend(
                        chunk
                            .chunks_exact(2)
                            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()),
                    ),
                    _ => out.extend(
                        chunk
                            .chunks_exact(2)
                            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()),
                    ),
                }
            }
        }
        let mut dims = shape.clone();
        if !dims.is_empty() {
            dims[axis] = m * split.stride;
        }
        Ok(Tensor::from_vec(out, dims, &Device::Cpu)?)
    }
}

/// The tensors a safetensors file's header describes, each checked against the file.
fn header(path: &Path, map: &[u8]) -> Result<Vec<(String, Entry)>> {
    let n = map
        .get(..8)
        .map(|b| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
        .and_then(|n| usize::try_from(n).ok())
        .filter(|n| n.checked_add(8).is_some_and(|e| e <= map.len()))
        .ok_or_else(|| damaged(path, "its header length runs past the end".into()))?;
    let h: serde_json::Value = serde_json::from_slice(&map[8..8 + n])
        .map_err(|e| damaged(path, format!("its header is not JSON ({e})")))?;
    let h = h
        .as_object()
        .ok_or_else(|| damaged(path, "its header is not an object".into()))?;
    let data = map.len() - 8 - n;
    let mut out = Vec::new();
    for (name, v) in h.iter().filter(|(k, _)| *k != "__metadata__") {
        let dtype = v["dtype"].as_str().unwrap_or("").to_string();
        let es = dtype_bytes(&dtype).ok_or_else(|| {
            damaged(
                path,
                format!("`{name}` is {dtype}: F32, F16 and BF16 are read"),
            )
        })?;
        let shape: Vec<usize> = v["shape"]
            .as_array()
            .and_then(|a| {
                a.iter()
                    .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
                    .collect()
            })
            .ok_or_else(|| damaged(path, format!("`{name}` has no shape")))?;
        let off = &v["data_offsets"];
        let (a, b) = (off[0].as_u64(), off[1].as_u64());
        let size = shape.iter().try_fold(es, |s, d| s.checked_mul(*d));
        let ok = match (a, b, size) {
            (Some(a), Some(b), Some(size)) => {
                b >= a && b as usize <= data && (b - a) as usize == size
            }
            _ => false,
        };
        if !ok {
            return Err(damaged(
                path,
                format!("`{name}`'s bytes {a:?}..{b:?} do not hold {shape:?} {dtype}"),
            ));
        }
        let (a, b) = (a.unwrap_or(0) as usize, b.unwrap_or(0) as usize);
        out.push((
            name.clone(),
            Entry {
                file: 0,
                dtype,
                shape,
                begin: 8 + n + a,
                end: 8 + n + b,
            },
        ));
    }
    Ok(out)
}
