//! Byte counts as text: [`format_bytes`] writes them in binary units, [`parse_bytes`] reads a
//! count a user gives (`80GiB`, `141GB`, `512MiB`, `1073741824`), refusing what is not a count
//! of at least one byte that fits `u64` (a parser that saturated or read `0` would hand the
//! memory planner a wrong GPU without a word).

use indicatif::HumanBytes;

use crate::Error;

/// Bytes in binary units: `"1.50 GiB"` (indicatif's `HumanBytes`).
pub fn format_bytes(n: u64) -> String {
    HumanBytes(n).to_string()
}

/// A byte count: a number (a fraction too) followed by nothing or `B` (bytes), `KiB`, `MiB`,
/// `GiB`, `TiB` (powers of 1024) or `KB`, `MB`, `GB`, `TB` (powers of 1000), case-insensitive.
///
/// # Errors
///
/// [`Error::Invalid`] naming `what`, for text that is not such a count, or a count below one
/// byte or past `u64`.
pub fn parse_bytes(what: &str, text: &str) -> Result<u64, Error> {
    let invalid = || {
        Error::invalid(
            what,
            "a byte count such as 80GiB, 141GB, 512MiB or 1073741824",
            format!("{text:?}"),
        )
    };
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| c.is_ascii_alphabetic())
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let number: f64 = number.trim().parse().map_err(|_| invalid())?;
    let scale: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kib" => 1024.0,
        "mib" => 1024f64.powi(2),
        "gib" => 1024f64.powi(3),
        "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => return Err(invalid()),
    };
    let bytes = number * scale;
    match bytes.is_finite() && bytes >= 1.0 && bytes < u64::MAX as f64 {
        true => Ok(bytes as u64),
        false => Err(invalid()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts_read_in_binary_units() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(1023), "1023 B");
        assert_eq!(format_bytes(1536), "1.50 KiB");
        assert_eq!(format_bytes(3 << 30), "3.00 GiB");
        assert_eq!(format_bytes(139 << 30), "139.00 GiB");
    }

    #[test]
    fn byte_counts_parse_with_either_kind_of_unit() {
        assert_eq!(parse_bytes("m", "80GiB").unwrap(), 80 << 30);
        assert_eq!(parse_bytes("m", "141 GB").unwrap(), 141_000_000_000);
        assert_eq!(parse_bytes("m", "1.5kib").unwrap(), 1536);
        assert_eq!(parse_bytes("m", "4096").unwrap(), 4096);
        for bad in ["", "GiB", "-1GiB", "0", "12 parsecs", "1e30TB", "NaN"] {
            let err = parse_bytes("--gpu-memory", bad).unwrap_err().to_string();
            assert!(err.contains("--gpu-memory"), "{bad}: {err}");
        }
    }
}
