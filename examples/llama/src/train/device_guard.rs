//! The trainer's check for failed device threads ([`burn_distflash::device_faults`]): where a
//! step is about to trust what the device computed (the loss read back, the optimizer's norm),
//! a fault since the step began (above all, the GPU out of memory) ends the step with
//! [`Error::Device`] instead of numbers computed from missing buffers; and a step that panics
//! after such a fault (a read of a missing buffer) ends with the fault, the cause, too.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use burn_distflash::device_faults::device_fault;

use crate::Error;

/// `Ok` while no device thread has failed in this process, else [`Error::Device`] naming the
/// phase that found it.
pub(super) fn device_healthy(during: &'static str) -> Result<(), Error> {
    match device_fault() {
        Some(fault) => Err(Error::Device { during, fault }),
        None => Ok(()),
    }
}

/// `pass`'s result; if it panics after a device thread failed, [`Error::Device`] (the panic is
/// the fault's consequence); any other panic goes on unwinding.
pub(super) fn unless_device_failed<T>(
    during: &'static str,
    pass: impl FnOnce() -> Result<T, Error>,
) -> Result<T, Error> {
    match catch_unwind(AssertUnwindSafe(pass)) {
        Ok(result) => result,
        Err(panic) => match device_fault() {
            Some(fault) => Err(Error::Device { during, fault }),
            None => resume_unwind(panic),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_device_fault_results_pass_and_panics_go_on() {
        // No device thread fails in this test binary's CPU tests.
        assert!(device_healthy("a test").is_ok());
        assert_eq!(unless_device_failed("a test", || Ok(3)).ok(), Some(3));
        let panicked = catch_unwind(|| unless_device_failed::<()>("a test", || panic!("a bug")));
        assert!(panicked.is_err());
    }
}
