//! Faults of the device threads, as this process sees them.
//!
//! CubeCL runs each device's work on threads of its own (named `DSU-…` and `DSD-…`: the device
//! service's upstream and downstream stages). When one of them fails, above all when the GPU's
//! memory runs out ("can't allocate buffer of size: N"), it panics on that thread: the thread
//! that submitted the work is not told, the failed buffer is missing from then on, and what reads
//! it gets garbage, an error much later, or waits forever. A training step that ran into it
//! finishes with a NaN loss, or never finishes.
//!
//! [`watch_device_faults`] installs a panic hook (once per process, chained to the one before)
//! that records the first such panic and prints it once instead of once per failed task;
//! [`device_fault`] says whether one happened. A caller checks it where a result is about to be
//! trusted (the end of a step's forward, backward, optimizer) and stops with the fault's message
//! instead of reporting numbers. Panics on any other thread go to the previous hook unchanged.

use std::fmt;
use std::panic::PanicHookInfo;
use std::sync::{Mutex, Once};

/// The first panic of a device thread in this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceFault {
    /// The thread that panicked (CubeCL's device service: `DSD-0-1` is device 1's).
    pub thread: String,
    /// Its panic message.
    pub message: String,
    /// Device threads that panicked in all, this one included.
    pub count: u64,
}

impl DeviceFault {
    /// The bytes of the allocation that failed, when the fault is the GPU running out of memory.
    pub fn failed_allocation(&self) -> Option<u64> {
        let (_, rest) = self.message.split_once(OUT_OF_MEMORY)?;
        let digits: String = rest
            .trim_start()
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        digits.parse().ok()
    }
}

impl fmt::Display for DeviceFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.failed_allocation() {
            Some(bytes) => write!(
                f,
                "the GPU ran out of memory: its memory pool could not allocate {bytes} bytes \
                 ({:.2} GiB; device thread {}), so this step's numbers are not valid. Use less \
                 memory: a shorter sequence, more GPUs, checkpoints (and --offload), the optimizer \
                 state in host memory, or let the planner choose (--memory auto)",
                bytes as f64 / GIB,
                self.thread
            ),
            None => write!(
                f,
                "a device thread failed ({}: {}), so this step's numbers are not valid",
                self.thread, self.message
            ),
        }
    }
}

/// What CubeCL's memory pool says when the device cannot give it a buffer.
const OUT_OF_MEMORY: &str = "can't allocate buffer of size:";

const GIB: f64 = (1u64 << 30) as f64;

/// The first fault recorded, and how many device-thread panics there were.
static FAULT: Mutex<Option<DeviceFault>> = Mutex::new(None);

static INSTALL: Once = Once::new();

/// Installs the panic hook that records device-thread faults (see the module's documentation).
/// Idempotent: the first call installs it, chained to the hook in place then.
pub fn watch_device_faults() {
    INSTALL.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let thread = std::thread::current();
            match thread.name().filter(|name| is_device_thread(name)) {
                Some(name) => record(name, info),
                None => previous(info),
            }
        }));
    });
}

/// The first device-thread fault since the process started (or since [`clear_device_fault`]),
/// with the count of them; `None` if there was none, or if [`watch_device_faults`] was never
/// called.
pub fn device_fault() -> Option<DeviceFault> {
    FAULT.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Forgets the recorded fault (for callers that recover, and for tests).
pub fn clear_device_fault() {
    *FAULT.lock().unwrap_or_else(|e| e.into_inner()) = None;
}

/// Whether `name` is one of CubeCL's device-service threads (`DSU-<type>-<index>`,
/// `DSD-<type>-<index>`).
fn is_device_thread(name: &str) -> bool {
    name.strip_prefix("DSU-")
        .or_else(|| name.strip_prefix("DSD-"))
        .and_then(|rest| rest.split_once('-'))
        .is_some_and(|(kind, index)| is_number(kind) && is_number(index))
}

fn is_number(text: &str) -> bool {
    !text.is_empty() && text.chars().all(|c| c.is_ascii_digit())
}

/// Records `info` as thread `name`'s fault: the first is kept and printed, later ones counted.
fn record(name: &str, info: &PanicHookInfo<'_>) {
    let message = panic_message(info);
    let mut fault = FAULT.lock().unwrap_or_else(|e| e.into_inner());
    match fault.as_mut() {
        Some(first) => first.count += 1,
        None => {
            eprintln!(
                "device thread '{name}' failed: {message} (later failures of device threads are \
                 counted, not printed)"
            );
            *fault = Some(DeviceFault {
                thread: name.to_owned(),
                message,
                count: 1,
            });
        }
    }
}

fn panic_message(info: &PanicHookInfo<'_>) -> String {
    let payload = info.payload();
    let text = payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(a panic without a message)".to_owned());
    match info.location() {
        Some(at) => format!("{text} (at {}:{})", at.file(), at.line()),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_threads_are_cubecl_device_service_names() {
        for name in ["DSD-0-1", "DSU-3-12"] {
            assert!(is_device_thread(name), "{name}");
        }
        for name in ["DSD-0", "DSX-0-1", "DSD-a-1", "main", "DSD--1", "rank-0"] {
            assert!(!is_device_thread(name), "{name}");
        }
    }

    #[test]
    fn an_allocation_failure_reads_as_out_of_memory() {
        let fault = DeviceFault {
            thread: "DSD-0-1".into(),
            message: "called `Result::unwrap()` on an `Err` value: can't allocate buffer of \
                      size: 2345466880 (at server.rs:124)"
                .into(),
            count: 12,
        };
        assert_eq!(fault.failed_allocation(), Some(2_345_466_880));
        let text = fault.to_string();
        assert!(text.contains("ran out of memory"), "{text}");
        assert!(
            text.contains("2.18 GiB") && text.contains("DSD-0-1"),
            "{text}"
        );
        let other = DeviceFault {
            message: "Memory page 0 doesn't exist".into(),
            ..fault
        };
        assert_eq!(other.failed_allocation(), None);
        assert!(other.to_string().contains("Memory page 0"), "{other}");
    }

    #[test]
    fn a_device_thread_panic_is_recorded_and_others_pass_through() {
        watch_device_faults();
        clear_device_fault();
        let panicking = |name: &str, message: &'static str| {
            let thread = std::thread::Builder::new().name(name.to_owned());
            let handle = thread.spawn(move || panic!("{message}")).expect("a thread");
            assert!(handle.join().is_err());
        };
        panicking("worker-0", "not a device thread");
        assert_eq!(device_fault(), None);
        for _ in 0..3 {
            panicking("DSD-7-7", "can't allocate buffer of size: 123");
        }
        let fault = device_fault().expect("recorded");
        assert_eq!((fault.thread.as_str(), fault.count), ("DSD-7-7", 3));
        assert_eq!(fault.failed_allocation(), Some(123));
        clear_device_fault();
        assert_eq!(device_fault(), None);
    }
}
