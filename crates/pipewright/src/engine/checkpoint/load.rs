//! Reading a checkpoint into any layout: a rank asks for each tensor it holds by global name
//! and split; the parts it needs are read (checksums checked), assembled across the saved
//! layout's shards when the split differs, and sliced to the rank's own part.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use candle_core::Tensor;

use super::format::{f32_data, read_part, write_safetensors_with, EntryKind, Manifest, Part};
use super::save::TensorPart;
use crate::parallel::tensor_parallel::{assemble, part};
use crate::runtime::digest::sha256;
use crate::{Error, Result};

/// An open checkpoint directory.
#[derive(Clone, Debug)]
pub struct Reader {
    dir: PathBuf,
    manifest: Manifest,
    state: serde_json::Value,
}

impl Reader {
    /// Opens the checkpoint at `path` (a `step-NNNNNNNN` directory, or a directory of them,
    /// whose `latest` is taken) and checks `state.json` against its checksum.
    pub fn open(path: &Path) -> Result<Self> {
        let dir = super::resolve(path)?;
        let manifest = Manifest::read(&dir)?;
        let sp = dir.join("state.json");
        let bytes = std::fs::read(&sp).map_err(|e| Error::io("cannot read", &sp, e))?;
        if manifest.files.get("state.json") != Some(&sha256(&bytes)) {
            return Err(Error::State(format!(
                "`{}` is damaged: it does not match its checksum",
                sp.display()
            )));
        }
        let state = serde_json::from_slice(&bytes)
            .map_err(|e| Error::State(format!("`{}` is unreadable: {e}", sp.display())))?;
        Ok(Self {
            dir,
            manifest,
            state,
        })
    }

    /// The checkpoint's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `manifest.json`.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// `state.json`.
    pub fn state(&self) -> &serde_json::Value {
        &self.state
    }

    /// Checks that the checkpoint holds exactly the parameters of a model with `params`
    /// (every rank's, name and whole shape): the error names each missing, extra or reshaped
    /// tensor.
    pub fn check_model(&self, params: &[(String, Vec<usize>)]) -> Result<()> {
        let mine: BTreeMap<&str, &Vec<usize>> =
            params.iter().map(|(n, s)| (n.as_str(), s)).collect();
        let saved = self.manifest.param_shapes();
        let saved_names: BTreeSet<&str> = saved.iter().map(|(n, _)| n.as_str()).collect();
        let mut problems = Vec::new();
        for (n, s) in &saved {
            match mine.get(n.as_str()) {
                None => problems.push(format!(
                    "`{n}` {s:?} is in the checkpoint but not in the model"
                )),
                Some(m) if *m != s => problems.push(format!(
                    "`{n}` is {s:?} in the checkpoint but {m:?} in the model"
                )),
                Some(_) => {}
            }
        }
        for (n, s) in &mine {
            if !saved_names.contains(n) {
                problems.push(format!(
                    "`{n}` {s:?} is in the model but not in the checkpoint"
                ));
            }
        }
        if problems.is_empty() {
            return Ok(());
        }
        Err(Error::State(format!(
            "`{}` is a checkpoint of another model: {}",
            self.dir.display(),
            problems.join("; ")
        )))
    }

    /// Names of the stored tensors of `kind` whose names start with `prefix.` and go on with no
    /// further dot (a parameter's optimizer state: `<param>.exp_avg`).
    pub fn entries_of(&self, prefix: &str, kind: EntryKind) -> Vec<String> {
        let p = format!("{prefix}.");
        self.manifest
            .tensors
            .iter()
            .filter(|(n, e)| {
                e.kind == kind && n.strip_prefix(&p).is_some_and(|rest| !rest.contains('.'))
            })
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// Tensor `name`, the part `split` of it (f32, on the CPU).
    pub fn read(&self, name: &str, split: TensorPart) -> Result<Tensor> {
        let e = self.manifest.tensors.get(name).ok_or_else(|| {
            Error::State(format!("`{}` holds no tensor `{name}`", self.dir.display()))
        })?;
        let same = |p: &Part| {
            (p.axis, p.stride, p.index, p.count)
                == (split.axis, split.stride, split.index, split.count)
        };
        if let Some(p) = e.parts.iter().find(|p| same(p)) {
            return read_part(&self.dir, name, p);
        }
        let whole = self.read_whole(name)?;
        if split.count == 1 {
            return Ok(whole);
        }
        Ok(part(&whole, split.axis, split.stride, split.index, split.count)?.contiguous()?)
    }

    /// Tensor `name`, whole.
    pub fn read_whole(&self, name: &str) -> Result<Tensor> {
        let e = self.manifest.tensors.get(name).ok_or_else(|| {
            Error::State(format!("`{}` holds no tensor `{name}`", self.dir.display()))
        })?;
        let first = e
            .parts
            .first()
            .ok_or_else(|| Error::State(format!("tensor `{name}` has no stored part")))?;
        if first.count == 1 {
            return read_part(&self.dir, name, first);
        }
        let indices: Vec<usize> = e.parts.iter().map(|p| p.index).collect();
        if indices != (0..first.count).collect::<Vec<_>>() {
            return Err(Error::State(format!(
                "`{}`: tensor `{name}` has parts {indices:?} of {}: some are missing",
                self.dir.display(),
                first.count
            )));
        }
        let parts = e
            .parts
            .iter()
            .map(|p| read_part(&self.dir, name, p))
            .collect::<Result<Vec<_>>>()?;
        let t = assemble(&parts, first.axis, first.stride)?;
        if t.dims() != e.shape.as_slice() {
            return Err(Error::State(format!(
                "`{}`: the parts of `{name}` make {:?}, not {:?}",
                self.dir.display(),
                t.dims(),
                e.shape
            )));
        }
        Ok(t)
    }
    /// Writes every parameter, whole and in f32, into one safetensors file at `out` (through a
    /// temporary file renamed into place: a reader never sees half a file). `rename` maps each
    /// global name and tensor to the name and tensor to write, or to `None` to leave it out
    /// (an export to another library's names); `metadata` becomes the file's `__metadata__`.
    /// Returns how many tensors were written.
    pub fn export_params(
        &self,
        out: &Path,
        rename: impl Fn(&str, Tensor) -> Result<Option<(String, Tensor)>>,
        metadata: Option<serde_json::Value>,
    ) -> Result<usize> {
        let mut owned = Vec::new();
        for (n, e) in &self.manifest.tensors {
            if e.kind != EntryKind::Param {
                continue;
            }
            if let Some((name, t)) = rename(n, self.read_whole(n)?)? {
                owned.push((name, t.dims().to_vec(), f32_data(&t)?));
            }
        }
        let blobs: Vec<_> = owned
            .iter()
            .map(|(n, s, d)| (n.as_str(), s.as_slice(), d.as_slice()))
            .collect();
        let tmp = out.with_extension("tmp");
        write_safetensors_with(&tmp, &blobs, metadata)?;
        std::fs::rename(&tmp, out).map_err(|e| Error::io("cannot rename into", out, e))?;
        Ok(blobs.len())
    }
}
