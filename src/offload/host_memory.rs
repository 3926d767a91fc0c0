//! How much host memory a host offload may take: the kernel's `MemAvailable` (Linux,
//! `/proc/meminfo`) less a fixed headroom, checked before host memory is allocated so that a host
//! that runs out gives an [`Error`] instead of the out-of-memory killer mid-step.

use crate::Error;

/// Host memory left to everything else on the machine after an offload: the check refuses to
/// take the last [`HEADROOM`] bytes the kernel calls available.
pub const HEADROOM: u64 = 2 << 30;

/// `MemAvailable` of a `/proc/meminfo` text, in bytes, or `None` where the line is missing.
pub(crate) fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut fields = line["MemAvailable:".len()..].split_whitespace();
    let value: u64 = fields.next()?.parse().ok()?;
    match fields.next() {
        Some("kB") => value.checked_mul(1024),
        None => Some(value),
        Some(_) => None,
    }
}

/// The host memory available now (`MemAvailable`), or `None` where the system does not say
/// (no `/proc/meminfo`: not Linux).
pub fn available() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_available(&meminfo)
}

/// Refuses `needed` bytes of host memory when `available` (the host's `MemAvailable`) minus
/// [`HEADROOM`] is less; `None` (unknown) accepts.
pub(crate) fn check(needed: u64, available: Option<u64>) -> Result<(), Error> {
    let Some(available) = available else {
        return Ok(());
    };
    if needed.saturating_add(HEADROOM) <= available {
        return Ok(());
    }
    Err(Error::Offload {
        needed,
        why: format!(
            "the host has {} available (MemAvailable) and the offload leaves {} to the rest of \
             the machine; free host memory, or offload less (keep more layers' checkpoints, or \
             the optimizer state, on the device)",
            gib(available),
            gib(HEADROOM)
        ),
    })
}

/// [`check`] against the host's memory now.
pub(crate) fn check_available(needed: u64) -> Result<(), Error> {
    check(needed, available())
}

/// Bytes as GiB with two decimals, for messages.
pub(crate) fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_mem_available_in_bytes() {
        let text = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   12345678 kB\n";
        assert_eq!(parse_mem_available(text), Some(12345678 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 5 kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: lots kB\n"), None);
        assert!(available().is_none_or(|bytes| bytes > 0));
    }

    #[test]
    fn refuses_what_would_eat_the_headroom_and_says_how_much_was_there() {
        let gb = 1u64 << 30;
        assert!(check(gb, Some(4 * gb)).is_ok());
        assert!(
            check(u64::MAX, None).is_ok(),
            "unknown availability accepts"
        );
        let err = check(3 * gb, Some(4 * gb)).unwrap_err();
        let Error::Offload { needed, why } = &err else {
            panic!("{err:?}")
        };
        assert_eq!(*needed, 3 * gb);
        assert!(why.contains("4.00 GiB available"), "{why}");
        assert!(err.to_string().contains("3.00 GiB"), "{err}");
    }
}
