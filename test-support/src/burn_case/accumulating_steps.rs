//! The accumulating backward step
//! ([`attention_backward_step_add`](burn_distflash::AttentionBackend::attention_backward_step_add))
//! block by block, as the distributed backward calls it: the query rows in two parts against the
//! keys in chunks, each block adding into the rows it covers of f32 accumulators that start from
//! random values (all rows of one, some rows of the others); what was added against the f64
//! reference.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor, TensorPrimitive};
use burn_distflash::step::StepRows;
use burn_distflash::{FlashAttentionBackend, FlashAttentionOptions};
use distflash_kernels::{ElemType, Mask};

use super::{to_host, typed_tensor, Expected, HostCase};
use crate::{assert_close, Rng};

/// One case's backward inputs on `B`: q, k, v and dO as tensors, the forward's lse and delta.
pub struct BackwardInputs<B: Backend> {
    /// `[batch, q_heads, q_len, head_dim]`.
    pub q: Tensor<B, 4>,
    /// `[batch, kv_heads, kv_len, head_dim]`.
    pub k: Tensor<B, 4>,
    /// Like k.
    pub v: Tensor<B, 4>,
    /// Like q.
    pub dout: Tensor<B, 4>,
    /// `[batch, q_heads, q_len]`.
    pub lse: FloatTensor<B>,
    /// Like lse.
    pub delta: FloatTensor<B>,
}

/// Rows `rows` (dimension 2) of a 4-dimensional tensor.
fn rows4<B: Backend>(t: &Tensor<B, 4>, rows: &core::ops::Range<usize>) -> FloatTensor<B> {
    let [b, h, _, d] = t.dims();
    (t.clone().slice([0..b, 0..h, rows.clone(), 0..d]))
        .into_primitive()
        .tensor()
}

/// Rows `rows` (dimension 2) of a 3-dimensional tensor primitive.
fn rows3<B: Backend>(t: &FloatTensor<B>, rows: &core::ops::Range<usize>) -> FloatTensor<B> {
    let t = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(t.clone()));
    let [b, h, _] = t.dims();
    t.slice([0..b, 0..h, rows.clone()])
        .into_primitive()
        .tensor()
}

/// Adds every block of (query part, key chunk between `kv_bounds`) into accumulators starting
/// from random values, each block's mask `mask` at its rows' absolute positions, and checks
/// what was added against `expected` (`case`'s reference under `mask`).
pub fn check_accumulating_steps<B: FlashAttentionBackend>(
    device: &B::Device,
    elem: ElemType,
    case: &HostCase,
    inputs: &BackwardInputs<B>,
    (mask, kv_bounds): (&Mask, &[usize]),
    expected: &Expected,
) {
    let q_len = case.q_shape[2];
    let q_bounds = [0, q_len / 2, q_len];
    let mut rng = Rng::new(7 + q_len as u64);
    let starts: [Vec<f64>; 3] =
        [case.q.len(), case.k.len(), case.v.len()].map(|n| rng.tensor(n, 0.5, ElemType::F32));
    let shapes = [case.q_shape, case.kv_shape, case.kv_shape];
    let start = |i: usize| -> FloatTensor<B> {
        (typed_tensor::<B>(&starts[i], shapes[i], device, DType::F32))
            .into_primitive()
            .tensor()
    };
    let mut grads = (start(0), start(1), start(2));
    let options = FlashAttentionOptions::masked(mask.clone());
    for query in q_bounds.windows(2).map(|w| w[0]..w[1]) {
        for kv in kv_bounds.windows(2).map(|w| w[0]..w[1]) {
            let at = options.clone().at(
                mask.q_offset + query.start as i64,
                mask.kv_offset + kv.start as i64,
            );
            let rows = StepRows {
                query: query.clone(),
                kv: kv.clone(),
            };
            grads = B::attention_backward_step_add(
                rows4(&inputs.q, &query),
                rows4(&inputs.k, &kv),
                rows4(&inputs.v, &kv),
                rows4(&inputs.dout, &query),
                rows3::<B>(&inputs.lse, &query),
                rows3::<B>(&inputs.delta, &query),
                grads,
                &rows,
                at,
            );
        }
    }
    let added = |t: FloatTensor<B>, i: usize| -> Vec<f64> {
        let got = to_host(Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(t)));
        got.iter().zip(&starts[i]).map(|(g, s)| g - s).collect()
    };
    let (g, ng) = (&expected.grads, &expected.naive_grads);
    let what = format!("{} {:?} {mask:?}", std::any::type_name::<B>(), case.dims);
    let (dq, dk, dv) = grads;
    assert_close(
        &format!("{what} adding steps: dq"),
        &added(dq, 0),
        &g.dq,
        &ng.dq,
        elem,
    );
    assert_close(
        &format!("{what} adding steps: dk"),
        &added(dk, 1),
        &g.dk,
        &ng.dk,
        elem,
    );
    assert_close(
        &format!("{what} adding steps: dv"),
        &added(dv, 2),
        &g.dv,
        &ng.dv,
        elem,
    );
}
