//! Flag values with a check: numbers that must be positive or finite, parsed with a message
//! that says so. What the run's sections (clap's derive on [`crate::trainer::Cadence`], the
//! pipeline and parallel sections) and the programs' own flags read their numbers with.

/// Parses a size flag: a positive integer, with a message that says so.
pub fn positive_u64(s: &str) -> std::result::Result<u64, String> {
    let v: i128 = s
        .trim()
        .parse()
        .map_err(|_| format!("must be a positive integer, got `{s}`"))?;
    if v <= 0 {
        return Err(format!("must be a positive integer, got {v}"));
    }
    u64::try_from(v).map_err(|_| format!("{v} is too large"))
}

/// Parses a number flag: a finite number (`nan` and `inf` are refused by name).
pub fn finite(s: &str) -> std::result::Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("must be a number, got `{s}`"))?;
    if !v.is_finite() {
        return Err(format!("must be a finite number, got `{s}`"));
    }
    Ok(v)
}

/// Parses `--bucket-mb`: a finite number of MiB above zero and at most 1 TiB.
pub fn positive_mb(s: &str) -> std::result::Result<f64, String> {
    let v = finite(s)?;
    if v <= 0.0 || v > (1u64 << 20) as f64 {
        return Err(format!(
            "must be a number of MiB above 0 and at most 1048576, got `{s}`"
        ));
    }
    Ok(v)
}

/// [`positive_u64`] as a `usize`.
pub fn positive(s: &str) -> std::result::Result<usize, String> {
    positive_u64(s).and_then(|v| usize::try_from(v).map_err(|_| format!("{v} is too large")))
}
