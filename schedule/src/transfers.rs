//! The messages between the ranks: what one rank sends and receives at one step, derived from
//! the step's pairs ([`RankStep`]), and what a message carries ([`MessageKind`]).

use crate::Pair;

/// One rank's part of one step. Chunk `c` is owned by rank `c`.
///
/// Inputs travel before the step: the key/value chunk to the rank computing with it, and, for a
/// helper, the query chunk (forward: `q`; backward: `q, dO, lse, delta`). Results travel after
/// the step to the owner of the chunk they belong to: a helper's partial `(o, m, l)` (forward)
/// or `dq` (backward) to the query's owner, and `dk, dv` (backward) to the key/value owner.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RankStep {
    /// The pair this rank computes, if any.
    pub compute: Option<Pair>,
    /// Owner of the key/value chunk this rank receives (when it is not its own).
    pub kv_from: Option<usize>,
    /// Owner of the query chunk this rank receives (when it is not its own).
    pub query_from: Option<usize>,
    /// Ranks that receive this rank's key/value chunk (and return `dk, dv` in the backward).
    pub kv_to: Vec<usize>,
    /// Ranks that receive this rank's query chunk (and return its partial or `dq`).
    pub query_to: Vec<usize>,
}

impl RankStep {
    /// `rank`'s part of a step whose pairs are `pairs[r]` for each rank `r`.
    pub fn derive(pairs: &[Option<Pair>], rank: usize) -> Self {
        let compute = pairs[rank];
        let others = || {
            pairs
                .iter()
                .enumerate()
                .filter(move |&(r, _)| r != rank)
                .filter_map(|(r, p)| p.map(|p| (r, p)))
        };
        Self {
            compute,
            kv_from: compute.map(|p| p.kv).filter(|&kv| kv != rank),
            query_from: compute.map(|p| p.query).filter(|&q| q != rank),
            kv_to: others()
                .filter(|(_, p)| p.kv == rank)
                .map(|(r, _)| r)
                .collect(),
            query_to: others()
                .filter(|(_, p)| p.query == rank)
                .map(|(r, _)| r)
                .collect(),
        }
    }

    /// The rank to send this step's query-side result to (a helper's partial or `dq`).
    pub fn query_result_to(&self) -> Option<usize> {
        self.query_from
    }

    /// The rank to send this step's `dk, dv` to (backward).
    pub fn kv_result_to(&self) -> Option<usize> {
        self.kv_from
    }
}

/// What a message between the ranks carries; a receiver checks that it gets the kind it expects.
/// The first six are a step's messages ([`RankStep`]), the last three the collectives' (the Burn
/// plugin's `collective::Transport`).
///
/// A step's message is a flat list of tensors. The forward sends each of a shard's tensors
/// whole; the backward keeps a shard as its [`Layout`](crate::Layout)'s chunks and sends each
/// tensor as its chunks, one after the other (`[k, v]` is `[k_0, k_1, v_0, v_1]` under zigzag,
/// `[k, v]` under the contiguous layout's one chunk).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MessageKind {
    /// A key/value shard: `[k, v]` (forward: whole; backward: each as its chunks).
    KeyValue,
    /// A query shard for a helper's forward: `[q]`.
    Query,
    /// A helper's partial forward result, f32: `[o, m, l]`.
    PartialState,
    /// A query shard for a backward step: `[q, dO, lse, delta]`, each as its chunks.
    QueryBundle,
    /// Query gradient computed elsewhere, f32: `[dq]`, as its chunks.
    QueryGrad,
    /// Key/value gradients computed elsewhere, f32: `[dk, dv]`, each as its chunks.
    KeyValueGrad,
    /// Small host values every rank gathers (the ranks' agreement on a call).
    Values,
    /// A chunk of a tensor summed over the group (an all-reduce or a reduce-scatter).
    Reduction,
    /// A rank's share of a tensor gathered by every rank (an all-gather, and the second half of
    /// an all-reduce).
    Gathered,
}
