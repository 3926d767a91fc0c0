//! [`TrainingKernels`]: the passes of a training step outside the model that a backend may fuse:
//! the loss (a cross-entropy forward that keeps each row's log-sum-exp, its backward from it) and
//! the optimizer's (a gradient's squared norm, the AdamW update); and the one query of the
//! device a training run reports, its allocator's byte counts. Burn tensor operations are the
//! defaults; the CubeCL backends (CUDA, wgpu) run one kernel each. Every backend's implementation
//! is here, so a Burn upgrade that changes the backends touches this file only.

use crate::device_memory::DeviceMemory;
use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::Tensor;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_ndarray::{
    FloatNdArrayElement, IntNdArrayElement, NdArray, NdArrayTensor, QuantElement, SharedArray,
};

mod adamw_cube;
mod adamw_kernels;
mod loss_cube;
mod loss_kernels;
mod portable;

pub use adamw_cube::{unfused_optimizer_forced, AdamWTensors};
pub use adamw_kernels::AdamWStep;
pub use loss_cube::{unfused_loss_forced, CrossEntropyRows};
pub(crate) use portable::{cross_entropy_backward_portable, cross_entropy_rows_portable};

/// Backends that may run the training step's loss and optimizer passes fused. Under `Autodiff`,
/// the inner backend's implementation is the one used (see
/// [`CrossEntropyBackend`](crate::loss::CrossEntropyBackend) and
/// [`FusedAdamW`](crate::optimizer::FusedAdamW)).
pub trait TrainingKernels: Backend {
    /// `sum(x^2)` over every element of `tensor`, computed in f32, as a one-element f32 tensor.
    fn squared_norm<const D: usize>(tensor: Tensor<Self, D>) -> Tensor<Self, 1> {
        portable::squared_norm_portable(tensor)
    }

    /// One AdamW update of `param` from `grad` and the moments `(moment_1, moment_2)` in one
    /// pass, or `None` where this backend has no fused update for these tensors (the caller then
    /// runs Burn's `AdamW`). All four tensors have the same shape. Where the caller held the
    /// only handle of `param` or a moment, the CubeCL backends write its result over it.
    fn fused_adamw(
        _param: FloatTensor<Self>,
        _grad: FloatTensor<Self>,
        _moments: (FloatTensor<Self>, FloatTensor<Self>),
        _step: &AdamWStep,
    ) -> Option<AdamWTensors<Self>> {
        None
    }

    /// One AdamW update of `param` from `grad` and the moments `(moment_1, moment_2)`, all of
    /// one shape: `[param, moment_1, moment_2]` after the step. One fused pass where
    /// [`fused_adamw`](Self::fused_adamw) takes the tensors, writing each result over its input
    /// when the caller held that input's only handle; Burn tensor operations otherwise (the
    /// same formulas, the results within f32 rounding).
    fn adamw_update(
        param: Tensor<Self, 1>,
        grad: Tensor<Self, 1>,
        moments: (Tensor<Self, 1>, Tensor<Self, 1>),
        step: &AdamWStep,
    ) -> [Tensor<Self, 1>; 3] {
        portable::adamw_update_portable(param, grad, moments, step)
    }

    /// Per row of logits `[rows, vocab]` against targets `[rows]` (every id below `vocab`),
    /// `loss = lse - logits[target]` and `lse = log(sum(exp(logits)))` in f32, or `None` where
    /// this backend has no fused kernel for these tensors (the caller then runs Burn's
    /// log-softmax).
    fn cross_entropy_forward(
        _logits: FloatTensor<Self>,
        _targets: IntTensor<Self>,
    ) -> Option<CrossEntropyRows<Self>> {
        None
    }

    /// `dlogits = grad[row] (exp(logits - lse[row]) - onehot(target))` in the logits' element
    /// type, from the forward's `lse` and the rows' loss gradient `grad` (f32 `[rows]`).
    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        portable::cross_entropy_backward_portable::<Self>(logits, targets, lse, grad)
    }

    /// What `device`'s allocator counts now, or `None` where this backend does not say.
    fn device_memory(_device: &Self::Device) -> Option<DeviceMemory> {
        None
    }
}

impl<E: FloatNdArrayElement, I: IntNdArrayElement, Q: QuantElement> TrainingKernels
    for NdArray<E, I, Q>
where
    NdArrayTensor: From<SharedArray<E>> + From<SharedArray<I>>,
{
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> TrainingKernels
    for CubeBackend<R, F, I, BT>
{
    fn squared_norm<const D: usize>(tensor: Tensor<Self, D>) -> Tensor<Self, 1> {
        adamw_cube::squared_norm(tensor)
    }

    fn fused_adamw(
        param: CubeTensor<R>,
        grad: CubeTensor<R>,
        moments: (CubeTensor<R>, CubeTensor<R>),
        step: &AdamWStep,
    ) -> Option<AdamWTensors<Self>> {
        adamw_cube::fused_adamw(param, grad, moments, step)
    }

    fn adamw_update(
        param: Tensor<Self, 1>,
        grad: Tensor<Self, 1>,
        moments: (Tensor<Self, 1>, Tensor<Self, 1>),
        step: &AdamWStep,
    ) -> [Tensor<Self, 1>; 3] {
        adamw_cube::adamw_update_cube(param, grad, moments, step)
    }

    fn cross_entropy_forward(
        logits: CubeTensor<R>,
        targets: CubeTensor<R>,
    ) -> Option<CrossEntropyRows<Self>> {
        loss_cube::cross_entropy_forward::<R, I>(logits, targets)
    }

    fn cross_entropy_backward(
        logits: CubeTensor<R>,
        targets: CubeTensor<R>,
        lse: CubeTensor<R>,
        grad: CubeTensor<R>,
    ) -> CubeTensor<R> {
        loss_cube::cross_entropy_backward::<R, I>(logits, targets, lse, grad)
    }

    fn device_memory(device: &Self::Device) -> Option<DeviceMemory> {
        let usage = R::client(device).memory_usage().ok()?;
        Some(DeviceMemory {
            in_use: usage.bytes_in_use,
            reserved: usage.bytes_reserved,
        })
    }
}
