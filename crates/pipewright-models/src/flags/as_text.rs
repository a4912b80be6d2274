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
