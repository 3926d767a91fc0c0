//! A shared count of how many times a module computed attention's forward, so tests and users can
//! see what gradient checkpointing recomputes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Counts attention forward computations; clones of a module share one count.
#[derive(Debug, Clone, Default)]
pub struct ForwardCounter(Arc<AtomicUsize>);

impl ForwardCounter {
    /// Records one forward computation.
    pub fn record(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    /// Forward computations so far.
    pub fn get(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }

    /// Sets the count back to zero.
    pub fn reset(&self) {
        self.0.store(0, Ordering::Relaxed);
    }
}
