//! The step loop shared by the distributed forward and backward: inputs of the next step travel
//! while the current step computes, results travel back while the next step computes.

use crate::Error;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;

use crate::collective::{
    DeviceGroup, Exchange, Incoming, MessageKind, Outgoing, Received, TensorLayout,
};
use crate::schedule::{RankStep, Schedule};

/// What a pass does at each step; the [`run`] loop moves the messages.
pub(crate) trait Pass<B: Backend> {
    /// Messages with this rank's own chunks for the ranks that compute with them at `plan`'s
    /// step, and the chunks this rank receives for its own computation.
    fn inputs(&self, plan: &RankStep) -> (Vec<Outgoing<B>>, Vec<Incoming>);
    /// Computes the step from the received inputs (launching work, not waiting for it) and
    /// returns the results that belong to other ranks.
    fn compute(&mut self, plan: &RankStep, inputs: Vec<Received<B>>) -> Vec<Outgoing<B>>;
    /// The results other ranks return to this one after `plan`'s step.
    fn result_receives(&self, plan: &RankStep) -> Vec<Incoming>;
    /// Folds received results into this rank's own.
    fn absorb(&mut self, results: Vec<Received<B>>);
}

/// Runs `pass` over every step of `schedule` on `group`'s rank. With `overlap`, step `t + 1`'s
/// inputs are posted before step `t` computes and step `t`'s results are collected after step
/// `t + 1` computes; without it every exchange completes before the next computation starts
/// (the baseline for measuring communication overhead). Every rank posts the same sequence of
/// exchanges, empty ones included.
pub(crate) fn run<B: Backend, P: Pass<B>>(
    group: &DeviceGroup<B>,
    schedule: &Schedule,
    pass: &mut P,
    overlap: bool,
) -> Result<(), Error> {
    let rank = group.rank();
    let plans: Vec<RankStep> = (0..schedule.num_steps())
        .map(|step| schedule.rank_step(rank, step))
        .collect();
    let post_inputs = |pass: &P, plan: &RankStep| {
        let (sends, receives) = pass.inputs(plan);
        group.exchange(sends, receives)
    };
    let mut next_inputs = Some(post_inputs(pass, &plans[0])?);
    let mut pending_results: Option<Box<dyn Exchange<B> + '_>> = None;
    for (step, plan) in plans.iter().enumerate() {
        let inputs = next_inputs.take().expect("inputs posted").wait()?;
        let following = plans.get(step + 1);
        if overlap {
            next_inputs = following.map(|p| post_inputs(pass, p)).transpose()?;
        }
        let results = pass.compute(plan, inputs);
        if let Some(previous) = pending_results.take() {
            let received = previous.wait()?;
            pass.absorb(received);
        }
        let exchange = group.exchange(results, pass.result_receives(plan))?;
        if overlap {
            pending_results = Some(exchange);
        } else {
            let received = exchange.wait()?;
            pass.absorb(received);
            next_inputs = following.map(|p| post_inputs(pass, p)).transpose()?;
        }
    }
    if let Some(last) = pending_results {
        let received = last.wait()?;
        pass.absorb(received);
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
