//! A corpus from the paths a user names: files as given, directories walked in sorted order
//! (the same order on every machine), a folder of token shards refused.

use std::path::{Path, PathBuf};

use super::documents::Corpus;
use super::shards::INDEX_FILE;
use crate::{invalid, Error, Result};

impl Corpus {
    /// The files `paths` name, directories walked (sorted, so the order is the same on every
    /// machine), their documents' text in `field`. A directory of token shards is refused (its
    /// files are ids, not text), as is a list that names no file.
    pub fn walk(paths: &[PathBuf], field: &str) -> Result<Corpus> {
        fn walk(p: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
            let meta =
                std::fs::metadata(p).map_err(|e| Error::io("cannot read corpus path", p, e))?;
            let index = INDEX_FILE;
            if meta.is_dir() && p.join(index).exists() {
                return Err(invalid!(
                    "`{}` holds token shards (its {index}): they are ids, not text; name the \
                     text files the corpus is made of",
                    p.display()
                ));
            }
            if !meta.is_dir() {
                out.push(p.to_path_buf());
                return Ok(());
            }
            let mut entries: Vec<PathBuf> = std::fs::read_dir(p)
                .map_err(|e| Error::io("cannot list", p, e))?
                .flatten()
                .map(|e| e.path())
                .collect();
            entries.sort();
            for e in entries {
                walk(&e, out)?;
            }
            Ok(())
        }
        let mut files = Vec::new();
        for p in paths {
            walk(p, &mut files)?;
        }
        if files.is_empty() {
            return Err(invalid!("the corpus paths hold no files"));
        }
        Ok(Corpus {
            files,
            text_field: field.to_string(),
        })
    }
}
