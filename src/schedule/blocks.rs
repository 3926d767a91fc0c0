//! How one scheduled pair (a query shard against a key/value shard) becomes step calls.
//!
//! Under a layout with several chunks per rank a pair of shards is a grid of chunk pairs, each
//! diagonal (one chunk against itself: causally masked), fully visible, or skipped (keys after
//! the queries). The visible chunk pairs are covered by as few rectangular [`Block`]s as the
//! grid allows, each one step call. Zigzag, `P = 4`, rank 2 (chunks 2, 5):
//!
//! ```text
//! against itself       against rank 0 (0, 7)   against rank 3 (3, 4)
//!        2   5                0   7                   3   4
//!   2  [ \   . ]         2  [ #   . ]            2  [ .   . ]
//!   5  [ #   \ ]         5  [ #   . ]            5  [ #   # ]
//!   one causal block     one block: all queries   one block: the late queries
//!   over the shard       x the early keys         x every key
//!   (\ diagonal, # visible, . skipped)
//! ```

use core::ops::Range;

use super::layout::Layout;
use super::Pair;

/// One step call: local query chunks `query` against local key/value chunks `kv` of a pair's
/// shards, with the causal mask over local rows (offsets 0) or no mask.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// Local chunk indices of the query shard.
    pub query: Range<usize>,
    /// Local chunk indices of the key/value shard.
    pub kv: Range<usize>,
    /// Causally masked over the block's local rows (query row `i` sees key row `j <= i`).
    pub causal: bool,
}

impl Block {
    /// Work in chunk pairs (a causal block computes half its scores).
    pub fn cost(&self) -> f64 {
        let area = (self.query.len() * self.kv.len()) as f64;
        if self.causal {
            area / 2.0
        } else {
            area
        }
    }
}

/// How a chunk pair is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Visibility {
    Skipped,
    Diagonal,
    Full,
}

/// The blocks computing `pair` (query rank, key/value rank) under `layout`.
pub fn blocks(layout: Layout, world: usize, causal: bool, pair: Pair) -> Vec<Block> {
    let (qc, kc) = (
        layout.chunks(world, pair.query),
        layout.chunks(world, pair.kv),
    );
    let vis = |i: usize, j: usize| match (causal, kc[j].cmp(&qc[i])) {
        (false, _) | (true, core::cmp::Ordering::Less) => Visibility::Full,
        (true, core::cmp::Ordering::Equal) => Visibility::Diagonal,
        (true, core::cmp::Ordering::Greater) => Visibility::Skipped,
    };
    let (n, m) = (qc.len(), kc.len());
    let all = |f: &dyn Fn(usize, usize) -> bool| (0..n).all(|i| (0..m).all(|j| f(i, j)));
    if all(&|i, j| vis(i, j) == Visibility::Full) {
        return vec![Block {
            query: 0..n,
            kv: 0..m,
            causal: false,
        }];
    }
    // The chunks in ascending order against themselves: one causal mask over the local rows.
    let local_causal = |i: usize, j: usize| match i.cmp(&j) {
        core::cmp::Ordering::Greater => Visibility::Full,
        core::cmp::Ordering::Equal => Visibility::Diagonal,
        core::cmp::Ordering::Less => Visibility::Skipped,
    };
    if n == m && all(&|i, j| vis(i, j) == local_causal(i, j)) {
        return vec![Block {
            query: 0..n,
            kv: 0..m,
            causal: true,
        }];
    }
    let mut out = Vec::new();
    // Query chunks that see every key chunk: one block per such row.
    let full_rows: Vec<bool> = (0..n)
        .map(|i| (0..m).all(|j| vis(i, j) == Visibility::Full))
        .collect();
    for i in (0..n).filter(|&i| full_rows[i]) {
        out.push(Block {
            query: i..i + 1,
            kv: 0..m,
            causal: false,
        });
    }
    // What is left, column by column: one block per column whose remaining visible chunk pairs
    // are all full and adjacent, otherwise one block per chunk pair.
    for j in 0..m {
        let rows: Vec<usize> = (0..n)
            .filter(|&i| !full_rows[i] && vis(i, j) != Visibility::Skipped)
            .collect();
        let adjacent = rows.windows(2).all(|w| w[1] == w[0] + 1);
        if rows.len() > 1 && adjacent && rows.iter().all(|&i| vis(i, j) == Visibility::Full) {
            out.push(Block {
                query: rows[0]..rows[rows.len() - 1] + 1,
                kv: j..j + 1,
                causal: false,
            });
            continue;
        }
        out.extend(rows.into_iter().map(|i| Block {
            query: i..i + 1,
            kv: j..j + 1,
            causal: vis(i, j) == Visibility::Diagonal,
        }));
    }
    out
}
