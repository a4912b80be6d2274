//! TensorBoard event files, written without TensorFlow.
//!
//! A file is a sequence of records: `u64` length (little endian), `u32` masked CRC32C of the
//! length bytes, the payload, `u32` masked CRC32C of the payload. Each payload is a serialized
//! `tensorflow.Event` protobuf; the first carries `file_version = "brain.Event:2"`, the others a
//! `Summary` with one `simple_value` per scalar.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// CRC32C (Castagnoli), bitwise table.
pub fn crc32c(data: &[u8]) -> u32 {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut t = [0u32; 256];
        for (i, e) in t.iter_mut().enumerate() {
            let mut c = i as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    0x82f6_3b78 ^ (c >> 1)
                } else {
                    c >> 1
                };
            }
            *e = c;
        }
        t
    });
    let mut crc = !0u32;
    for &b in data {
        crc = table[((crc ^ b as u32) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

/// TensorFlow's masked CRC.
pub fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c(data);
    (c.rotate_right(15)).wrapping_add(0xa282_ead8)
}

fn varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn key(field: u32, wire: u8, out: &mut Vec<u8>) {
    varint(((field as u64) << 3) | wire as u64, out);
}

fn bytes_field(field: u32, data: &[u8], out: &mut Vec<u8>) {
    key(field, 2, out);
    varint(data.len() as u64, out);
    out.extend_from_slice(data);
}

/// Serialized `Event { wall_time, step, file_version }`.
pub fn file_version_event(wall_time: f64) -> Vec<u8> {
    let mut e = Vec::new();
    key(1, 1, &mut e);
    e.extend_from_slice(&wall_time.to_le_bytes());
    bytes_field(3, b"brain.Event:2", &mut e);
    e
}

/// Serialized `Event { wall_time, step, summary { value { tag, simple_value } ... } }`.
pub fn scalars_event(wall_time: f64, step: i64, scalars: &[(&str, f32)]) -> Vec<u8> {
    let values: Vec<Vec<u8>> = scalars
        .iter()
        .map(|(tag, v)| {
            let mut value = Vec::new();
            bytes_field(1, tag.as_bytes(), &mut value);
            key(2, 5, &mut value);
            value.extend_from_slice(&v.to_le_bytes());
            value
        })
        .collect();
    summary_event(wall_time, step, &values)
}

/// Serialized `Event { wall_time, step, summary { value ... } }` around serialized
/// `Summary.Value`s.
fn summary_event(wall_time: f64, step: i64, values: &[Vec<u8>]) -> Vec<u8> {
    let mut summary = Vec::new();
    for value in values {
        bytes_field(1, value, &mut summary);
    }
    let mut e = Vec::new();
    key(1, 1, &mut e);
    e.extend_from_slice(&wall_time.to_le_bytes());
    key(2, 0, &mut e);
    varint(step as u64, &mut e);
    bytes_field(5, &summary, &mut e);
    e
}

/// An image summary: `Summary.Value { tag, image { height, width, colorspace 3 (RGB),
/// encoded_image_string } }` around a PNG.
pub fn image_event(
    wall_time: f64,
    step: i64,
    tag: &str,
    (width, height): (u32, u32),
    png: &[u8],
) -> Vec<u8> {
    let mut image = Vec::new();
    key(1, 0, &mut image);
    varint(u64::from(height), &mut image);
    key(2, 0, &mut image);
    varint(u64::from(width), &mut image);
    key(3, 0, &mut image);
    varint(3, &mut image);
    bytes_field(4, png, &mut image);
    let mut value = Vec::new();
    bytes_field(1, tag.as_bytes(), &mut value);
    bytes_field(4, &image, &mut value);
    summary_event(wall_time, step, &[value])
}

/// A hyperparameter value for [`hparams_event`].
#[derive(Clone, Debug, PartialEq)]
pub enum HParam {
    /// A number.
    Number(f64),
    /// A string.
    Text(String),
    /// A flag.
    Bool(bool),
}

/// The hparams plugin's session start (TensorBoard's `hparams` summary): `Summary.Value { tag
/// "_hparams_/session_start_info", metadata { plugin_data { plugin_name "hparams", content:
/// HParamsPluginData { version 0, session_start_info { hparams, start_time_secs } } } } }`.
pub fn hparams_event(wall_time: f64, hparams: &[(String, HParam)]) -> Vec<u8> {
    let mut start = Vec::new();
    for (name, v) in hparams {
        // google.protobuf.Value: number_value 2, string_value 3, bool_value 4.
        let mut value = Vec::new();
        match v {
            HParam::Number(x) => {
                key(2, 1, &mut value);
                value.extend_from_slice(&x.to_le_bytes());
            }
            HParam::Text(t) => bytes_field(3, t.as_bytes(), &mut value),
            HParam::Bool(b) => {
                key(4, 0, &mut value);
                varint(u64::from(*b), &mut value);
            }
        }
        let mut entry = Vec::new();
        bytes_field(1, name.as_bytes(), &mut entry);
        bytes_field(2, &value, &mut entry);
        bytes_field(1, &entry, &mut start);
    }
    key(5, 1, &mut start);
    start.extend_from_slice(&wall_time.to_le_bytes());
    let mut data = Vec::new();
    key(1, 0, &mut data);
    varint(0, &mut data);
    bytes_field(3, &start, &mut data);
    let mut plugin = Vec::new();
    bytes_field(1, b"hparams", &mut plugin);
    bytes_field(2, &data, &mut plugin);
    let mut metadata = Vec::new();
    bytes_field(1, &plugin, &mut metadata);
    let mut value = Vec::new();
    bytes_field(1, b"_hparams_/session_start_info", &mut value);
    bytes_field(9, &metadata, &mut value);
    summary_event(wall_time, 0, &[value])
}

/// Frames a payload as one record.
pub fn record(payload: &[u8]) -> Vec<u8> {
    let len = (payload.len() as u64).to_le_bytes();
    let mut r = Vec::with_capacity(payload.len() + 16);
    r.extend_from_slice(&len);
    r.extend_from_slice(&masked_crc(&len).to_le_bytes());
    r.extend_from_slice(payload);
    r.extend_from_slice(&masked_crc(payload).to_le_bytes());
    r
}

/// Splits a file's bytes back into payloads, checking every CRC (used by tests and tools).
pub fn read_records(bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
    let mut out = Vec::new();
    let mut i = 0;
    let bad = |m: &str| Error::Invalid(format!("corrupt event file: {m}"));
    while i < bytes.len() {
        let len_bytes = bytes.get(i..i + 8).ok_or_else(|| bad("truncated length"))?;
        let crc = bytes
            .get(i + 8..i + 12)
            .ok_or_else(|| bad("truncated crc"))?;
        if masked_crc(len_bytes).to_le_bytes() != crc {
            return Err(bad("length crc mismatch"));
        }
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
        let data = bytes
            .get(i + 12..i + 12 + len)
            .ok_or_else(|| bad("truncated payload"))?;
        let dcrc = bytes
            .get(i + 12 + len..i + 16 + len)
            .ok_or_else(|| bad("truncated payload crc"))?;
        if masked_crc(data).to_le_bytes() != dcrc {
            return Err(bad("payload crc mismatch"));
        }
        out.push(data.to_vec());
        i += 16 + len;
    }
    Ok(out)
}

/// Appends events to `events.out.tfevents.<time>.<host>`, a whole record per `write`, so a
/// killed run leaves whole records.
pub struct EventWriter {
    path: PathBuf,
    out: File,
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl EventWriter {
    /// A new event file in `dir`, named as TensorBoard expects
    /// (`events.out.tfevents.<time>.<host>`).
    pub fn create(dir: &Path) -> Result<Self> {
        let host = crate::runtime::hostname();
        let mut path = dir.join(format!("events.out.tfevents.{}.{host}", now() as u64));
        // A resumed run within the same second keeps the earlier file.
        let mut n = 1;
        while path.exists() {
            path = dir.join(format!("events.out.tfevents.{}.{host}.{n}", now() as u64));
            n += 1;
        }
        let file = File::create(&path).map_err(|e| Error::io("cannot create", &path, e))?;
        let mut w = Self { path, out: file };
        w.write(&file_version_event(now()))?;
        Ok(w)
    }

    /// The event file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write(&mut self, payload: &[u8]) -> Result<()> {
        self.out
            .write_all(&record(payload))
            .map_err(|e| Error::io("cannot write", &self.path, e))
    }

    /// Writes `scalars` (tag, value) at `step`.
    pub fn scalars(&mut self, step: u64, scalars: &[(&str, f32)]) -> Result<()> {
        self.write(&scalars_event(now(), step as i64, scalars))
    }

    /// An image summary of a PNG of `size` (width, height) at `step`.
    pub fn image(&mut self, step: u64, tag: &str, size: (u32, u32), png: &[u8]) -> Result<()> {
        self.write(&image_event(now(), step as i64, tag, size, png))
    }

    /// The run's hyperparameters (TensorBoard's hparams dashboard).
    pub fn hparams(&mut self, hparams: &[(String, HParam)]) -> Result<()> {
        self.write(&hparams_event(now(), hparams))
    }

    /// Flushes the file (every record is written already).
    pub fn flush(&mut self) -> Result<()> {
        self.out
            .flush()
            .map_err(|e| Error::io("cannot write", &self.path, e))
    }
}
