//! The ring schedule (paper Algorithm 1).
//!
//! At step `t` rank `p` computes its own queries against the key/value chunk of rank `p - t`
//! (wrapping around when the attention is not causal). Causal: `P` steps, and rank `p` has work
//! only for `t <= p`, so about half the slots are idle.
//!
//! ```text
//! P = 4, causal     step 0   step 1   step 2   step 3
//!   rank 0          (0,0)    -        -        -
//!   rank 1          (1,1)    (1,0)    -        -
//!   rank 2          (2,2)    (2,1)    (2,0)    -
//!   rank 3          (3,3)    (3,2)    (3,1)    (3,0)
//! ```

use crate::{Pair, ScheduleRule};

/// Paper Algorithm 1.
pub struct Ring;

impl ScheduleRule for Ring {
    fn num_steps(world: usize, _causal: bool) -> usize {
        world
    }

    fn pair(world: usize, causal: bool, rank: usize, step: usize) -> Option<Pair> {
        if causal && step > rank {
            return None;
        }
        Some(Pair {
            query: rank,
            kv: (rank + world - step) % world,
        })
    }
}
