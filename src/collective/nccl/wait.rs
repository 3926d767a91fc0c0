//! Bounded waits on non-blocking communicators: polling their state until their pending
//! operations are done, one failed, or a deadline passes; and bounded waits on a call that may
//! block (an abort), run on a thread of its own.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use cudarc::nccl::sys as nccl;

/// The state of a non-blocking communicator's last operation: `ncclInProgress` while NCCL still
/// works on it in the background, `ncclSuccess` once done, an error otherwise.
pub(super) fn async_state(comm: nccl::ncclComm_t) -> nccl::ncclResult_t {
    let mut state = nccl::ncclResult_t::ncclSuccess;
    // SAFETY: `comm` is a live communicator; `state` is a valid out pointer.
    let result = unsafe { nccl::ncclCommGetAsyncError(comm, &mut state) };
    if result != nccl::ncclResult_t::ncclSuccess {
        result
    } else {
        state
    }
}

/// Why communicators did not become ready.
pub(super) enum NotReady {
    /// The communicator at this index was still busy at the deadline.
    Timeout(usize),
    /// The communicator at this index failed.
    Failed(usize, nccl::ncclResult_t),
}

/// Waits until every communicator's pending operation is done (enqueued on its stream, or set
/// up), or the deadline passes.
pub(super) fn wait_ready(comms: &[nccl::ncclComm_t], deadline: Instant) -> Result<(), NotReady> {
    let started = Instant::now();
    let mut pending: Vec<usize> = (0..comms.len()).collect();
    loop {
        let mut failed = None;
        pending.retain(|&i| match async_state(comms[i]) {
            nccl::ncclResult_t::ncclSuccess => false,
            nccl::ncclResult_t::ncclInProgress => true,
            other => {
                failed.get_or_insert((i, other));
                true
            }
        });
        if let Some((i, result)) = failed {
            return Err(NotReady::Failed(i, result));
        }
        if pending.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(NotReady::Timeout(pending[0]));
        }
        backoff(started);
    }
}

/// Spins briefly, then yields, then sleeps: a step's wait costs one host wake-up without burning
/// a core for long waits.
pub(super) fn backoff(since: Instant) {
    let waited = since.elapsed();
    if waited < Duration::from_micros(100) {
        std::hint::spin_loop();
    } else if waited < Duration::from_millis(2) {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// Runs `f` on a thread of its own and waits at most `limit` for it: whether it returned in time
/// (if not, it runs on, detached). `false`, without running `f`, when no thread can be started.
pub(super) fn finishes_within(limit: Duration, f: impl FnOnce() + Send + 'static) -> bool {
    let (done, finished) = mpsc::channel();
    let started = std::thread::Builder::new()
        .name("nccl-abort".into())
        .spawn(move || {
            f();
            let _ = done.send(());
        });
    started.is_ok() && finished.recv_timeout(limit).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_is_waited_for_until_it_returns_or_the_limit_passes() {
        assert!(finishes_within(Duration::from_secs(10), || {}));
        let started = Instant::now();
        let stuck = finishes_within(Duration::from_millis(100), || {
            std::thread::sleep(Duration::from_secs(5))
        });
        assert!(!stuck);
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
    }
}
