//! The load-balanced schedule with helper workers (paper Algorithm 2).
//!
//! A causal pair `(i, j)`, `j < i`, lies at distance `d = i - j`. Pairs with `d <= P/2` are
//! computed by the query's owner `i` at step `d`, as in the ring. The others, `d > P/2`, are
//! computed by the key/value owner `j` (the "helper", whose own work is done) at step `P - d`:
//! it fetches query chunk `i`, computes a partial `(o, m, l)` against its own keys and values,
//! and sends it back to `i` to be merged. Step 0 is every rank's diagonal. So `floor(P/2) + 1`
//! steps, every rank busy at every step for odd `P`; for even `P` the ranks below `P/2` idle at
//! the last step.
//!
//! ```text
//! P = 5             step 0   step 1   step 2
//!   rank 0          (0,0)    (4,0)*   (3,0)*        * computed by the helper for the
//!   rank 1          (1,1)    (1,0)    (4,1)*          query's owner, which merges it
//!   rank 2          (2,2)    (2,1)    (2,0)
//!   rank 3          (3,3)    (3,2)    (3,1)
//!   rank 4          (4,4)    (4,3)    (4,2)
//! ```
//!
//! Non-causal attention has nothing to balance: it runs the ring.

use crate::ring::Ring;
use crate::{Pair, ScheduleRule};

/// Paper Algorithm 2.
pub struct Balanced;

impl ScheduleRule for Balanced {
    fn num_steps(world: usize, causal: bool) -> usize {
        if !causal {
            return Ring::num_steps(world, causal);
        }
        world / 2 + 1
    }

    fn pair(world: usize, causal: bool, rank: usize, step: usize) -> Option<Pair> {
        if !causal {
            return Ring::pair(world, causal, rank, step);
        }
        if step <= rank {
            // Own work: distance `step <= P/2`.
            return Some(Pair {
                query: rank,
                kv: rank - step,
            });
        }
        // Helper work: the pair at distance `P - step` whose key/value chunk is this rank's,
        // if that distance is one the owners leave to helpers (`> P/2`).
        let distance = world - step;
        (distance > world / 2).then_some(Pair {
            query: rank + distance,
            kv: rank,
        })
    }
}
