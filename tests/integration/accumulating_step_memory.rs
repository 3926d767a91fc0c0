//! What a backward step holds beside the caller's f32 accumulators, on wgpu (whose pools count
//! their bytes per stream): the step that returns fresh gradients and then adds them into the
//! accumulators reserves pages for three gradients of the accumulators' size; the accumulating
//! step (`attention_backward_step_add`) over all the rows adds into the accumulators themselves
//! and reserves none of that size, and over some of the rows at most a copy of those rows.
//! Pages are never given back without an explicit cleanup, so the bytes a call makes the pools
//! reserve, from pools cleaned up before it, bound its peak from below.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor};
use burn_distflash::step::{self, StepRows};
use burn_distflash::{AttentionBackend, FlashAttentionOptions, Mask};
use distflash_test_support::exclusive_wgpu;

use crate::common::wgpu_pools::{clean_up, device, random, reserved, WgpuF32};

type Grads = (
    FloatTensor<WgpuF32>,
    FloatTensor<WgpuF32>,
    FloatTensor<WgpuF32>,
);

/// 32 heads of 256 rows of 64: 2 MiB of f32 a tensor.
const SHAPE: [usize; 4] = [1, 32, 256, 64];
const TENSOR_BYTES: u64 = 32 * 256 * 64 * 4;

/// The bytes the pools reserve while `step` adds into fresh accumulators (dq of `query_rows`
/// rows, dk and dv like the keys), from pools cleaned up before it (the step's inputs are made
/// before).
fn reserved_by(query_rows: usize, step: impl FnOnce(Grads) -> Grads) -> u64 {
    let [b, h, _, d] = SHAPE;
    let accumulators = (random([b, h, query_rows, d]), random(SHAPE), random(SHAPE));
    clean_up();
    let before = reserved();
    let grads = step(accumulators);
    let after = reserved();
    drop(grads);
    after - before
}

#[test]
fn the_accumulating_step_reserves_no_gradient_of_the_accumulators_size() {
    let _wgpu = exclusive_wgpu();
    let [b, h, s, _] = SHAPE;
    let (q, k, v, grad_out) = (random(SHAPE), random(SHAPE), random(SHAPE), random(SHAPE));
    let lse = (Tensor::<WgpuF32, 3>::zeros([b, h, s], (&device(), DType::F32)) + 8.0)
        .into_primitive()
        .tensor();
    let delta = Tensor::<WgpuF32, 3>::zeros([b, h, s], (&device(), DType::F32))
        .into_primitive()
        .tensor();
    let options = FlashAttentionOptions::masked(Mask::causal());
    let inputs = || {
        (
            q.clone(),
            k.clone(),
            v.clone(),
            grad_out.clone(),
            lse.clone(),
            delta.clone(),
        )
    };
    let whole = StepRows::whole(s, s);
    let add = |acc: Grads, rows: &StepRows| {
        let (q, k, v, grad_out, lse, delta) = inputs();
        WgpuF32::attention_backward_step_add(
            q,
            k,
            v,
            grad_out,
            lse,
            delta,
            acc,
            rows,
            options.clone(),
        )
    };
    let added = reserved_by(s, |acc| add(acc, &whole));
    // The step's query rows as the second half of a dq accumulator twice as long: a copy of
    // those rows, written back in place.
    let second_half = StepRows {
        query: s..2 * s,
        kv: 0..s,
    };
    let added_to_rows = reserved_by(2 * s, |acc| add(acc, &second_half));
    // Accumulators the caller still holds a handle on are copied first (what the distributed
    // pass avoids by moving its accumulators into the step).
    let added_while_held = reserved_by(s, |acc| {
        let held = acc.clone();
        let grads = add(acc, &whole);
        drop(held);
        grads
    });
    // Last: pages the calls above left would only lower this one.
    let returned_then_added = reserved_by(s, |acc| {
        let (q, k, v, grad_out, lse, delta) = inputs();
        let grads =
            WgpuF32::attention_backward_step(q, k, v, grad_out, lse, delta, options.clone());
        step::add_step_grads::<WgpuF32>(acc, &whole, grads)
    });
    println!(
        "reserved: returned then added {returned_then_added} B, added {added} B, added to rows \
         {added_to_rows} B, added while held {added_while_held} B ({TENSOR_BYTES} B a tensor)"
    );
    assert!(
        added_while_held >= 3 * TENSOR_BYTES,
        "held accumulators reserved {added_while_held} B, not their copies"
    );
    assert!(
        added_to_rows <= TENSOR_BYTES,
        "adding into some rows reserved {added_to_rows} B, more than a copy of the rows"
    );
    assert!(
        returned_then_added >= 3 * TENSOR_BYTES,
        "the returned gradients take {returned_then_added} B"
    );
    assert!(
        added + 3 * TENSOR_BYTES <= returned_then_added,
        "adding into the accumulators reserved {added} B, returning {returned_then_added} B"
    );
}
