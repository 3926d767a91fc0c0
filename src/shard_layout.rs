//! The definition of [`Layout`], which positions of the sequence each rank holds; its methods,
//! and the pictures, are in [`crate::schedule::layout`], where users find it. A leaf: it names
//! nothing else of the crate, so that [`Error::Layout`](crate::Error::Layout) can carry a
//! `Layout` while the schedule's checks return [`Error`](crate::Error) without an import cycle.

use serde::{Deserialize, Serialize};

/// Which positions of the sequence each rank holds (see [`crate::schedule::layout`] for
/// pictures).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum Layout {
    /// Rank `r` of `P` holds positions `r*S .. (r+1)*S`.
    #[default]
    Contiguous,
    /// The sequence cut into `2P` chunks; rank `r` holds chunks `r` and `2P-1-r`, in that order.
    Zigzag,
}
