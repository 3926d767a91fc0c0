//! The training kernels' defaults from Burn tensor operations, for backends without fused ones.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Int, Tensor, TensorPrimitive};

use super::adamw_kernels::AdamWStep;

/// `sum(x^2)` with Burn tensor operations: an f32 copy, its square, its sum.
pub(crate) fn squared_norm_portable<B: Backend, const D: usize>(
    tensor: Tensor<B, D>,
) -> Tensor<B, 1> {
    tensor.cast(DType::F32).square().sum().cast(DType::F32)
}

/// One AdamW update with Burn tensor operations (15 element-wise passes):
/// `m = m b1 + g (1 - b1)`, `v = v b2 + g^2 (1 - b2)`,
/// `p = p decay - lr (m / bias_1) / (sqrt(v / bias_2) + eps)`; `[p, m, v]` after the step.
pub(crate) fn adamw_update_portable<B: Backend>(
    param: Tensor<B, 1>,
    grad: Tensor<B, 1>,
    (moment_1, moment_2): (Tensor<B, 1>, Tensor<B, 1>),
    step: &AdamWStep,
) -> [Tensor<B, 1>; 3] {
    let moment_1 = moment_1.mul_scalar(step.beta_1) + grad.clone().mul_scalar(1.0 - step.beta_1);
    let moment_2 = moment_2.mul_scalar(step.beta_2) + grad.square().mul_scalar(1.0 - step.beta_2);
    let corrected_1 = moment_1.clone().div_scalar(step.bias_1);
    let corrected_2 = moment_2.clone().div_scalar(step.bias_2);
    let delta = corrected_1 / corrected_2.sqrt().add_scalar(step.epsilon);
    let decayed = param.mul_scalar(step.decay);
    [decayed - delta.mul_scalar(step.lr), moment_1, moment_2]
}

/// `dlogits = grad[row] (exp(logits - lse[row]) - onehot(target))` in the logits' element type,
/// from the forward's `lse` and the rows' loss gradient `grad` (f32 `[rows]`), with Burn tensor
/// operations.
pub(crate) fn cross_entropy_backward_portable<B: Backend>(
    logits: FloatTensor<B>,
    targets: IntTensor<B>,
    lse: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> FloatTensor<B> {
    let logits = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(logits));
    let [_, vocab] = logits.dims();
    let dtype = logits.dtype();
    let lse = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(lse));
    let grad = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(grad));
    let onehot = Tensor::<B, 1, Int>::from_primitive(targets)
        .one_hot::<2>(vocab)
        .float()
        .cast(DType::F32);
    let softmax = (logits.cast(DType::F32) - lse.unsqueeze_dim(1)).exp();
    ((softmax - onehot) * grad.unsqueeze_dim(1))
        .cast(dtype)
        .into_primitive()
        .tensor()
}

/// Per row of logits `[rows, vocab]` against targets `[rows]`, `(loss, lse)` in f32 with Burn
/// tensor operations on an f32 copy of the logits: `lse = max + log(sum(exp(logits - max)))`,
/// `loss = lse - logits[target]`.
pub(crate) fn cross_entropy_rows_portable<B: Backend>(
    logits: FloatTensor<B>,
    targets: IntTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let logits = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(logits)).cast(DType::F32);
    let targets = Tensor::<B, 1, Int>::from_primitive(targets);
    let max = logits.clone().max_dim(1);
    let lse = (logits.clone() - max.clone()).exp().sum_dim(1).log() + max;
    let picked = logits.gather(1, targets.unsqueeze_dim(1));
    let loss = (lse.clone() - picked).squeeze_dim::<1>(1);
    (
        loss.into_primitive().tensor(),
        lse.squeeze_dim::<1>(1).into_primitive().tensor(),
    )
}
