//! How one scheduled pair (a query shard against a key/value shard) becomes step calls.
//!
//! Under a layout with several chunks per rank a pair of shards is a grid of chunk pairs, each
//! hidden (no visible score: skipped), whole (every score visible: stepped with no mask) or
//! partly visible (stepped with a mask). The visible chunk pairs are covered by as few
//! rectangular [`Block`]s as the grid allows, each one step call. How a chunk pair is seen
//! depends on the mask: causal order alone is decided per chunk (a chunk against itself
//! partly, earlier chunks whole, later ones hidden), a window or documents from the positions
//! (an exact count of visible scores, see [`crate::visibility`]). Zigzag, `P = 4`, rank 2
//! (chunks 2, 5), causal:
//!
//! ```text
//! against itself       against rank 0 (0, 7)   against rank 3 (3, 4)
//!        2   5                0   7                   3   4
//!   2  [ \   . ]         2  [ #   . ]            2  [ .   . ]
//!   5  [ #   \ ]         5  [ #   . ]            5  [ #   # ]
//!   one causal block     one block: all queries   one block: the late queries
//!   over the shard       x the early keys         x every key
//!   (\ partly visible, # whole, . hidden)
//! ```
//!
//! A block's mask is the call's mask at the absolute positions of its first query and key
//! rows, so a block spanning several chunks needs chunks that follow each other in the
//! sequence on both sides (always true of one chunk; under the zigzag layout, of the middle
//! rank's two). Causal order alone depends only on the order of positions, so a shard against
//! itself is one block causal over its local rows whatever its chunks.
//!
//! A block over some of a shard's chunks is some rows of the shard's tensors, which a kernel
//! taking contiguous buffers gets as copies. [`Schedule::cells`](crate::Schedule::cells)
//! covers the same chunk pairs one call each (in the example above, rank 2 against itself is
//! three calls: `2 x 2` and `5 x 5` causal, `5 x 2` with no mask), so a pass that keeps each
//! chunk a tensor of its own computes every call on whole tensors.

use core::ops::Range;

use crate::layout::Layout;
use crate::mask::Mask;
use crate::visibility::visible_scores;
use crate::Pair;

/// One step call: local query chunks `query` against local key/value chunks `kv` of a pair's
/// shards.
#[derive(Debug, Clone, PartialEq)]
pub struct Block {
    /// Local chunk indices of the query shard.
    pub query: Range<usize>,
    /// Local chunk indices of the key/value shard.
    pub kv: Range<usize>,
    /// The step call's mask over the block's rows (query row `i` of the block sees key row `j`
    /// iff `mask.visible(batch, i, j)`): no mask where every score is visible, otherwise the
    /// call's mask at the absolute positions of the block's first rows (for causal order
    /// alone, causal over the block's local rows, which is the same).
    pub mask: Mask,
    /// Work in chunk pairs: the visible share of each chunk pair the block covers, summed.
    /// Under causal order alone a chunk against itself counts half (the long-chunk limit);
    /// under a window or documents the share is the exact count of visible scores over
    /// `chunk²`, averaged over the documents' batch rows.
    pub cost: f64,
}

/// How a schedule decides which scores of a chunk pair are visible.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Visibility {
    /// Causal order or no mask, decided per chunk whatever the chunk length: a chunk against
    /// itself is half visible (its scores at or below the diagonal: half of them for long
    /// chunks), earlier chunks whole, later chunks hidden.
    Chunks {
        /// Whether keys after the query are hidden (otherwise every chunk pair is whole).
        causal: bool,
    },
    /// A window or documents (and maybe causal order), decided from the positions of chunks of
    /// `chunk` tokens: a chunk pair's share is its exact count of visible scores over
    /// `chunk²`, averaged over the documents' batch rows.
    Positions {
        /// The whole sequence's mask (offsets 0).
        mask: Mask,
        /// Tokens per chunk.
        chunk: usize,
    },
}

impl Visibility {
    /// Whether keys after the query are hidden.
    pub(crate) fn causal(&self) -> bool {
        match self {
            Visibility::Chunks { causal } => *causal,
            Visibility::Positions { mask, .. } => mask.causal,
        }
    }
}

/// How much of one chunk pair is visible.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Seen {
    /// No score: skipped.
    Hidden,
    /// Some scores, this share of them.
    Partly(f64),
    /// Every score.
    Whole,
}

impl Seen {
    /// Work in chunk pairs.
    fn cost(self) -> f64 {
        match self {
            Seen::Hidden => 0.0,
            Seen::Partly(share) => share,
            Seen::Whole => 1.0,
        }
    }
}

/// A pair of shards as a grid of chunk pairs under a [`Visibility`].
struct Grid<'a> {
    visibility: &'a Visibility,
    /// Global chunk indices of the query shard's and the key/value shard's local chunks.
    query_chunks: Vec<usize>,
    kv_chunks: Vec<usize>,
    seen: Vec<Vec<Seen>>,
}

impl<'a> Grid<'a> {
    fn new(layout: Layout, world: usize, visibility: &'a Visibility, pair: Pair) -> Self {
        let (query_chunks, kv_chunks) = (
            layout.chunks(world, pair.query),
            layout.chunks(world, pair.kv),
        );
        let seen = (query_chunks.iter())
            .map(|&q| {
                (kv_chunks.iter())
                    .map(|&k| Self::chunk_pair(visibility, q, k))
                    .collect()
            })
            .collect();
        Self {
            visibility,
            query_chunks,
            kv_chunks,
            seen,
        }
    }

    /// How global query chunk `q` sees global key/value chunk `k`.
    fn chunk_pair(visibility: &Visibility, q: usize, k: usize) -> Seen {
        match visibility {
            Visibility::Chunks { causal: false } => Seen::Whole,
            Visibility::Chunks { causal: true } => match k.cmp(&q) {
                core::cmp::Ordering::Less => Seen::Whole,
                core::cmp::Ordering::Equal => Seen::Partly(0.5),
                core::cmp::Ordering::Greater => Seen::Hidden,
            },
            Visibility::Positions { mask, chunk } => {
                let rows = mask.documents.as_ref().map_or(1, |d| d.batch_rows());
                let all = (chunk * chunk * rows) as u128;
                let positions = |c: usize| c * chunk..(c + 1) * chunk;
                match visible_scores(mask, positions(q), positions(k)) {
                    0 => Seen::Hidden,
                    seen if seen == all => Seen::Whole,
                    seen => Seen::Partly(seen as f64 / all as f64),
                }
            }
        }
    }

    /// How the chunk pairs of these local chunks are seen, row by row.
    fn seen_over(
        &self,
        query: &Range<usize>,
        kv: &Range<usize>,
    ) -> impl Iterator<Item = Seen> + '_ {
        let kv = kv.clone();
        (query.clone()).flat_map(move |i| kv.clone().map(move |j| self.seen[i][j]))
    }

    /// A block over these local chunks (its mask: none where every chunk pair is whole).
    fn block(&self, query: Range<usize>, kv: Range<usize>, mask: Mask) -> Block {
        let cost = self.seen_over(&query, &kv).map(Seen::cost).sum();
        let mask = if self.seen_over(&query, &kv).all(|s| s == Seen::Whole) {
            Mask::none()
        } else {
            mask
        };
        Block {
            query,
            kv,
            mask,
            cost,
        }
    }

    /// Whether one step call can cover these local chunks: with the mask of
    /// [`mask_at`](Self::mask_at) their first chunks (see the module docs).
    fn one_step(&self, query: &Range<usize>, kv: &Range<usize>) -> bool {
        let (q, k) = (
            &self.query_chunks[query.clone()],
            &self.kv_chunks[kv.clone()],
        );
        match self.visibility {
            Visibility::Chunks { causal: false } => true,
            // Causal over local rows: the chunks in ascending order against themselves.
            Visibility::Chunks { causal: true } => q == k && q.windows(2).all(|w| w[0] < w[1]),
            Visibility::Positions { .. } => {
                let follow = |c: &[usize]| c.windows(2).all(|w| w[1] == w[0] + 1);
                follow(q) && follow(k)
            }
        }
    }

    /// The mask of a step whose first chunks are local query chunk `i` and key/value chunk
    /// `j`. Under causal order alone a chunk pair that is partly visible is a chunk against
    /// itself, whose mask is causal over local rows (as is a shard against itself).
    fn mask_at(&self, i: usize, j: usize) -> Mask {
        match self.visibility {
            Visibility::Chunks { causal: false } => Mask::none(),
            Visibility::Chunks { causal: true } => Mask::causal(),
            Visibility::Positions { mask, chunk } => mask.clone().at(
                (self.query_chunks[i] * chunk) as i64,
                (self.kv_chunks[j] * chunk) as i64,
            ),
        }
    }

    /// As few blocks as the grid allows, covering every chunk pair with a visible score once.
    fn covered(&self) -> Vec<Block> {
        let (n, m) = (self.query_chunks.len(), self.kv_chunks.len());
        if self.seen_over(&(0..n), &(0..m)).all(|s| s == Seen::Hidden) {
            return Vec::new();
        }
        // A block with no mask may span any chunks.
        if self.seen_over(&(0..n), &(0..m)).all(|s| s == Seen::Whole) {
            return vec![self.block(0..n, 0..m, Mask::none())];
        }
        if self.one_step(&(0..n), &(0..m)) {
            return vec![self.block(0..n, 0..m, self.mask_at(0, 0))];
        }
        let mut out = Vec::new();
        // Query chunks that see every key chunk whole: one block per such row.
        let whole_rows: Vec<bool> = (0..n)
            .map(|i| {
                self.seen_over(&(i..i + 1), &(0..m))
                    .all(|s| s == Seen::Whole)
            })
            .collect();
        for i in (0..n).filter(|&i| whole_rows[i]) {
            out.push(self.block(i..i + 1, 0..m, Mask::none()));
        }
        // What is left, column by column: one block per column whose remaining visible chunk
        // pairs are all whole and adjacent, otherwise one block per chunk pair.
        for j in 0..m {
            let rows: Vec<usize> = (0..n)
                .filter(|&i| !whole_rows[i] && self.seen[i][j] != Seen::Hidden)
                .collect();
            let adjacent = rows.windows(2).all(|w| w[1] == w[0] + 1);
            if rows.len() > 1 && adjacent && rows.iter().all(|&i| self.seen[i][j] == Seen::Whole) {
                out.push(self.block(rows[0]..rows[rows.len() - 1] + 1, j..j + 1, Mask::none()));
                continue;
            }
            for i in rows {
                out.push(self.block(i..i + 1, j..j + 1, self.mask_at(i, j)));
            }
        }
        out
    }

    /// One block per chunk pair with a visible score, row by row (query chunk, then key/value
    /// chunk), each with its own mask.
    fn cells(&self) -> Vec<Block> {
        let (n, m) = (self.query_chunks.len(), self.kv_chunks.len());
        (0..n)
            .flat_map(|i| (0..m).map(move |j| (i, j)))
            .filter(|&(i, j)| self.seen[i][j] != Seen::Hidden)
            .map(|(i, j)| self.block(i..i + 1, j..j + 1, self.mask_at(i, j)))
            .collect()
    }
}

/// The blocks computing `pair` (query rank, key/value rank) under `layout` and `visibility`;
/// none when no score of the pair is visible.
pub(crate) fn blocks(
    layout: Layout,
    world: usize,
    visibility: &Visibility,
    pair: Pair,
) -> Vec<Block> {
    Grid::new(layout, world, visibility, pair).covered()
}

/// The chunk pairs of `pair` with a visible score, one [`Block`] of one query chunk and one
/// key/value chunk each (with that chunk pair's mask and cost), row by row; none when no score
/// of the pair is visible. Together they compute what [`blocks`] does, in calls that each cover
/// whole chunks on both sides.
pub(crate) fn cells(
    layout: Layout,
    world: usize,
    visibility: &Visibility,
    pair: Pair,
) -> Vec<Block> {
    Grid::new(layout, world, visibility, pair).cells()
}
