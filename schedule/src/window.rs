//! [`SlidingWindow`]: the keys around each query that it sees, FlashAttention's `window_size`.

use crate::ScheduleError;

/// A sliding window around each query, FlashAttention's `window_size = (left, right)`: the query
/// at absolute position `i` sees keys at positions `i - before ..= i + after`. Combined with a
/// causal mask, `after` is 0 whatever it says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct SlidingWindow {
    /// Keys before the query that it sees.
    pub before: usize,
    /// Keys after the query that it sees.
    pub after: usize,
}

impl SlidingWindow {
    /// The causal window of `size` keys, Mistral-style: the query at position `i` sees keys
    /// `(i - size, i]` (itself and the `size - 1` keys before it). Use with a causal mask.
    ///
    /// # Errors
    ///
    /// [`ScheduleError::BadMask`] when `size` is 0: a window of no key would hide every key from
    /// every query, which is a configuration mistake, not a window (the smallest window, 1,
    /// lets each query see itself).
    pub fn causal(size: usize) -> Result<Self, ScheduleError> {
        match size.checked_sub(1) {
            Some(before) => Ok(Self { before, after: 0 }),
            None => Err(ScheduleError::BadMask {
                what: "a causal sliding window of 0 keys: the size counts the keys each query \
                       sees, itself included, so it must be at least 1"
                    .into(),
            }),
        }
    }

    /// A two-sided window: `before` keys before the query and `after` keys after it.
    pub fn two_sided(before: usize, after: usize) -> Self {
        Self { before, after }
    }
}
