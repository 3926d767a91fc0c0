//! Schedules of sequence-parallel attention: pure logic, apart from execution.
//!
//! `P` ranks each own one contiguous chunk of the sequence (rank `r` owns chunk `r`: its query,
//! key and value rows). Causal attention needs every pair (query chunk `i`, key/value chunk `j`)
//! with `j <= i`; the diagonal pairs are causally masked, the others fully visible. A schedule
//! says, for every rank and step, which pair that rank computes; [`RankStep`] derives what it
//! must then send and receive. Each schedule is one file implementing [`ScheduleRule`]:
//! [`ring`] (the paper's Algorithm 1) and [`balanced`] (Algorithm 2, helper workers).

pub mod balanced;
mod plan;
pub mod ring;

use serde::{Deserialize, Serialize};

pub use plan::RankStep;

/// One unit of attention work: query chunk `query` against key/value chunk `kv`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Pair {
    /// The query chunk (its owner holds the output rows).
    pub query: usize,
    /// The key/value chunk.
    pub kv: usize,
}

impl Pair {
    /// The chunk against itself (causally masked when the attention is causal).
    pub fn is_diagonal(&self) -> bool {
        self.query == self.kv
    }

    /// Relative cost: a causal diagonal pair computes half the scores of a full one.
    pub fn cost(&self, causal: bool) -> f64 {
        if causal && self.is_diagonal() {
            0.5
        } else {
            1.0
        }
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

/// Which schedule to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum ScheduleKind {
    /// Balanced for causal attention, ring otherwise (where the ring is already balanced).
    #[default]
    Auto,
    /// Every rank fetches key/value chunks from the ranks before it (paper Alg. 1).
    Ring,
    /// Ranks that run out of work compute for later ranks (paper Alg. 2).
    Balanced,
}

impl ScheduleKind {
    /// The concrete schedule `Auto` means for this attention.
    pub fn resolve(self, causal: bool) -> ScheduleKind {
        match self {
            ScheduleKind::Auto if causal => ScheduleKind::Balanced,
            ScheduleKind::Auto => ScheduleKind::Ring,
            kind => kind,
        }
    }
}

/// A materialised schedule: the pair of every rank at every step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    kind: ScheduleKind,
    world: usize,
    causal: bool,
    /// `pairs[step][rank]`.
    pairs: Vec<Vec<Option<Pair>>>,
}

impl Schedule {
    /// The schedule `kind` for `world >= 1` ranks.
    pub fn new(kind: ScheduleKind, world: usize, causal: bool) -> Self {
        assert!(world >= 1, "a schedule needs at least one rank");
        let kind = kind.resolve(causal);
        let (steps, pair): (usize, PairFn) = match kind {
            ScheduleKind::Balanced => (
                balanced::Balanced::num_steps(world, causal),
                balanced::Balanced::pair,
            ),
            _ => (ring::Ring::num_steps(world, causal), ring::Ring::pair),
        };
        let pairs = (0..steps)
            .map(|step| {
                (0..world)
                    .map(|rank| pair(world, causal, rank, step))
                    .collect()
            })
            .collect();
        Self {
            kind,
            world,
            causal,
            pairs,
        }
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
        self.causal
    }

    /// Number of steps.
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

    /// Time of the schedule in units of one full chunk pair: each step lasts as long as its
    /// most expensive pair.
    pub fn time(&self) -> f64 {
        self.pairs
            .iter()
            .map(|step| {
                step.iter()
                    .flatten()
                    .map(|p| p.cost(self.causal))
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
            .map(|p| p.cost(self.causal))
            .sum();
        work / self.time()
    }

    /// Idle (rank, step) slots over `P²`, the paper's normalisation (`P²` is the ring's slot
    /// count): `(P² - P) / 2P²` for the causal ring, `1 / 2P` for the balanced schedule with
    /// even `P` and 0 for odd `P`.
    pub fn idle_fraction(&self) -> f64 {
        let idle = self.pairs.iter().flatten().filter(|p| p.is_none()).count();
        idle as f64 / (self.world * self.world) as f64
    }
}
