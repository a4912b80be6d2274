//! Pretrained weights as Hugging Face saves them: a directory with `model.safetensors`, or
//! shards listed by `model.safetensors.index.json`. The files are memory-mapped and each rank
//! copies out only its own part of each tensor ([`HfWeights::read`] with its [`TensorPart`]), so no
//! rank ever holds the whole model. Every header is checked against its file before a byte is
//! read: a name outside the directory, an offset past the end or a shape that does not match
//! its bytes is an error naming the file.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use half::{bf16, f16};
use memmap2::Mmap;

use super::save::TensorPart;
use crate::parallel::tensor_parallel::part_len;
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
            let path = crate::runtime::files::inside(dir, &name)?;
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
    pub fn read(&self, name: &str, split: TensorPart) -> Result<Tensor> {
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
    // A key given twice: JSON keeps the last, and which bytes the other named is lost.
    if let Ok(Keys(keys)) = serde_json::from_slice::<Keys>(&map[8..8 + n]) {
        let mut seen = std::collections::HashSet::new();
        if let Some(twice) = keys.iter().find(|k| !seen.insert(k.as_str())) {
            return Err(damaged(path, format!("its header names `{twice}` twice")));
        }
    }
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
        let fault = match (a, b, size) {
            (Some(_), Some(b), _) if b as usize > data => Some(format!(
                "`{name}`'s bytes end at {b}, past the {data} bytes of data the file holds \
                 (truncated, or its header damaged)"
            )),
            (Some(a), Some(b), _) if b < a => Some(format!(
                "`{name}`'s bytes end at {b}, before they start at {a}"
            )),
            (Some(a), Some(b), Some(size)) if (b - a) as usize != size => Some(format!(
                "`{name}` has {} bytes, where {shape:?} {dtype} needs {size}",
                b - a
            )),
            (Some(_), Some(_), Some(_)) => None,
            (_, _, None) => Some(format!("`{name}`'s shape {shape:?} is too large")),
            _ => Some(format!("`{name}` has no data_offsets [begin, end]")),
        };
        if let Some(why) = fault {
            return Err(damaged(path, why));
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
    // Two tensors may not share bytes: one written over the other reads back as both.
    let mut spans: Vec<(usize, usize, &str)> = out
        .iter()
        .map(|(n, e)| (e.begin, e.end, n.as_str()))
        .collect();
    spans.sort_unstable();
    if let Some(w) = spans.windows(2).find(|w| w[1].0 < w[0].1) {
        return Err(damaged(
            path,
            format!("the bytes of `{}` and `{}` overlap", w[0].2, w[1].2),
        ));
    }
    Ok(out)
}

/// The keys of a JSON object in the order written, duplicates kept.
struct Keys(Vec<String>);

impl<'de> serde::Deserialize<'de> for Keys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Keys;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut m: A,
            ) -> std::result::Result<Keys, A::Error> {
                let mut keys = Vec::new();
                while let Some(k) = m.next_key::<String>()? {
                    m.next_value::<serde::de::IgnoredAny>()?;
                    keys.push(k);
                }
                Ok(Keys(keys))
            }
        }
        d.deserialize_map(Visit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A safetensors file of `header` and 32 bytes of data.
    fn file(header: &str) -> Vec<u8> {
        let mut b = (header.len() as u64).to_le_bytes().to_vec();
        b.extend(header.as_bytes());
        b.extend([0u8; 32]);
        b
    }

    fn why(header_json: &str) -> String {
        header(Path::new("t.safetensors"), &file(header_json))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    }

    #[test]
    fn damaged_headers_are_named_for_what_is_wrong() {
        let ok = r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[4],"data_offsets":[16,32]}}"#;
        assert_eq!(why(ok), "");
        let overlap = ok.replace("[16,32]", "[8,24]");
        assert!(why(&overlap).contains("the bytes of `a` and `b` overlap"));
        let twice = r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"a":{"dtype":"F32","shape":[4],"data_offsets":[16,32]}}"#;
        assert!(why(twice).contains("names `a` twice"));
        let past = ok.replace("[16,32]", "[32,48]");
        assert!(
            why(&past).contains("past the 32 bytes of data"),
            "{}",
            why(&past)
        );
        let short = ok.replace("[16,32]", "[16,28]");
        assert!(why(&short).contains("has 12 bytes, where [4] F32 needs 16"));
    }
}
