//! Typed flag values recorded as the text they are given in (`"f32"`, `"1f1b"`, `"0"`,
//! `"3,2"`): `#[serde(with = "as_text")]` writes a value by its `Display` and reads it back by
//! its `FromStr`, so `params.json` holds what the command line takes, reads as it did when
//! these flags were strings, and `TrainArgs::argv` gives the flags back as typed.

use std::fmt::Display;
use std::str::FromStr;

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serializer};

/// Writes `v` as its text.
pub fn serialize<T: Display, S: Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

/// Reads a value from its text.
pub fn deserialize<'de, T, D>(d: D) -> Result<T, D::Error>
where
    T: FromStr,
    T::Err: Display,
    D: Deserializer<'de>,
{
    String::deserialize(d)?.parse().map_err(D::Error::custom)
}

/// The same for an optional value (`null` when absent).
pub mod option {
    use super::*;

    /// Writes `v` as its text, or `null`.
    pub fn serialize<T: Display, S: Serializer>(v: &Option<T>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(v) => s.collect_str(v),
            None => s.serialize_none(),
        }
    }

    /// Reads a value from its text, or `None` from `null`.
    pub fn deserialize<'de, T, D>(d: D) -> Result<Option<T>, D::Error>
    where
        T: FromStr,
        T::Err: Display,
        D: Deserializer<'de>,
    {
        Option::<String>::deserialize(d)?
            .map(|t| t.parse().map_err(D::Error::custom))
            .transpose()
    }
}

/// The schedule's text; a run recorded with a schedule file before the file had a field of
/// its own wrote `file PATH` here, which reads as the default 1F1B (the file it names is in
/// `schedule_file`).
pub mod schedule {
    use super::*;
    use pipewright::parallel::pipeline::schedule::ScheduleKind;

    pub use super::serialize;

    /// Reads a schedule's name; `file PATH` as the default.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<ScheduleKind, D::Error> {
        let text = String::deserialize(d)?;
        if text.starts_with("file ") {
            return Ok(ScheduleKind::OneFOneB);
        }
        text.parse().map_err(D::Error::custom)
    }
}
