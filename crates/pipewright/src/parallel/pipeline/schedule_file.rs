//! A schedule as text and as a file: PyTorch's CSV form (one line per rank, its actions
//! separated by commas, each as `1F3`), written by `pipewright schedule --save`, edited by
//! hand, read by `--schedule-file` and recorded in a run's spec (serialized as that text).

use std::path::Path;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::schedule::{Action, Schedule};
use crate::{invalid, Result};

impl Schedule {
    /// The printed form: one line per rank, its actions separated by commas (PyTorch's CSV).
    pub fn to_csv(&self) -> String {
        self.actions
            .iter()
            .map(|l| {
                l.iter()
                    .map(Action::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .map(|l| l + "\n")
            .collect()
    }

    /// Parses [`Schedule::to_csv`]'s form (blank lines and `#` comments skipped; a rank with no
    /// action is an empty line only at the end of a file, so write every rank's list). PyTorch's
    /// dumps read too: its overlapped pair `(0F3;1B0)OVERLAP_F_B` as its two actions in
    /// order, its communication and sharding actions (`0SEND_F1`, `1RECV_B0`, `0UNSHARD`,
    /// `0RESHARD`, `0REDUCE_GRAD`) left out, as pipewright derives them from the compute.
    pub fn from_csv(text: &str) -> Result<Self> {
        let actions = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .enumerate()
            .map(|(r, line)| {
                let mut list = Vec::new();
                for t in line.split(',').map(str::trim).filter(|t| !t.is_empty()) {
                    parse_token(t, &mut list)
                        .map_err(|e| invalid!("rank {r} of the schedule: {e}"))?;
                }
                Ok(list)
            })
            .collect::<Result<Vec<_>>>()?;
        Self::from_actions(actions)
    }

    /// Writes [`Schedule::to_csv`] to `path` (whole, or not at all: a temporary file renamed).
    pub fn save(&self, path: &Path) -> Result<()> {
        crate::runtime::files::write_atomic(path, self.to_csv().as_bytes())
    }

    /// Reads a schedule written by [`Schedule::save`] (or by hand, or by PyTorch's
    /// `_dump_csv`) from `path`.
    pub fn load(path: &Path) -> Result<Self> {
        // A schedule of a thousand ranks and micro-batches is a few megabytes: a larger file
        // is not a schedule, and read whole it could take the process's memory.
        const MAX_BYTES: u64 = 64 << 20;
        let len = std::fs::metadata(path)
            .map_err(|e| invalid!("cannot read the schedule {}: {e}", path.display()))?
            .len();
        if len > MAX_BYTES {
            return Err(invalid!(
                "{} is {len} bytes: a schedule file is one line of actions per rank (a few \
                 megabytes at most); give the file `pipewright schedule --save` writes",
                path.display()
            ));
        }
        let text = std::fs::read_to_string(path)
            .map_err(|e| invalid!("cannot read the schedule {}: {e}", path.display()))?;
        Self::from_csv(&text).map_err(|e| invalid!("{}: {e}", path.display()))
    }
}

/// What PyTorch's schedules write besides compute: its communication and sharding actions.
const DERIVED: [&str; 7] = [
    "SEND_F",
    "RECV_F",
    "SEND_B",
    "RECV_B",
    "UNSHARD",
    "RESHARD",
    "REDUCE_GRAD",
];

/// Appends the actions `t` stands for to `list`: one action, an overlapped pair's two, or
/// none for a communication or sharding action.
fn parse_token(t: &str, list: &mut Vec<Action>) -> Result<()> {
    if let Some(inner) = t
        .strip_prefix('(')
        .and_then(|rest| rest.strip_suffix(")OVERLAP_F_B"))
    {
        for sub in inner.split(';').map(str::trim).filter(|s| !s.is_empty()) {
            list.push(sub.parse()?);
        }
        return Ok(());
    }
    let kind = t.trim_start_matches(|c: char| c.is_ascii_digit());
    if DERIVED.iter().any(|d| kind.starts_with(d)) {
        return Ok(());
    }
    list.push(t.parse()?);
    Ok(())
}

impl Serialize for Schedule {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_csv())
    }
}

impl<'de> Deserialize<'de> for Schedule {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        Schedule::from_csv(&text).map_err(serde::de::Error::custom)
    }
}
