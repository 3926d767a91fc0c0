//! `Fusion<B>` in sequence-parallel calls: the distributed pass runs on the backend under fusion
//! (its kernels, its NCCL transport); the inputs are materialised, the results handed back to
//! the fusion stream.

use crate::Error;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Device, TensorMetadata};
use burn_fusion::stream::OperationStreams;
use burn_fusion::{get_client, Fusion, FusionBackend, FusionTensor, NoOp};
use burn_ir::{InitOperationIr, OperationIr};

use crate::collective::DeviceGroup;
use crate::extension::{FlashAttentionBackend, Grads};
use crate::sequence_parallel::SequenceParallelOptions;

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

/// `run` on the values of fused tensors, computed by `B` after the fusion stream has settled, its
/// results handed back to the fusion stream.
fn on_inner<B, const N: usize, const M: usize>(
    inputs: [FloatTensor<Fusion<B>>; N],
    device: &Device<B>,
    run: impl FnOnce([FloatTensor<B>; N]) -> Result<[FloatTensor<B>; M], Error>,
) -> Result<[FloatTensor<Fusion<B>>; M], Error>
where
    B: FusionBackend,
{
    let inputs = inputs.map(unfused::<B>);
    settle::<B>(device);
    Ok(run(inputs)?.map(|t| fused::<B>(t, device)))
}

/// `(O, lse)`.
type OutputAndLse<B> = (FloatTensor<B>, FloatTensor<B>);

/// `(O, lse)` of this rank's fused shards, computed by `B`.
pub(super) fn attention<B>(
    q: FloatTensor<Fusion<B>>,
    k: FloatTensor<Fusion<B>>,
    v: FloatTensor<Fusion<B>>,
    group: &DeviceGroup<B>,
    options: &SequenceParallelOptions,
) -> Result<OutputAndLse<Fusion<B>>, Error>
where
    B: FusionBackend + FlashAttentionBackend<Inner = B>,
{
    let [out, lse] = on_inner::<B, 3, 2>([q, k, v], group.device(), |[q, k, v]| {
        let (out, lse) = B::sequence_parallel_attention(q, k, v, group, options)?;
        Ok([out, lse])
    })?;
    Ok((out, lse))
}

/// `(dq, dk, dv)` of this rank's fused shards, computed by `B`.
#[allow(clippy::too_many_arguments)]
pub(super) fn backward<B>(
    q: FloatTensor<Fusion<B>>,
    k: FloatTensor<Fusion<B>>,
    v: FloatTensor<Fusion<B>>,
    out: FloatTensor<Fusion<B>>,
    lse: FloatTensor<Fusion<B>>,
    grad_out: FloatTensor<Fusion<B>>,
    group: &DeviceGroup<B>,
    options: &SequenceParallelOptions,
) -> Result<Grads<Fusion<B>>, Error>
where
    B: FusionBackend + FlashAttentionBackend<Inner = B>,
{
    let inputs = [q, k, v, out, lse, grad_out];
    let [dq, dk, dv] =
        on_inner::<B, 6, 3>(inputs, group.device(), |[q, k, v, out, lse, grad_out]| {
            let (dq, dk, dv) =
                B::sequence_parallel_backward(q, k, v, out, lse, grad_out, group, options)?;
            Ok([dq, dk, dv])
        })?;
    Ok((dq, dk, dv))
}
