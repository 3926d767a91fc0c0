//! The distributed backward: each rank computes `(dq, dk, dv)` for the pairs its schedule
//! assigns, from the forward's lse and `delta = rowsum(dO * O)`, and returns the gradients that
//! belong to other ranks' chunks to their owners. Gradients are accumulated in f32, and each step
//! is handed the accumulators themselves (never a second handle on them), so the kernel backends
//! add into them in place.

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
    /// This rank's f32 accumulators of `dq, dk, dv`; each is `None` only while a step adds
    /// into it.
    dq: Option<FloatTensor<B>>,
    dk: Option<FloatTensor<B>>,
    dv: Option<FloatTensor<B>>,
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

/// The accumulator in `slot`, moved out (the pass holds no other handle on it while a step or
/// a sum writes it).
fn take<B: FlashAttentionBackend>(slot: &mut Option<FloatTensor<B>>) -> FloatTensor<B> {
    slot.take()
        .expect("the rank's accumulator is back after each step")
}

/// The accumulator in `slot` (for its layout).
fn held<B: FlashAttentionBackend>(slot: &Option<FloatTensor<B>>) -> FloatTensor<B> {
    slot.clone()
        .expect("the rank's accumulator is back after each step")
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
        // This rank's own accumulators where a side is its own (moved, not cloned: the step
        // adds into them in place), fresh ones for the other side.
        let acc = (
            if own_query {
                take::<B>(&mut self.dq)
            } else {
                zeros_like::<B>(&q)
            },
            if own_kv {
                take::<B>(&mut self.dk)
            } else {
                zeros_like::<B>(&k)
            },
            if own_kv {
                take::<B>(&mut self.dv)
            } else {
                zeros_like::<B>(&v)
            },
        );
        let (dq, dk, dv) =
            backward_pair::<B>(query, [&k, &v], acc, &blocks, self.chunks, &self.options);
        let mut results = Vec::new();
        if own_query {
            self.dq = Some(dq);
        } else {
            results.push(outgoing(pair.query, MessageKind::QueryGrad, &[dq]));
        }
        if own_kv {
            self.dk = Some(dk);
            self.dv = Some(dv);
        } else {
            results.push(outgoing(pair.kv, MessageKind::KeyValueGrad, &[dk, dv]));
        }
        results
    }

    fn result_receives(&self, plan: &RankStep) -> Vec<Incoming> {
        let dq = [held::<B>(&self.dq)];
        let dkv = [held::<B>(&self.dk), held::<B>(&self.dv)];
        (plan.query_to.iter())
            .map(|&p| incoming::<B>(p, MessageKind::QueryGrad, &dq))
            .chain((plan.kv_to.iter()).map(|&p| incoming::<B>(p, MessageKind::KeyValueGrad, &dkv)))
            .collect()
    }

    fn absorb(&mut self, results: Vec<Received<B>>) {
        for message in results {
            let mut t = message.tensors.into_iter();
            if message.kind == MessageKind::QueryGrad {
                self.dq = Some(B::float_add(take::<B>(&mut self.dq), t.next().expect("dq")));
            } else {
                self.dk = Some(B::float_add(take::<B>(&mut self.dk), t.next().expect("dk")));
                self.dv = Some(B::float_add(take::<B>(&mut self.dv), t.next().expect("dv")));
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
        dq: Some(zeros_like::<B>(&q)),
        dk: Some(zeros_like::<B>(&k)),
        dv: Some(zeros_like::<B>(&v)),
        kv: [k, v],
        query: [q, grad_out, lse, delta],
        schedule: schedule.clone(),
        chunks,
        options: options.clone(),
    };
    pipeline::run(group, schedule, &mut pass, options.overlap)?;
    Ok((
        cast::<B>(take::<B>(&mut pass.dq), dtype),
        cast::<B>(take::<B>(&mut pass.dk), dtype),
        cast::<B>(take::<B>(&mut pass.dv), dtype),
    ))
}
