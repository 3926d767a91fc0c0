//! A wall-clock limit for tests that could hang (multi-rank runs): a hang fails the test
//! instead of stalling the suite.

use std::sync::mpsc;
use std::thread;
use std::time::Duration;

/// Runs `f` on another thread and fails the test if it does not finish within `limit`.
pub fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
    });
    match rx.recv_timeout(limit) {
        Ok(Ok(value)) => value,
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => panic!("the test did not finish within {limit:?} (a hang)"),
    }
}
