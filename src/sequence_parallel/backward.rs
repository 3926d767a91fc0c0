//! The distributed backward: each rank computes `(dq, dk, dv)` for the pairs its schedule
//! assigns, from the forward's lse and `delta = rowsum(dO * O)`, and returns the gradients that
//! belong to other ranks' chunks to their owners. Gradients are accumulated in f32.

use crate::Error;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, FloatDType, TensorMetadata};

use super::pair_steps::{backward_pair, Chunks};
use super::pipeline::{self, incoming, input_messages, outgoing, step_operands, Pass};
use crate::collective::{DeviceGroup, Incoming, MessageKind, Outgoing, Received};
use crate::extension::{FlashAttentionBackend, Grads};
use crate::options::SequenceParallelOptions;
use crate::schedule::{RankStep, Schedule};

/// One rank's backward: its chunks, the query-side bundle, and f32 gradient accumulators.
struct BackwardPass<B: FlashAttentionBackend> {
    rank: usize,
    /// `[k, v]`.
    kv: [FloatTensor<B>; 2],
    /// `[q, dO, lse, delta]`.
    query: [FloatTensor<B>; 4],
    dq: FloatTensor<B>,
    dk: FloatTensor<B>,
    dv: FloatTensor<B>,
    schedule: Schedule,
    chunks: Chunks,
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

fn zeros_like<B: FlashAttentionBackend>(t: &FloatTensor<B>) -> FloatTensor<B> {
    B::float_zeros(t.shape(), &B::float_device(t), FloatDType::F32)
}

impl<B: FlashAttentionBackend> Pass<B> for BackwardPass<B> {
    fn inputs(&self, plan: &RankStep) -> (Vec<Outgoing<B>>, Vec<Incoming>) {
        input_messages(plan, &self.kv, &self.query, MessageKind::QueryBundle)
    }

    fn compute(&mut self, plan: &RankStep, inputs: Vec<Received<B>>) -> Vec<Outgoing<B>> {
        let Some(pair) = plan.compute else {
            return Vec::new();
        };
        let (kv, query) = step_operands(&self.kv, &self.query, inputs);
        let [k, v]: [FloatTensor<B>; 2] = kv.try_into().expect("k, v");
        let [q, grad_out, lse, delta]: [FloatTensor<B>; 4] =
            query.try_into().expect("q, dO, lse, delta");
        let blocks = self.schedule.blocks(pair);
        let query = [&q, &grad_out, &lse, &delta];
        let (own_query, own_kv) = (pair.query == self.rank, pair.kv == self.rank);
        // This rank's own accumulators where a side is its own, fresh ones for the other side.
        let acc = (
            if own_query {
                self.dq.clone()
            } else {
                zeros_like::<B>(&q)
            },
            if own_kv {
                self.dk.clone()
            } else {
                zeros_like::<B>(&k)
            },
            if own_kv {
                self.dv.clone()
            } else {
                zeros_like::<B>(&v)
            },
        );
        let (dq, dk, dv) =
            backward_pair::<B>(query, [&k, &v], acc, &blocks, self.chunks, &self.options);
        let mut results = Vec::new();
        if own_query {
            self.dq = dq;
        } else {
            results.push(outgoing(pair.query, MessageKind::QueryGrad, &[dq]));
        }
        if own_kv {
            self.dk = dk;
            self.dv = dv;
        } else {
            results.push(outgoing(pair.kv, MessageKind::KeyValueGrad, &[dk, dv]));
        }
        results
    }

    fn result_receives(&self, plan: &RankStep) -> Vec<Incoming> {
        let dq = [self.dq.clone()];
        let dkv = [self.dk.clone(), self.dv.clone()];
        (plan.query_to.iter())
            .map(|&p| incoming::<B>(p, MessageKind::QueryGrad, &dq))
            .chain((plan.kv_to.iter()).map(|&p| incoming::<B>(p, MessageKind::KeyValueGrad, &dkv)))
            .collect()
    }

    fn absorb(&mut self, results: Vec<Received<B>>) {
        for message in results {
            let mut t = message.tensors.into_iter();
            if message.kind == MessageKind::QueryGrad {
                self.dq = B::float_add(self.dq.clone(), t.next().expect("dq"));
            } else {
                self.dk = B::float_add(self.dk.clone(), t.next().expect("dk"));
                self.dv = B::float_add(self.dv.clone(), t.next().expect("dv"));
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
    let chunks = Chunks::new(schedule.layout().chunks_per_rank(), shard_len);
    let delta = B::attention_delta(out, grad_out.clone());
    let mut pass = BackwardPass {
        rank: group.rank(),
        dq: zeros_like::<B>(&q),
        dk: zeros_like::<B>(&k),
        dv: zeros_like::<B>(&v),
        kv: [k, v],
        query: [q, grad_out, lse, delta],
        schedule: schedule.clone(),
        chunks,
        options: options.clone(),
    };
    pipeline::run(group, schedule, &mut pass, options.overlap)?;
    Ok((
        cast::<B>(pass.dq, dtype),
        cast::<B>(pass.dk, dtype),
        cast::<B>(pass.dv, dtype),
    ))
}
