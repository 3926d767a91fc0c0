//! One test at a time on wgpu within a test binary.
//!
//! CubeCL autotunes a kernel for each new shape on its first use. A second thread that asks for
//! a shape while its tuning is under way is not made to wait: it gets the result of the first
//! candidate kernel that runs (`TuneCacheResult::Pending` in `cubecl-runtime`), which can differ
//! in the last bits from the kernel the tuning then picks for every later call. Two tests that
//! run the same model shapes on wgpu at once can thus see different bits, and a test comparing
//! runs bitwise fails now and then under load. Every test of a binary that runs kernels on wgpu
//! holds [`exclusive_wgpu`] for its whole body, so no tuning is ever shared with another test.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// The lock behind [`exclusive_wgpu`], one per test binary.
static WGPU: Mutex<()> = Mutex::new(());

/// Waits until no other test of this binary runs on wgpu, then holds wgpu for the caller until
/// the guard drops. Take it first in the test, before any time limit ([`crate::within`]) starts,
/// so the wait does not count against the test. A test that panicked while holding it leaves it
/// usable.
pub fn exclusive_wgpu() -> MutexGuard<'static, ()> {
    WGPU.lock().unwrap_or_else(PoisonError::into_inner)
}
