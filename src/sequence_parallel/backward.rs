//! The distributed backward: each rank computes `(dq, dk, dv)` for the pairs its schedule
//! assigns, from the forward's lse and `delta = rowsum(dO * O)`, and returns the gradients that
//! belong to other ranks' chunks to their owners.
//!
//! A rank's shard stays cut into its layout's chunks for the whole pass (one chunk under the
//! contiguous layout, two under zigzag): q, dO, lse, delta, k, v and the f32 accumulators of
//! `dq, dk, dv` are one tensor per chunk, and so are the messages. Every step call is one
//! visible chunk pair ([`Schedule::cells`]) on whole tensors, and each call is handed the
//! accumulators themselves (never a second handle on them), so the kernel backends add into
//! them in place and nothing is sliced or copied between calls. The inputs are cut on entry,
//! one at a time (each whole shard goes as its chunks are made), and the gradients joined on
//! exit.
//!
//! With [`SequenceParallelOptions::backward_parts`] above 1, another rank's key/value shard is
//! streamed in row parts ([`KvParts`]): each step is that many stages, and at each a rank
//! computing with a remote shard receives one part of every chunk, runs its cells restricted to
//! the part (the mask's key offset moved to the part's rows, parts no query sees skipped), adds
//! into fresh f32 `dk, dv` of the part's rows and returns them; the owner adds them into those
//! rows of its accumulators. The pair's `dq` accumulates across the parts; a pair on the rank's
//! own shards (its diagonal, a helper's) runs whole at the first part, and helpers' query
//! bundles travel with it.

use std::mem;

use crate::Error;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, FloatDType, TensorMetadata};

use super::kv_parts::KvParts;
use super::pair_steps::{backward_pair, ChunkGrads};
use super::pipeline::{self, incoming, input_messages, outgoing, step_operands, Pass, Stage};
use crate::collective::{DeviceGroup, Incoming, MessageKind, Outgoing, Received};
use crate::extension::{FlashAttentionBackend, Grads};
use crate::options::SequenceParallelOptions;
use crate::schedule::{RankStep, Schedule};

/// One rank's backward: its inputs and its f32 gradient accumulators, each as its shard's chunks.
struct BackwardPass<B: FlashAttentionBackend> {
    rank: usize,
    /// Chunks per shard.
    chunks: usize,
    /// `[k.., v..]`, each by chunk: the key/value message.
    kv: Vec<FloatTensor<B>>,
    /// `[q.., dO.., lse.., delta..]`, each by chunk: the query bundle.
    query: Vec<FloatTensor<B>>,
    /// This rank's accumulators; a side's are empty only while a step adds into them.
    grads: ChunkGrads<B>,
    /// The row parts in which another rank's key/value shard is streamed.
    parts: KvParts,
    schedule: Schedule,
    options: SequenceParallelOptions,
}

/// `t` as float type `dtype` (itself when it already is).
fn cast<B: FlashAttentionBackend>(t: FloatTensor<B>, dtype: DType) -> FloatTensor<B> {
    if t.dtype() == dtype {
        t
    } else {
        B::float_cast(t, dtype.into())
    }
}

/// Fresh f32 zeros shaped like each of `chunks`.
fn zeros_like<B: FlashAttentionBackend>(chunks: &[FloatTensor<B>]) -> Vec<FloatTensor<B>> {
    (chunks.iter())
        .map(|t| B::float_zeros(t.shape(), &B::float_device(t), FloatDType::F32))
        .collect()
}

/// A message's tensors, `N` kinds one after the other, each as `chunks` chunks: one slice per
/// kind.
fn by_kind<const N: usize, T>(flat: &[T], chunks: usize) -> [&[T]; N] {
    let mut kinds = flat.chunks_exact(chunks);
    core::array::from_fn(|_| kinds.next().expect("a message holds every kind's chunks"))
}

/// `received` chunks added into the accumulator chunks `acc` (in place where the backend
/// allows: the pass holds them alone).
fn add_chunks<B: FlashAttentionBackend>(
    acc: &mut Vec<FloatTensor<B>>,
    received: impl Iterator<Item = FloatTensor<B>>,
) {
    *acc = (mem::take(acc).into_iter().zip(received))
        .map(|(a, r)| B::float_add(a, r))
        .collect();
}

/// The whole shard of a gradient from its f32 chunks, in float type `dtype` (each chunk cast
/// first, so the join makes the shard in `dtype` only).
fn join<B: FlashAttentionBackend>(chunks: Vec<FloatTensor<B>>, dtype: DType) -> FloatTensor<B> {
    let mut parts: Vec<_> = chunks.into_iter().map(|c| cast::<B>(c, dtype)).collect();
    match parts.len() {
        1 => parts.pop().expect("one chunk"),
        _ => B::float_cat(parts, 2),
    }
}

impl<B: FlashAttentionBackend> Pass<B> for BackwardPass<B> {
    fn inputs(&self, stage: &Stage) -> (Vec<Outgoing<B>>, Vec<Incoming>) {
        // The key/value shard travels part by part; a helper's query bundle with the first.
        let kv = self.parts.slice::<B>(&self.kv, stage.part);
        let plan = match stage.part {
            0 => stage.plan.clone(),
            _ => RankStep {
                query_to: Vec::new(),
                query_from: None,
                ..stage.plan.clone()
            },
        };
        input_messages(&plan, &kv, &self.query, MessageKind::QueryBundle)
    }

    fn compute(&mut self, stage: &Stage, inputs: Vec<Received<B>>) -> Vec<Outgoing<B>> {
        let Some(pair) = stage.plan.compute else {
            return Vec::new();
        };
        let (own_query, own_kv) = (pair.query == self.rank, pair.kv == self.rank);
        // A pair on this rank's own key/value shard runs whole, at its step's first part.
        if own_kv && stage.part > 0 {
            return Vec::new();
        }
        assert!(
            own_query || own_kv,
            "every schedule has a rank compute with its own queries or its own keys"
        );
        let (kv, query) = step_operands(&self.kv, &self.query, inputs);
        let [k, v] = by_kind::<2, _>(&kv, self.chunks);
        let query = by_kind::<4, _>(&query, self.chunks);
        // This rank's own accumulators where a side is its own (moved, not cloned: the steps
        // add into them in place), fresh ones (of the received part's rows) for the other side.
        let acc = ChunkGrads {
            dq: match own_query {
                true => mem::take(&mut self.grads.dq),
                false => zeros_like::<B>(query[0]),
            },
            dk: match own_kv {
                true => mem::take(&mut self.grads.dk),
                false => zeros_like::<B>(k),
            },
            dv: match own_kv {
                true => mem::take(&mut self.grads.dv),
                false => zeros_like::<B>(v),
            },
        };
        let cells = self.schedule.cells(pair);
        let cells = match own_kv {
            true => cells,
            false => (self.parts).cells(&cells, stage.part, query[0][0].shape()[0]),
        };
        let grads = backward_pair::<B>(query, [k, v], acc, &cells, &self.options);
        let mut results = Vec::new();
        if own_query {
            self.grads.dq = grads.dq;
        } else {
            results.push(outgoing(pair.query, MessageKind::QueryGrad, &grads.dq));
        }
        if own_kv {
            self.grads.dk = grads.dk;
            self.grads.dv = grads.dv;
        } else {
            let dkv: Vec<_> = grads.dk.into_iter().chain(grads.dv).collect();
            results.push(outgoing(pair.kv, MessageKind::KeyValueGrad, &dkv));
        }
        results
    }

    fn result_receives(&self, stage: &Stage) -> Vec<Incoming> {
        let ChunkGrads { dq, dk, dv } = &self.grads;
        let query_to = match stage.part {
            0 => &stage.plan.query_to[..],
            _ => &[],
        };
        (query_to.iter())
            .map(|&p| incoming::<B>(p, MessageKind::QueryGrad, dq))
            .chain((stage.plan.kv_to.iter()).map(|&peer| Incoming {
                peer,
                kind: MessageKind::KeyValueGrad,
                layouts: self.parts.layouts::<B>(dk.iter().chain(dv)),
            }))
            .collect()
    }

    fn absorb(&mut self, stage: &Stage, results: Vec<Received<B>>) {
        for message in results {
            let mut received = message.tensors.into_iter();
            let n = self.chunks;
            if message.kind == MessageKind::QueryGrad {
                add_chunks::<B>(&mut self.grads.dq, received.by_ref().take(n));
            } else {
                let part = stage.part;
                (self.parts).add_into::<B>(&mut self.grads.dk, part, received.by_ref().take(n));
                (self.parts).add_into::<B>(&mut self.grads.dv, part, received.by_ref().take(n));
            }
        }
    }
}

/// `(dq, dk, dv)` of this rank's shards, in the inputs' float type, from the forward's O and lse
/// and the output gradient (inputs validated by the forward).
#[allow(clippy::too_many_arguments)]
pub(crate) fn run<B: FlashAttentionBackend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    grad_out: FloatTensor<B>,
    group: &DeviceGroup<B>,
    options: &SequenceParallelOptions,
) -> Result<Grads<B>, Error> {
    let dtype = q.dtype();
    let shard_len = q.shape().dims::<4>()[2];
    let schedule = &options.schedule_for(group.world_size(), shard_len)?;
    let chunks = schedule.layout().chunks_per_rank();
    let delta = B::attention_delta(out, grad_out.clone());
    // Cut one input at a time, each moved in, so at most one whole shard is held beside its
    // chunks.
    let cut = |kinds: Vec<FloatTensor<B>>| -> Vec<FloatTensor<B>> {
        (kinds.into_iter())
            .flat_map(|t| B::attention_chunks(t, chunks))
            .collect()
    };
    let kv = cut(vec![k, v]);
    let query = cut(vec![q, grad_out, lse, delta]);
    let grads = ChunkGrads {
        dq: zeros_like::<B>(&query[..chunks]),
        dk: zeros_like::<B>(&kv[..chunks]),
        dv: zeros_like::<B>(&kv[chunks..]),
    };
    let mut pass = BackwardPass {
        rank: group.rank(),
        chunks,
        kv,
        query,
        grads,
        parts: KvParts {
            count: options.backward_parts,
            chunk_len: shard_len / chunks,
        },
        schedule: schedule.clone(),
        options: options.clone(),
    };
    let stages = pipeline::stages(schedule, group.rank(), options.backward_parts);
    pipeline::run(group, &stages, &mut pass, options.overlap)?;
    // The inputs go before the gradients are joined.
    let BackwardPass {
        kv, query, grads, ..
    } = pass;
    drop((kv, query));
    let ChunkGrads { dq, dk, dv } = grads;
    Ok((
        join::<B>(dq, dtype),
        join::<B>(dk, dtype),
        join::<B>(dv, dtype),
    ))
}
