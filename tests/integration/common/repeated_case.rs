//! Many sequence-parallel calls on one group, forward-only (no autodiff) and training calls
//! mixed, every call checked against the f64 reference: what a model does step after step, and
//! where tensors handed between ranks outlive (or not) the kernels that read them.
#![allow(dead_code)]

use burn::tensor::backend::AutodiffBackend;
use burn_distflash::collective::on_each_rank;
use burn_distflash::{DeviceGroup, FlashAttentionBackend};
use distflash_kernels::ElemType;

use super::distributed_case::{
    assert_messages, expected_messages, forward_on_rank, train_on_rank, with_devices, Case,
    CaseData, RankResult,
};

/// One call every rank makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    /// Forward only, on the backend under `Autodiff` (inference).
    Forward,
    /// Forward and backward through `Autodiff` (training).
    Train,
}

/// Forward-only runs first (the first call is as exposed as any other), then the two kinds
/// alternate and repeat.
pub const MIXED: [Call; 6] = [
    Call::Forward,
    Call::Forward,
    Call::Train,
    Call::Forward,
    Call::Train,
    Call::Train,
];

/// What one rank got from one call.
enum Outcome {
    Forward { out: Vec<f64>, messages: Vec<usize> },
    Train(RankResult),
}

/// Runs `calls` in order on every rank of `groups` (rank `r` on `devices[r]`, one thread per
/// rank, fresh input tensors every call) and checks every call's output, gradients and messages.
pub fn check_repeated<B>(
    devices: Vec<B::Device>,
    groups: Vec<DeviceGroup<B::Inner>>,
    case: Case,
    elem: ElemType,
    calls: &[Call],
) where
    B: AutodiffBackend + FlashAttentionBackend,
    B::InnerBackend: FlashAttentionBackend<Inner = B::Inner>,
{
    let data = CaseData::new(case, elem);
    let options = case.options();
    let calls_per_rank = calls.to_vec();
    let inputs = with_devices(&data, devices);
    let per_rank = on_each_rank(inputs.into_iter().zip(groups).collect(), |_, item| {
        let ((inputs, device), group) = item;
        (calls_per_rank.iter())
            .map(|call| match call {
                Call::Forward => {
                    let (out, messages) =
                        forward_on_rank::<B::InnerBackend>(&inputs, &group, &device, &options);
                    Outcome::Forward { out, messages }
                }
                Call::Train => {
                    Outcome::Train(train_on_rank::<B>(&inputs, &group, &device, &options))
                }
            })
            .collect::<Vec<_>>()
    });
    let mut per_rank: Vec<_> = per_rank.into_iter().map(Vec::into_iter).collect();

    let expected = data.expected();
    let schedule = case.schedule();
    for (i, call) in calls.iter().enumerate() {
        let what = format!(
            "{} {case:?}, call {} of {} ({call:?})",
            std::any::type_name::<B>(),
            i + 1,
            calls.len()
        );
        let outcomes = per_rank
            .iter_mut()
            .map(|rank| rank.next().expect("one per call"));
        match call {
            Call::Forward => {
                let mut outs = Vec::new();
                for (rank, outcome) in outcomes.enumerate() {
                    let Outcome::Forward { out, messages } = outcome else {
                        unreachable!("every rank makes the same calls")
                    };
                    let predicted = expected_messages(&schedule, rank, case.overlap, false, 1);
                    assert_eq!(messages, predicted, "{what}: rank {rank} messages");
                    outs.push(out);
                }
                data.assert_output(&what, &expected, &outs);
            }
            Call::Train => {
                let results: Vec<RankResult> = outcomes
                    .map(|outcome| match outcome {
                        Outcome::Train(result) => result,
                        Outcome::Forward { .. } => unreachable!("every rank makes the same calls"),
                    })
                    .collect();
                assert_messages(&case, &results);
                data.assert_training(&what, &expected, &results);
            }
        }
    }
}
