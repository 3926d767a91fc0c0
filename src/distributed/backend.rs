//! [`SequenceParallelBackend`]: the backends sequence-parallel attention runs on.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{Device, TensorMetadata};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_fusion::stream::OperationStreams;
use burn_fusion::{get_client, Fusion, FusionBackend, FusionTensor, NoOp};
use burn_ir::{InitOperationIr, OperationIr};
use burn_ndarray::{
    FloatNdArrayElement, IntNdArrayElement, NdArray, NdArrayTensor, QuantElement, SharedArray,
};

use super::{backward, forward, Grads, SequenceParallelOptions};
use crate::backend::FlashAttentionBackend;
use crate::collective::{CommError, DeviceGroup};

/// A backend whose tensors can take part in sequence-parallel attention over a
/// [`DeviceGroup`] of its inner backend: the backend that computes and communicates (`Self` for
/// the CubeCL and ndarray backends, `B` for `Fusion<B>` and for `Autodiff<B>` that of `B`).
pub trait SequenceParallelBackend: FlashAttentionBackend {
    /// The backend that computes and communicates.
    type Inner: FlashAttentionBackend;

    /// `device` as the inner backend's device.
    fn inner_device(device: &Self::Device) -> Device<Self::Inner>;

    /// `(O, lse)` of this rank's shards (validated by the caller).
    fn sequence_parallel_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        group: &DeviceGroup<Self::Inner>,
        options: &SequenceParallelOptions,
    ) -> Result<(FloatTensor<Self>, FloatTensor<Self>), CommError>;

    /// `(dq, dk, dv)` of this rank's shards from the forward's O and lse.
    #[allow(clippy::too_many_arguments)]
    fn sequence_parallel_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad_out: FloatTensor<Self>,
        group: &DeviceGroup<Self::Inner>,
        options: &SequenceParallelOptions,
    ) -> Result<Grads<Self>, CommError>;

    /// `x W` of a linear layer: `x` `[rows, d_in]`, `weight` `[d_in, d_out]`, `[rows, d_out]`.
    /// cuBLAS on CUDA `CubeBackend` tensors (feature `cublas`; contiguous f32/f16/bf16 operands),
    /// Burn's `matmul` elsewhere; on `Autodiff` one node whose backward products take the same
    /// path.
    fn linear_product(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self> {
        use burn::tensor::{Tensor, TensorPrimitive};
        let wrap = |t| Tensor::<Self, 2>::from_primitive(TensorPrimitive::Float(t));
        crate::layers::product(wrap(x), wrap(weight), crate::layers::Transposed::Neither)
            .into_primitive()
            .tensor()
    }
}

/// Implements the trait for a backend that computes and communicates itself.
macro_rules! computes_itself {
    () => {
        type Inner = Self;

        fn inner_device(device: &Self::Device) -> Self::Device {
            device.clone()
        }

        fn sequence_parallel_attention(
            q: FloatTensor<Self>,
            k: FloatTensor<Self>,
            v: FloatTensor<Self>,
            group: &DeviceGroup<Self>,
            options: &SequenceParallelOptions,
        ) -> Result<(FloatTensor<Self>, FloatTensor<Self>), CommError> {
            let schedule = options.schedule_for(group.world_size());
            forward::run::<Self>(q, k, v, group, &schedule, options)
        }

        fn sequence_parallel_backward(
            q: FloatTensor<Self>,
            k: FloatTensor<Self>,
            v: FloatTensor<Self>,
            out: FloatTensor<Self>,
            lse: FloatTensor<Self>,
            grad_out: FloatTensor<Self>,
            group: &DeviceGroup<Self>,
            options: &SequenceParallelOptions,
        ) -> Result<Grads<Self>, CommError> {
            let schedule = options.schedule_for(group.world_size());
            backward::run::<Self>(q, k, v, out, lse, grad_out, group, &schedule, options)
        }
    };
}

impl<R, F, I, BT> SequenceParallelBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    computes_itself!();
}

impl<E: FloatNdArrayElement, I: IntNdArrayElement, Q: QuantElement> SequenceParallelBackend
    for NdArray<E, I, Q>
where
    NdArrayTensor: From<SharedArray<E>> + From<SharedArray<I>>,
{
    computes_itself!();
}

/// A fused tensor's value as a tensor of the backend under fusion (runs what is queued).
fn unfused<B: FusionBackend>(tensor: FusionTensor<B::FusionRuntime>) -> FloatTensor<B> {
    tensor.client.clone().resolve_tensor_float::<B>(tensor)
}

/// Waits until the fusion server has finished computing every resolved input: it computes on
/// its own stream, and the distributed pass reads the inputs from this rank's thread.
fn settle<B: FusionBackend>(device: &Device<B>) {
    use burn::tensor::backend::Backend;
    Fusion::<B>::sync(device).expect("fusion stream failed before sequence-parallel attention");
}

/// A tensor of the backend under fusion as a fused tensor on `device`.
fn fused<B: FusionBackend>(tensor: FloatTensor<B>, device: &Device<B>) -> FloatTensor<Fusion<B>> {
    let client = get_client::<B>(device);
    let (shape, dtype) = (tensor.shape(), tensor.dtype());
    let handle = B::float_tensor_handle(tensor);
    let init = InitOperationIr::create(shape, dtype, || client.register_tensor_handle(handle));
    client
        .register(
            OperationStreams::default(),
            OperationIr::Init(init),
            NoOp::<B>::new(),
        )
        .remove(0)
}

/// Fusion runs the distributed pass on the backend under it (its kernels, its NCCL transport):
/// the inputs are materialised, the results handed back to the fusion stream.
impl<B> SequenceParallelBackend for Fusion<B>
where
    B: FusionBackend + SequenceParallelBackend<Inner = B>,
{
    type Inner = B;

    fn inner_device(device: &Self::Device) -> Device<B> {
        device.clone()
    }

    fn sequence_parallel_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        group: &DeviceGroup<B>,
        options: &SequenceParallelOptions,
    ) -> Result<(FloatTensor<Self>, FloatTensor<Self>), CommError> {
        let device = group.device().clone();
        let (q, k, v) = (unfused::<B>(q), unfused::<B>(k), unfused::<B>(v));
        settle::<B>(&device);
        let (out, lse) = B::sequence_parallel_attention(q, k, v, group, options)?;
        Ok((fused::<B>(out, &device), fused::<B>(lse, &device)))
    }

    fn sequence_parallel_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad_out: FloatTensor<Self>,
        group: &DeviceGroup<B>,
        options: &SequenceParallelOptions,
    ) -> Result<Grads<Self>, CommError> {
        let device = group.device().clone();
        let (q, k, v) = (unfused::<B>(q), unfused::<B>(k), unfused::<B>(v));
        let (out, lse, grad_out) = (unfused::<B>(out), unfused::<B>(lse), unfused::<B>(grad_out));
        settle::<B>(&device);
        let (dq, dk, dv) =
            B::sequence_parallel_backward(q, k, v, out, lse, grad_out, group, options)?;
        Ok((
            fused::<B>(dq, &device),
            fused::<B>(dk, &device),
            fused::<B>(dv, &device),
        ))
    }
}
