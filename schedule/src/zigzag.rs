//! The zigzag ring: the plain ring over the [`Layout::Zigzag`](crate::Layout::Zigzag) layout.
//!
//! At step `t` rank `p` computes its own queries against the key/value shard of rank
//! `p - t (mod P)`, causal or not: `P` steps and no idle slot. Rank `p` holds chunks `p` and
//! `2P-1-p`, so against an earlier rank (`s < p`) its whole query shard sees the other's early
//! chunk, against a later rank (`s > p`) its late chunk sees the other's whole shard, and
//! against itself it computes one causal block: every rank does half a shard pair (two chunk
//! pairs of the `2P`-chunk grid) at every step.
//!
//! ```text
//! P = 4, causal     step 0   step 1   step 2   step 3      work of every rank at every
//!   rank 0          (0,0)    (0,3)    (0,2)    (0,1)       step: 2 of the 4 chunk pairs
//!   rank 1          (1,1)    (1,0)    (1,3)    (1,2)       of its pair of shards
//!   rank 2          (2,2)    (2,1)    (2,0)    (2,3)
//!   rank 3          (3,3)    (3,2)    (3,1)    (3,0)
//! ```

use crate::{Pair, ScheduleRule};

/// The ring over the zigzag layout.
pub struct Zigzag;

impl ScheduleRule for Zigzag {
    fn num_steps(world: usize, _causal: bool) -> usize {
        world
    }

    fn pair(world: usize, _causal: bool, rank: usize, step: usize) -> Option<Pair> {
        Some(Pair {
            query: rank,
            kv: (rank + world - step) % world,
        })
    }
}
