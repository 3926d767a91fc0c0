//! The distributed forward: each rank's running state over the key/value chunks its schedule
//! assigns, helpers' partials merged in, then finalised to `(O, lse)`.

use crate::Error;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, TensorMetadata};

use super::pair_steps::{forward_pair, Chunks};
use super::pipeline::{self, input_messages, outgoing, step_operands, Pass, Stage};
use crate::collective::{DeviceGroup, Incoming, MessageKind, Outgoing, Received, TensorLayout};
use crate::extension::FlashAttentionBackend;
use crate::options::SequenceParallelOptions;
use crate::schedule::Schedule;
use crate::step::AttentionState;

/// One rank's forward: its own chunks and its running state.
struct ForwardPass<B: FlashAttentionBackend> {
    rank: usize,
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    /// `None` until the first fold or partial arrives: the empty state, never materialised (the
    /// first fold writes a new state, the first partial becomes the state).
    state: Option<AttentionState<B>>,
    state_layouts: Vec<TensorLayout>,
    schedule: Schedule,
    chunks: Chunks,
    options: SequenceParallelOptions,
}

impl<B: FlashAttentionBackend> ForwardPass<B> {
    /// The layouts of a running state of this rank's query rows (as partials arrive in).
    fn state_layouts(q: &FloatTensor<B>) -> Vec<TensorLayout> {
        let [b, h, s, d]: [usize; 4] = q.shape().dims();
        let dtype = B::lse_dtype(q.dtype());
        [vec![b, h, s, d], vec![b, h, s], vec![b, h, s]]
            .into_iter()
            .map(|shape| TensorLayout { shape, dtype })
            .collect()
    }
}

impl<B: FlashAttentionBackend> Pass<B> for ForwardPass<B> {
    fn inputs(&self, stage: &Stage) -> (Vec<Outgoing<B>>, Vec<Incoming>) {
        let kv = [self.k.clone(), self.v.clone()];
        input_messages(
            &stage.plan,
            &kv,
            std::slice::from_ref(&self.q),
            MessageKind::Query,
        )
    }

    fn compute(&mut self, stage: &Stage, inputs: Vec<Received<B>>) -> Vec<Outgoing<B>> {
        let Some(pair) = stage.plan.compute else {
            return Vec::new();
        };
        let own_kv = [self.k.clone(), self.v.clone()];
        let (kv, query) = step_operands(&own_kv, std::slice::from_ref(&self.q), inputs);
        let [k, v]: [FloatTensor<B>; 2] = kv.try_into().expect("k, v");
        let [q]: [FloatTensor<B>; 1] = query.try_into().expect("q");
        let blocks = self.schedule.blocks(pair);
        let (chunks, options) = (self.chunks, self.options.clone());
        let fold = |state| forward_pair([&q, &k, &v], state, &blocks, chunks, &options);
        if pair.query == self.rank {
            self.state = Some(fold(self.state.take()));
            return Vec::new();
        }
        // Helper work: a partial for the query's owner, from the empty state.
        let partial = fold(None);
        let tensors = [partial.o, partial.m, partial.l];
        vec![outgoing(pair.query, MessageKind::PartialState, &tensors)]
    }

    fn result_receives(&self, stage: &Stage) -> Vec<Incoming> {
        (stage.plan.query_to)
            .iter()
            .map(|&peer| Incoming {
                peer,
                kind: MessageKind::PartialState,
                layouts: self.state_layouts.clone(),
            })
            .collect()
    }

    fn absorb(&mut self, _stage: &Stage, results: Vec<Received<B>>) {
        for message in results {
            let mut t = message.tensors.into_iter();
            let partial = AttentionState {
                o: t.next().expect("o"),
                m: t.next().expect("m"),
                l: t.next().expect("l"),
            };
            self.state = Some(match self.state.take() {
                Some(state) => B::attention_merge(state, partial),
                None => partial,
            });
        }
    }
}

/// `(O, lse)` of this rank's query shard against the whole sequence (validated inputs), on a
/// backend that computes and communicates itself.
pub(crate) fn run<B: FlashAttentionBackend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    group: &DeviceGroup<B>,
    options: &SequenceParallelOptions,
) -> Result<(FloatTensor<B>, FloatTensor<B>), Error> {
    let dtype: DType = q.dtype();
    let shard_len = q.shape().dims::<4>()[2];
    let schedule = &options.schedule_for(group.world_size(), shard_len)?;
    let chunks = Chunks::new(schedule.layout().chunks_per_rank(), shard_len);
    let state_layouts = ForwardPass::<B>::state_layouts(&q);
    let mut pass = ForwardPass {
        rank: group.rank(),
        q,
        k,
        v,
        state: None,
        state_layouts,
        schedule: schedule.clone(),
        chunks,
        options: options.clone(),
    };
    // The forward never cuts the key/value shards: one stage per step.
    let stages = pipeline::stages(schedule, group.rank(), 1);
    pipeline::run(group, &stages, &mut pass, options.overlap)?;
    // Every schedule folds each rank's diagonal, so the state exists; a world that folded
    // nothing would finalise the empty state (zero output, lse -inf).
    let state = pass.state.unwrap_or_else(|| {
        let shape: [usize; 4] = pass.q.shape().dims();
        B::attention_state_empty(shape, dtype, &B::float_device(&pass.q))
    });
    Ok(B::attention_finalize(state, dtype))
}
