//! `replicate`: per-rank copies of a freshly initialised module (weights still lazy) hold the
//! same weights as each other and as the source, require gradients, and are leaves of their own.
//! (That ranks still agree after a training step is checked in the Llama example's `train` tests.)

use crate::common::modules::{float_params, require_grad_flags};
use burn::backend::ndarray::NdArrayDevice;
use burn::backend::{Autodiff, NdArray};
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{Distribution, Tensor};
use burn_distflash::layers::{replicate, TransformerBlockConfig};
use burn_distflash::{AttentionContext, DistFlashAttentionConfig};

type Cpu = Autodiff<NdArray<f32>>;
const DEVICE: NdArrayDevice = NdArrayDevice::Cpu;

fn block_config() -> TransformerBlockConfig {
    TransformerBlockConfig::new(
        DistFlashAttentionConfig::new(64, 4).with_n_kv_heads(Some(2)),
        96,
    )
}

#[test]
fn copies_of_a_fresh_module_hold_its_weights_and_require_gradients() {
    let block = block_config().init::<Cpu>(&DEVICE);
    let copies = replicate(&block, &[DEVICE; 4]);
    assert_eq!(copies.len(), 4);
    let weights = float_params(&copies[0]);
    assert_eq!(weights.len(), 9, "the block's nine weights");
    for (rank, copy) in copies.iter().enumerate() {
        assert!(
            float_params(copy) == weights,
            "copy {rank} holds other weights than copy 0"
        );
        let flags = require_grad_flags(copy);
        assert!(flags.iter().all(|&f| f), "copy {rank}: {flags:?}");
    }
    // The source now holds the same (initialised) weights, so later clones agree too.
    assert!(
        float_params(&block) == weights,
        "the source holds other weights"
    );
    assert!(
        float_params(&block.clone()) == weights,
        "a clone of the source differs"
    );
}

/// Freezes the first float weight.
struct FreezeFirst(bool);

impl ModuleMapper<Cpu> for FreezeFirst {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<Cpu, D>>) -> Param<Tensor<Cpu, D>> {
        let first = !self.0;
        self.0 = true;
        if first {
            param.set_require_grad(false)
        } else {
            param
        }
    }
}

#[test]
fn copies_keep_frozen_weights_frozen() {
    let attention = DistFlashAttentionConfig::new(32, 2)
        .init::<Cpu>(&DEVICE)
        .map(&mut FreezeFirst(false));
    let copy = replicate(&attention, &[DEVICE]).remove(0);
    assert_eq!(require_grad_flags(&copy), vec![false, true, true, true]);
}

#[test]
fn each_copy_gets_gradients_of_its_own() {
    let attention = DistFlashAttentionConfig::new(32, 2).init::<Cpu>(&DEVICE);
    let [a, b]: [_; 2] = replicate(&attention, &[DEVICE; 2]).try_into().unwrap();
    let x = Tensor::<Cpu, 3>::random([1, 6, 32], Distribution::Default, &DEVICE);
    let grads = a.forward(x, &AttentionContext::Local).sum().backward();
    let weight = |m: &burn_distflash::DistFlashAttention<Cpu>| m.query.weight.val();
    assert!(
        weight(&a).grad(&grads).is_some(),
        "the copy that ran has gradients"
    );
    assert!(
        weight(&b).grad(&grads).is_none(),
        "the other copy's weights are leaves of their own"
    );
    assert!(
        weight(&attention).grad(&grads).is_none(),
        "so are the source's"
    );
}

#[test]
fn no_devices_give_no_copies() {
    let attention = DistFlashAttentionConfig::new(32, 2).init::<Cpu>(&DEVICE);
    assert!(replicate(&attention, &[]).is_empty());
}
