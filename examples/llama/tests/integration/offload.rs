//! Checkpoints offloaded to host memory in training (ndarray, the synchronous copies): steps
//! with every layer's or all but the last layer's checkpoints in host memory give bitwise the
//! losses, gradient norms, weights and evaluation of the same steps without offload, at both
//! placements, on one device and on each rank of a group of 2; a model that would offload
//! without checkpoints is refused; `--offload` on the command line.

use std::time::Duration;

use crate::common::modules::{float_params, ParamValues};
use crate::common::temp_dir::TempDir;
use crate::common::within::within;
use crate::train::{dataset, small, Cpu, Inner, DEVICE};
use burn_distflash::collective::on_each_rank;
use burn_distflash::layers::{replicate, CheckpointPlacement, Offload};
use burn_distflash::offload::held_bytes;
use burn_distflash::{AttentionContext, DeviceGroup};
use distflash_llama::train::{TrainOptions, Trainer};
use distflash_llama::LlamaConfig;

const LIMIT: Duration = Duration::from_secs(300);
const STEPS: u64 = 3;

/// A three-layer model checkpointed at `placement`, offloading as `policy` says.
pub(crate) fn config(placement: CheckpointPlacement, policy: Offload) -> LlamaConfig {
    LlamaConfig {
        n_layers: 3,
        ..small()
    }
    .with_checkpoint(placement)
    .with_offload(policy)
}

/// Per rank: the bits of every step's loss and gradient norm, of the evaluation after them and
/// of the final weights.
pub(crate) type Run = (Vec<u64>, Vec<ParamValues>);

fn train(trainer: &mut Trainer<Cpu>) -> Run {
    let data = dataset();
    let mut bits = Vec::new();
    for _ in 0..STEPS {
        let o = &trainer.options;
        let (x, y) = (data.batch(trainer.step, o.seed, o.batch, o.seq_len)).unwrap();
        let stats = trainer.train_step(&x, &y).unwrap();
        bits.extend([stats.loss.to_bits(), stats.grad_norm.to_bits()]);
        assert_eq!(
            held_bytes::<Inner>(&DEVICE),
            0,
            "the backward took every entry"
        );
    }
    let (x, y) = data.batch(99, 0, 4, 32).unwrap();
    bits.push(trainer.evaluate(&x, &y).unwrap().to_bits());
    assert_eq!(
        held_bytes::<Inner>(&DEVICE),
        0,
        "an evaluation keeps nothing"
    );
    (bits, float_params(&trainer.model))
}

fn options() -> TrainOptions {
    TrainOptions::new(STEPS, 4, 32).with_lr(3e-3).with_warmup(1)
}

/// `world` ranks (one device when 1) training the same seeded model of `config`.
pub(crate) fn runs(world: usize, config: &LlamaConfig) -> Vec<Run> {
    let model = config.try_init_seeded::<Cpu>(&DEVICE, 3).unwrap();
    if world == 1 {
        let mut trainer = Trainer::new(model, AttentionContext::Local, options());
        return vec![train(&mut trainer)];
    }
    let groups = DeviceGroup::<Inner>::in_process(vec![DEVICE; world]);
    let models = replicate(&model, &vec![DEVICE; world]);
    on_each_rank(
        groups.into_iter().zip(models).collect(),
        |_, (group, model)| {
            let context = AttentionContext::sharded(group);
            train(&mut Trainer::new(model, context, options()))
        },
    )
}

/// Every rank's losses, norms, evaluation and weights, bit for bit.
pub(crate) fn assert_same_runs(what: &str, got: &[Run], expected: &[Run]) {
    assert_eq!(got.len(), expected.len(), "{what}: ranks");
    for (rank, (got, expected)) in got.iter().zip(expected).enumerate() {
        assert_eq!(got.0, expected.0, "{what}, rank {rank}: losses and norms");
        assert!(got.1 == expected.1, "{what}, rank {rank}: weights");
    }
}

#[test]
fn offloaded_training_is_bitwise_the_same_on_one_device_and_on_a_group() {
    within(LIMIT, || {
        for world in [1, 2] {
            for placement in [
                CheckpointPlacement::Layer,
                CheckpointPlacement::AttentionOutput,
            ] {
                let expected = runs(world, &config(placement, Offload::Off));
                for policy in [Offload::All, Offload::AllButLast(1)] {
                    let got = runs(world, &config(placement, policy));
                    let what = format!("{world} rank(s), {placement:?}, {policy:?}");
                    assert_same_runs(&what, &got, &expected);
                }
            }
        }
    });
}

#[test]
fn offload_without_checkpoints_is_refused() {
    let config = config(CheckpointPlacement::None, Offload::AllButLast(1));
    let err = config.try_init::<Cpu>(&DEVICE).unwrap_err();
    assert!(err.to_string().contains("offload"), "{err}");
    assert!(err.to_string().contains("checkpoint None"), "{err}");
    // Keeping every layer on the device offloads nothing, and needs no checkpoint.
    let config = LlamaConfig {
        n_layers: 3,
        ..small()
    }
    .with_checkpoint(CheckpointPlacement::None)
    .with_offload(Offload::AllButLast(3));
    assert!(config.try_init::<Cpu>(&DEVICE).is_ok());
}

#[test]
fn the_command_line_offloads_and_names_a_bad_offload() {
    let dir = TempDir::new("cli-offload");
    let run = |extra: &[&str]| crate::command_line::llama_train(dir.path(), extra);
    let trained = crate::command_line::stderr_of(&run(&["--steps", "1", "--offload", "0"]), 0);
    assert!(trained.contains("offload All"), "{trained}");
    assert!(trained.contains("done: 1 steps"), "{trained}");
    let bad = crate::command_line::stderr_of(&run(&["--offload", "some"]), 2);
    assert!(
        bad.contains("'--offload <off|all|N>': takes off, all, or N"),
        "{bad}"
    );
    let none = ["--offload", "all", "--checkpoint", "none"];
    let refused = crate::command_line::stderr_of(&run(&none), 2);
    assert!(refused.contains("offload"), "{refused}");
}
