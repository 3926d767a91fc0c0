//! The step loop shared by the distributed forward and backward: inputs of the next stage travel
//! while the current stage computes, results travel back while the next stage computes. A stage
//! is a schedule step, or one row part of it where the backward streams another rank's key/value
//! shard in parts (see [`super::kv_parts`]).

use crate::Error;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;

use crate::collective::{
    DeviceGroup, Exchange, Incoming, MessageKind, Outgoing, Received, TensorLayout,
};
use crate::schedule::{RankStep, Schedule};

/// One round of exchanges and computation: this rank's part of a schedule step, and which of
/// the step's `parts` row parts of the key/value shards it moves (always 0 of 1 in the forward).
#[derive(Debug, Clone)]
pub(crate) struct Stage {
    /// This rank's messages and pair at the step.
    pub plan: RankStep,
    /// The row part of the key/value shards this stage moves.
    pub part: usize,
}

/// Every stage of `schedule` for `rank`, in order: each step as `parts` stages, one per row
/// part (every rank runs the same number, so their exchanges stay matched).
pub(crate) fn stages(schedule: &Schedule, rank: usize, parts: usize) -> Vec<Stage> {
    (0..schedule.num_steps())
        .flat_map(|step| {
            let plan = schedule.rank_step(rank, step);
            (0..parts).map(move |part| Stage {
                plan: plan.clone(),
                part,
            })
        })
        .collect()
}

/// What a pass does at each stage; the [`run`] loop moves the messages.
pub(crate) trait Pass<B: Backend> {
    /// Messages with this rank's own chunks for the ranks that compute with them at `stage`,
    /// and the chunks this rank receives for its own computation.
    fn inputs(&self, stage: &Stage) -> (Vec<Outgoing<B>>, Vec<Incoming>);
    /// Computes the stage from the received inputs (launching work, not waiting for it) and
    /// returns the results that belong to other ranks.
    fn compute(&mut self, stage: &Stage, inputs: Vec<Received<B>>) -> Vec<Outgoing<B>>;
    /// The results other ranks return to this one after `stage`.
    fn result_receives(&self, stage: &Stage) -> Vec<Incoming>;
    /// Folds the results received after `stage` into this rank's own.
    fn absorb(&mut self, stage: &Stage, results: Vec<Received<B>>);
}

/// Runs `pass` over `stages` (see [`stages`]) on `group`'s rank. With `overlap`, stage
/// `t + 1`'s inputs are posted before stage `t` computes and stage `t`'s results are collected
/// after stage `t + 1` computes; without it every exchange completes before the next
/// computation starts (the baseline for measuring communication overhead). Every rank posts the
/// same sequence of exchanges, empty ones included.
pub(crate) fn run<B: Backend, P: Pass<B>>(
    group: &DeviceGroup<B>,
    stages: &[Stage],
    pass: &mut P,
    overlap: bool,
) -> Result<(), Error> {
    let post_inputs = |pass: &P, stage: &Stage| {
        let (sends, receives) = pass.inputs(stage);
        group.exchange(sends, receives)
    };
    let mut next_inputs = Some(post_inputs(pass, &stages[0])?);
    let mut pending_results: Option<(Box<dyn Exchange<B> + '_>, &Stage)> = None;
    for (index, stage) in stages.iter().enumerate() {
        let inputs = next_inputs.take().expect("inputs posted").wait()?;
        let following = stages.get(index + 1);
        if overlap {
            next_inputs = following.map(|s| post_inputs(pass, s)).transpose()?;
        }
        let results = pass.compute(stage, inputs);
        if let Some((previous, previous_stage)) = pending_results.take() {
            let received = previous.wait()?;
            pass.absorb(previous_stage, received);
        }
        let exchange = group.exchange(results, pass.result_receives(stage))?;
        if overlap {
            pending_results = Some((exchange, stage));
        } else {
            let received = exchange.wait()?;
            pass.absorb(stage, received);
            next_inputs = following.map(|s| post_inputs(pass, s)).transpose()?;
        }
    }
    if let Some((last, last_stage)) = pending_results {
        let received = last.wait()?;
        pass.absorb(last_stage, received);
    }
    Ok(())
}

/// A message of `tensors` for `peer`.
pub(crate) fn outgoing<B: Backend>(
    peer: usize,
    kind: MessageKind,
    tensors: &[FloatTensor<B>],
) -> Outgoing<B> {
    Outgoing {
        peer,
        kind,
        tensors: tensors.to_vec(),
    }
}

/// An expected message from `peer` whose tensors are laid out like `like`, in order.
pub(crate) fn incoming<'a, B: Backend>(
    peer: usize,
    kind: MessageKind,
    like: impl IntoIterator<Item = &'a FloatTensor<B>>,
) -> Incoming {
    Incoming {
        peer,
        kind,
        layouts: like.into_iter().map(TensorLayout::of::<B>).collect(),
    }
}

/// A step's input messages: this rank's key/value tensors `kv` and query-side tensors `query`
/// (sent as `query_kind`; flat lists, a pass's own order, such as each tensor's chunks one
/// after the other) for the ranks computing with them, and the same layouts expected from the
/// owners of the shards this rank computes with (all shards share one layout).
pub(crate) fn input_messages<B: Backend>(
    plan: &RankStep,
    kv: &[FloatTensor<B>],
    query: &[FloatTensor<B>],
    query_kind: MessageKind,
) -> (Vec<Outgoing<B>>, Vec<Incoming>) {
    let sends = (plan
        .kv_to
        .iter()
        .map(|&p| outgoing(p, MessageKind::KeyValue, kv)))
    .chain(
        plan.query_to
            .iter()
            .map(|&p| outgoing(p, query_kind, query)),
    )
    .collect();
    let receives = (plan
        .kv_from
        .map(|p| incoming::<B>(p, MessageKind::KeyValue, kv)))
    .into_iter()
    .chain(plan.query_from.map(|p| incoming::<B>(p, query_kind, query)))
    .collect();
    (sends, receives)
}

/// The tensors a step computes with: this rank's own, replaced by the received ones.
pub(crate) fn step_operands<B: Backend>(
    own_kv: &[FloatTensor<B>],
    own_query: &[FloatTensor<B>],
    inputs: Vec<Received<B>>,
) -> (Vec<FloatTensor<B>>, Vec<FloatTensor<B>>) {
    let (mut kv, mut query) = (own_kv.to_vec(), own_query.to_vec());
    for message in inputs {
        match message.kind {
            MessageKind::KeyValue => kv = message.tensors,
            _ => query = message.tensors,
        }
    }
    (kv, query)
}
