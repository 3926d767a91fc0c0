//! The host memory a training process holds, as Linux counts it: the process's resident bytes
//! (`VmRSS` in `/proc/self/status`, which includes the page-locked buffers of offloaded
//! checkpoints and of an optimizer state kept in host memory) and what the host has left
//! (`MemAvailable` in `/proc/meminfo`). The trainer logs it after the first step, beside the
//! planner's prediction of the host bytes it pins.

use crate::byte_units::format_bytes;

/// The value of a `NAME:   1234 kB` line of `/proc/self/status`, in bytes.
fn kib_field(text: &str, name: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.split(':').next() == Some(name))?;
    let kib = line.split_whitespace().nth(1)?.parse::<u64>().ok()?;
    Some(kib * 1024)
}

/// `(resident bytes of this process, bytes the host has available)`, `None` where `/proc` does
/// not say (not Linux). The available bytes are those the offload's host-memory check reads.
pub fn host_usage() -> Option<(u64, u64)> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    Some((
        kib_field(&status, "VmRSS")?,
        burn_distflash::offload::host_memory_available()?,
    ))
}

/// One log line of [`host_usage`], `None` off Linux.
pub fn host_usage_line() -> Option<String> {
    let (resident, available) = host_usage()?;
    Some(format!(
        "host memory: this process {} resident (pinned offloads and optimizer state included), \
         {} available on the host",
        format_bytes(resident),
        format_bytes(available)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_kib_fields_in_bytes_and_only_the_named_one() {
        let status = "Name:\tllama_train\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n";
        assert_eq!(kib_field(status, "VmRSS"), Some(1024 * 1024));
        assert_eq!(kib_field(status, "VmHWM"), Some(2048 * 1024));
        assert_eq!(kib_field(status, "VmRS"), None);
        assert_eq!(kib_field("VmRSS: lots\n", "VmRSS"), None);
    }

    #[test]
    fn this_process_is_resident_on_linux() {
        if let Some((resident, available)) = host_usage() {
            assert!(resident > 0 && available > 0);
            assert!(host_usage_line().unwrap().contains("resident"));
        }
    }
}
