//! Sizes in bytes as people write them (`4GiB`, `512MiB`, `1.5GB`) and print them (`1.5 GiB`).

use crate::{invalid, Result};

const UNITS: [(&str, u64); 9] = [
    ("TiB", 1 << 40),
    ("GiB", 1 << 30),
    ("MiB", 1 << 20),
    ("KiB", 1 << 10),
    ("TB", 1_000_000_000_000),
    ("GB", 1_000_000_000),
    ("MB", 1_000_000),
    ("KB", 1_000),
    ("B", 1),
];

/// Bytes from a size with a unit: `4GiB`, `512MiB`, `1.5GB`, `1000` (bytes).
pub fn parse_bytes(s: &str) -> Result<u64> {
    let t = s.trim();
    let (num, mult) = UNITS
        .iter()
        .find_map(|(u, m)| t.strip_suffix(u).map(|n| (n.trim(), *m)))
        .unwrap_or((t, 1));
    match num.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok((v * mult as f64).round() as u64),
        _ => Err(invalid!(
            "`{s}` is not a size: write a positive number with a unit, like 4GiB or 512MiB"
        )),
    }
}

/// `bytes` in the largest binary unit that keeps it at 1 or more (`1.5 GiB`).
pub fn format_bytes(bytes: f64) -> String {
    for (u, m) in &UNITS[..4] {
        if bytes >= *m as f64 {
            return format!("{:.1} {u}", bytes / *m as f64);
        }
    }
    format!("{bytes:.0} B")
}
