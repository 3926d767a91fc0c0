//! The host-side logic of sequence-parallel attention, pure data and arithmetic (no GPU, no
//! Burn): which keys a query sees ([`Mask`], [`SlidingWindow`], [`Documents`]), which positions
//! each rank holds ([`Layout`]), and which rank computes which part of attention at which step
//! ([`Schedule`]), with the messages that follow ([`RankStep`], [`MessageKind`]). The CubeCL
//! kernels (`distflash-kernels`) take the mask to the device; the Burn plugin (`burn-distflash`)
//! runs the schedules and re-exports this crate as its `schedule` module.
//!
//! `P` ranks each own one shard of the sequence (its query, key and value rows); the
//! [`Layout`] says which positions a shard holds (one contiguous chunk, or two zigzag chunks).
//! Attention needs every pair (query shard `i`, key/value shard `j`) that has a visible score;
//! [`blocks`] splits a pair into step calls (chunk pairs partly visible stepped with the mask,
//! wholly visible ones with none, invisible ones skipped), or into one call per visible chunk
//! pair ([`Schedule::cells`], for a pass that keeps each chunk a tensor of its own). A schedule
//! says, for every rank and
//! step, which pair that rank computes; [`RankStep`] derives what it must then send and
//! receive. Each schedule is one file implementing [`ScheduleRule`]: [`ring`] (the paper's
//! Algorithm 1), [`balanced`] (Algorithm 2, helper workers), both over the contiguous layout,
//! and [`zigzag`] (the ring over the zigzag layout).
//!
//! Under a sliding window or documents ([`Schedule::for_mask`]) the rule's pairs that hold no
//! visible score ([`visibility`], an exact count from the band and the document ranges) are
//! dropped, and so are steps left with no pair: no step call, no key/value chunk sent, no
//! partial or gradient returned. A causal window shorter than a shard, for instance, leaves
//! each rank its own shard and its predecessor's (two steps of the ring instead of `P`).
//!
//! Every refusal is a [`ScheduleError`] naming what was wrong and what is allowed. The crate root
//! holds it and the schedule itself ([`Schedule`], [`Pair`], [`ScheduleRule`], [`ScheduleKind`]),
//! which every module builds on; each module is one part (a mask's piece, the layout, a rule,
//! the blocks, the counts, the messages).

#![warn(missing_docs)]

pub mod balanced;
pub mod blocks;
mod documents;
pub mod layout;
mod mask;
pub mod ring;
mod transfers;
pub mod visibility;
mod window;
pub mod zigzag;

pub use blocks::Block;
pub use documents::Documents;
pub use layout::Layout;
pub use mask::Mask;
pub use transfers::{MessageKind, RankStep};
pub use window::SlidingWindow;

use core::fmt;
use std::collections::BTreeMap;

use blocks::Visibility;

/// What the mask types, layouts and schedules refuse. Exhaustive: the crates above map each
/// variant onto their own error (`KernelError::BadMask`, `burn_distflash::Error::Layout`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScheduleError {
    /// A mask that cannot be built or does not fit where it is used: document boundaries that
    /// do not start at 0 or do not increase, a window of no key, documents that do not cover a
    /// call's positions or the whole sequence, offsets where the sequence's mask needs none.
    BadMask {
        /// What is wrong and what is allowed.
        what: String,
    },
    /// A shard length, sequence length or rank does not fit a [`Layout`].
    Layout {
        /// The layout asked for.
        layout: Layout,
        /// Number of ranks.
        world: usize,
        /// What is wrong and what is allowed.
        what: String,
    },
}

impl fmt::Display for ScheduleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScheduleError::BadMask { what } => write!(f, "bad mask: {what}"),
            ScheduleError::Layout {
                layout,
                world,
                what,
            } => write!(f, "{layout:?} layout over {world} ranks: {what}"),
        }
    }
}

impl std::error::Error for ScheduleError {}

/// One unit of attention work: the query shard of rank `query` against the key/value shard of
/// rank `kv` (under the contiguous layout, chunk `query` against chunk `kv`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Pair {
    /// The rank holding the query shard (and the output rows).
    pub query: usize,
    /// The rank holding the key/value shard.
    pub kv: usize,
}

impl Pair {
    /// A shard against itself.
    pub fn is_diagonal(&self) -> bool {
        self.query == self.kv
    }
}

/// A rule that lays out the pairs over ranks and steps.
pub trait ScheduleRule {
    /// Number of steps for `world` ranks.
    fn num_steps(world: usize, causal: bool) -> usize;
    /// The pair `rank` computes at `step`, if any.
    fn pair(world: usize, causal: bool, rank: usize, step: usize) -> Option<Pair>;
}

/// [`ScheduleRule::pair`] of one rule.
type PairFn = fn(usize, bool, usize, usize) -> Option<Pair>;

/// Which schedule to run (each implies the [`Layout`] of the shards: see
/// [`ScheduleKind::layout`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum ScheduleKind {
    /// The fastest schedule by [`Schedule::time`] for the world size, the causal order and the
    /// window (see [`ScheduleKind::resolve_for`]): without a window, zigzag for causal attention
    /// at even `P > 1`, balanced for causal attention at odd `P`, ring otherwise.
    #[default]
    Auto,
    /// Every rank fetches key/value chunks from the ranks before it (paper Alg. 1; contiguous
    /// layout).
    Ring,
    /// Ranks that run out of work compute for later ranks (paper Alg. 2; contiguous layout).
    Balanced,
    /// The ring over the zigzag layout: every rank holds an early and a late chunk, so causal
    /// work is equal on every rank at every step.
    Zigzag,
}

impl ScheduleKind {
    /// The concrete schedule `Auto` means for `world` ranks without a window: among the
    /// schedules for the causal order (causal: balanced, zigzag; otherwise: ring, already
    /// balanced), the one with the least [`Schedule::time`], the earlier one on a tie. Causal,
    /// zigzag takes `P/2` pair-times and balanced `floor(P/2) + 1/2`: zigzag wins at even `P`; at
    /// odd `P` (and `P = 1`) they tie and balanced, with half the steps and the contiguous
    /// layout, is kept. [`resolve_for`](Self::resolve_for) is the choice under a window.
    pub fn resolve(self, world: usize, causal: bool) -> ScheduleKind {
        if self != ScheduleKind::Auto {
            return self;
        }
        let mut best = (Self::candidates(causal)[0], f64::INFINITY);
        for &kind in Self::candidates(causal) {
            let time = Schedule::new(kind, world.max(1), causal).time();
            if time < best.1 - 1e-12 {
                best = (kind, time);
            }
        }
        best.0
    }

    /// The concrete schedule `Auto` means for `world` ranks holding shards of `shard_len`
    /// tokens under `mask`'s causal order and window: as [`resolve`](Self::resolve), with each
    /// candidate's [`Schedule::time`] counted under the window (the exact visible work of every
    /// pair of shards). Under a causal window shorter than a shard, the contiguous layout needs
    /// one neighbour's keys per rank and zigzag two (its late chunk's neighbour is another
    /// rank's): balanced takes as little time or less, and is kept on a tie. Documents do not
    /// enter the choice: they change from batch to batch while a run keeps one layout, which
    /// callers need before the call to cut the sequence (token shards, rotary positions). A
    /// `shard_len` a layout cannot split (0, or odd under zigzag) leaves that layout out.
    pub fn resolve_for(self, world: usize, shard_len: usize, mask: &Mask) -> ScheduleKind {
        if self != ScheduleKind::Auto {
            return self;
        }
        let Some(window) = mask.window else {
            return self.resolve(world, mask.causal);
        };
        let run_mask = Mask {
            causal: mask.causal,
            ..Mask::none()
        }
        .with_window(window);
        let candidates = Self::candidates(mask.causal);
        let mut best = (candidates[0], f64::INFINITY);
        for &kind in candidates {
            let Ok(schedule) = Schedule::for_mask(kind, world.max(1), shard_len, &run_mask) else {
                continue;
            };
            if schedule.time() < best.1 - 1e-12 {
                best = (kind, schedule.time());
            }
        }
        best.0
    }

    /// The schedules `Auto` chooses among, the preferred one first.
    fn candidates(causal: bool) -> &'static [ScheduleKind] {
        match causal {
            true => &[ScheduleKind::Balanced, ScheduleKind::Zigzag],
            false => &[ScheduleKind::Ring],
        }
    }

    /// Where the shards' positions are (`Auto` must be resolved first: it is contiguous).
    pub fn layout(self) -> Layout {
        match self {
            ScheduleKind::Zigzag => Layout::Zigzag,
            _ => Layout::Contiguous,
        }
    }
}

/// A materialised schedule: the pair of every rank at every step, and each pair's step calls.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    kind: ScheduleKind,
    layout: Layout,
    world: usize,
    visibility: Visibility,
    /// `pairs[step][rank]`.
    pairs: Vec<Vec<Option<Pair>>>,
    /// The step calls of every scheduled pair.
    blocks: BTreeMap<Pair, Vec<Block>>,
}

impl Schedule {
    /// The schedule `kind` for `world >= 1` ranks, causal or with no mask. Work is counted in
    /// the long-shard limit (a chunk against itself is half a chunk pair), so the schedule
    /// needs no shard length; [`Schedule::for_mask`] gives the same for such masks.
    ///
    /// # Panics
    ///
    /// When `world` is zero ([`Schedule::for_mask`] returns that as an error).
    pub fn new(kind: ScheduleKind, world: usize, causal: bool) -> Self {
        assert!(world >= 1, "a schedule needs at least one rank");
        Self::build(kind, world, Visibility::Chunks { causal })
    }

    /// The schedule `kind` for `world` ranks holding shards of `shard_len` tokens, under
    /// `mask`: the whole sequence's mask, at offsets 0 (as the Burn plugin's
    /// `FlashAttentionOptions::mask` gives it). Pairs
    /// of shards with no visible score are not scheduled, and steps left empty are dropped.
    /// Every rank derives the same schedule from the same mask, so each must hold the
    /// documents of the whole sequence, not of its shard. Without a window or documents this
    /// is [`Schedule::new`] (causal order is decided per chunk).
    ///
    /// Work under a window or documents is the exact count of visible scores (see
    /// [`visibility`](crate::visibility)), in units of one full pair of shards, averaged over the
    /// documents' batch rows; a pair is visible when any batch row sees a score of it.
    ///
    /// # Errors
    ///
    /// - [`ScheduleError::Layout`] when `world` or `shard_len` is zero, or `shard_len` is odd
    ///   under the zigzag layout.
    /// - [`ScheduleError::BadMask`] when the mask's offsets are not 0, or its documents do not
    ///   cover exactly the `world * shard_len` positions of the sequence.
    pub fn for_mask(
        kind: ScheduleKind,
        world: usize,
        shard_len: usize,
        mask: &Mask,
    ) -> Result<Self, ScheduleError> {
        let kind = kind.resolve_for(world, shard_len, mask);
        let layout = kind.layout();
        layout.check_shard_len(world, shard_len)?;
        mask.check_sequence(world * shard_len)?;
        let visibility = if mask.window.is_none() && mask.documents.is_none() {
            Visibility::Chunks {
                causal: mask.causal,
            }
        } else {
            Visibility::Positions {
                mask: mask.clone(),
                chunk: shard_len / layout.chunks_per_rank(),
            }
        };
        Ok(Self::build(kind, world, visibility))
    }

    /// The rule's table with the pairs that hold no visible score, and then empty steps,
    /// removed.
    fn build(kind: ScheduleKind, world: usize, visibility: Visibility) -> Self {
        let causal = visibility.causal();
        let kind = kind.resolve(world, causal);
        let layout = kind.layout();
        let (steps, pair): (usize, PairFn) = match kind {
            ScheduleKind::Balanced => (
                balanced::Balanced::num_steps(world, causal),
                balanced::Balanced::pair,
            ),
            ScheduleKind::Zigzag => (
                zigzag::Zigzag::num_steps(world, causal),
                zigzag::Zigzag::pair,
            ),
            _ => (ring::Ring::num_steps(world, causal), ring::Ring::pair),
        };
        let mut blocks = BTreeMap::new();
        let mut pairs = Vec::with_capacity(steps);
        for step in 0..steps {
            let row: Vec<Option<Pair>> = (0..world)
                .map(|rank| {
                    let p = pair(world, causal, rank, step)?;
                    let calls = blocks::blocks(layout, world, &visibility, p);
                    if calls.is_empty() {
                        return None;
                    }
                    blocks.insert(p, calls);
                    Some(p)
                })
                .collect();
            if row.iter().any(Option::is_some) {
                pairs.push(row);
            }
        }
        Self {
            kind,
            layout,
            world,
            visibility,
            pairs,
            blocks,
        }
    }

    /// Where the shards' positions are.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// The step calls computing `pair` (see [`blocks`](crate::blocks)); none when no score of it
    /// is visible.
    pub fn blocks(&self, pair: Pair) -> Vec<Block> {
        match self.blocks.get(&pair) {
            Some(calls) => calls.clone(),
            None => blocks::blocks(self.layout, self.world, &self.visibility, pair),
        }
    }

    /// The chunk pairs of `pair` with a visible score, one step call each, with its mask: a
    /// call of one query chunk against one key/value chunk (local indices), so a pass that
    /// keeps each chunk of a shard as a tensor of its own computes every call on whole
    /// tensors. They compute what [`blocks`](Self::blocks) does (one call per chunk pair
    /// instead of as few as the grid allows); none when no score of the pair is visible. Under
    /// the contiguous layout (one chunk per rank) they are the blocks.
    pub fn cells(&self, pair: Pair) -> Vec<Block> {
        blocks::cells(self.layout, self.world, &self.visibility, pair)
    }

    /// Work of `pair` in units of one full pair of shards.
    pub fn pair_cost(&self, pair: Pair) -> f64 {
        let per_rank = self.layout.chunks_per_rank() as f64;
        let chunk_pairs: f64 = self.blocks(pair).iter().map(|b| b.cost).sum();
        chunk_pairs / (per_rank * per_rank)
    }

    /// The concrete kind (never `Auto`).
    pub fn kind(&self) -> ScheduleKind {
        self.kind
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// Whether the attention is causal.
    pub fn causal(&self) -> bool {
        self.visibility.causal()
    }

    /// Number of steps (those of the rule that compute something).
    pub fn num_steps(&self) -> usize {
        self.pairs.len()
    }

    /// The pair `rank` computes at `step`.
    pub fn pair(&self, rank: usize, step: usize) -> Option<Pair> {
        self.pairs[step][rank]
    }

    /// What `rank` computes, sends and receives at `step`.
    pub fn rank_step(&self, rank: usize, step: usize) -> RankStep {
        RankStep::derive(&self.pairs[step], rank)
    }

    /// Time of the schedule in units of one full pair of shards: each step lasts as long as its
    /// most expensive pair (communication counted as free).
    pub fn time(&self) -> f64 {
        self.pairs
            .iter()
            .map(|step| {
                step.iter()
                    .flatten()
                    .map(|&p| self.pair_cost(p))
                    .fold(0.0, f64::max)
            })
            .sum()
    }

    /// Speedup over one device computing every pair, counting communication as free.
    pub fn ideal_speedup(&self) -> f64 {
        let work: f64 = self
            .pairs
            .iter()
            .flatten()
            .flatten()
            .map(|&p| self.pair_cost(p))
            .sum();
        work / self.time()
    }

    /// Idle (rank, step) slots over `P²`, the paper's normalisation (`P²` is the ring's slot
    /// count): `(P² - P) / 2P²` for the causal ring, `1 / 2P` for the balanced schedule with
    /// even `P` and 0 for odd `P`, 0 for zigzag. Under a window or documents, the idle slots of
    /// the steps left.
    pub fn idle_fraction(&self) -> f64 {
        let idle = self.pairs.iter().flatten().filter(|p| p.is_none()).count();
        idle as f64 / (self.world * self.world) as f64
    }
}
