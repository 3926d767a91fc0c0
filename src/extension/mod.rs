//! The backend extension: attention with its softmax statistics and a fused backward, local or
//! sequence-parallel over a [`DeviceGroup`] (a local call is a world of one), the products
//! of the linear layers and the layers' element-wise parts (SwiGLU, RMS norm, rotary embedding),
//! as operations every supported Burn backend implements.

use crate::Error;
use burn::module::{Module, ParamId};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Device, Tensor, TensorMetadata, TensorPrimitive};

use distflash_kernels::AttentionDims;

use crate::checkpoint::CheckpointPlacement;
use crate::collective::DeviceGroup;
use crate::layer_ops;
use crate::matmul::{product, Transposed};
use crate::offload::HostOffload;
use crate::options::SequenceParallelOptions;
use crate::options::{Documents, FlashAttentionOptions};
use crate::step::{self, AttentionState, StepMask};

mod context;
pub use context::AttentionContext;

/// Gradients of q, k and v.
pub(crate) type Grads<B> = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>);

/// The Burn backend extension of this crate: exact, memory-efficient attention with its fused
/// backward, step by step with the running softmax state, sequence-parallel over a
/// [`DeviceGroup`] of [`FlashAttentionBackend::Inner`] (the backend that computes and
/// communicates: `Self` for the CubeCL and ndarray backends, `B` for `Fusion<B>`, and for
/// `Autodiff<B>` that of `B`), and the linear layers' products. Implemented for
/// `CubeBackend` (CUDA, wgpu: this project's kernels), `NdArray` (Burn tensor ops), `Fusion<B>`
/// and `Autodiff<B>` of those; a model generic over `B: FlashAttentionBackend` runs on all of
/// them. Every one also keeps checkpoints in host memory on request ([`HostOffload`]).
///
/// # Shapes
///
/// Of the attention methods (each method lists its own), with `q_heads` a multiple of
/// `kv_heads`:
///
/// - q: `[batch, q_heads, seq_q, head_dim]`
/// - k, v: `[batch, kv_heads, seq_kv, head_dim]`
/// - O: like q
/// - lse: `[batch, q_heads, seq_q]`, of float type
///   [`lse_dtype`](FlashAttentionBackend::lse_dtype) (f32 where the backend allows it)
///
/// # Panics
///
/// Callers validate the inputs first, [`FlashAttentionBackend::check_attention_limits`]
/// included (the public functions do); implementations may panic on invalid input, and panic
/// (never return silent zeros) when a kernel launch fails anyway.
pub trait FlashAttentionBackend: Backend + HostOffload {
    /// Float type of the lse returned for inputs of type `input` (f32 on the kernel backends).
    fn lse_dtype(input: DType) -> DType {
        input
    }

    /// Checks, before any work, that attention of these (valid) dimensions in float type
    /// `dtype` with `options` (whose mask and scale pick the kernels) can run on `device`,
    /// forward and backward, one-shot or in steps: the kernel backends check the device's limits
    /// (grid, cubes, shared memory, element types) and that their kernels apply the mask. The
    /// default (tensor-op backends) accepts everything.
    ///
    /// # Errors
    ///
    /// On the CubeCL backends (and `Fusion` or `Autodiff` of them):
    /// - [`Error::DType`] when `dtype` is not f16, bf16 or f32;
    /// - [`Error::Kernel`] with
    ///   [`KernelError::DType`](crate::kernels::KernelError::DType) when the device runs no
    ///   kernels on `dtype`, or with
    ///   [`KernelError::DeviceLimit`](crate::kernels::KernelError::DeviceLimit) when a kernel of
    ///   the call needs more cubes, units per cube or shared memory than the device allows, or
    ///   with [`KernelError::BadMask`](crate::kernels::KernelError::BadMask) when the mask does
    ///   not fit the call (documents of another batch size, or not covering its positions).
    fn check_attention_limits(
        dims: &AttentionDims,
        dtype: DType,
        device: &Self::Device,
        options: &FlashAttentionOptions,
    ) -> Result<(), Error> {
        let _ = (dims, dtype, device, options);
        Ok(())
    }

    /// `(O, lse)` of softmax attention of q against k, v.
    ///
    /// # Shapes
    ///
    /// - q: `[batch, q_heads, seq_q, head_dim]`
    /// - k, v: `[batch, kv_heads, seq_kv, head_dim]`
    /// - O: `[batch, q_heads, seq_q, head_dim]`
    /// - lse: `[batch, q_heads, seq_q]`
    fn flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// `(dq, dk, dv)` from the forward's O and lse and the output gradient, without recomputing
    /// the forward and without materialising the score matrix (on the kernel backends). GQA
    /// gradients are summed into the shared key/value heads.
    ///
    /// # Shapes
    ///
    /// - q, out, grad_out: `[batch, q_heads, seq_q, head_dim]`
    /// - k, v: `[batch, kv_heads, seq_kv, head_dim]`
    /// - lse: `[batch, q_heads, seq_q]`
    /// - dq: like q; dk, dv: like k
    #[allow(clippy::too_many_arguments)]
    fn flash_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad_out: FloatTensor<Self>,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// An empty running state (`o = 0, m = -inf, l = 0`) for query rows of float type `input`
    /// (the state itself is f32 on the kernel backends, of type `input` on the others).
    ///
    /// # Shapes
    ///
    /// - shape: `[batch, heads, seq, head_dim]`
    /// - state: o `[batch, heads, seq, head_dim]`; m, l `[batch, heads, seq]`
    fn attention_state_empty(
        shape: [usize; 4],
        input: DType,
        device: &Self::Device,
    ) -> AttentionState<Self> {
        step::empty::<Self>(shape, input, device)
    }

    /// Folds one key/value chunk into the running state of the query rows `q`.
    ///
    /// # Shapes
    ///
    /// - q: `[batch, q_heads, seq_q, head_dim]`
    /// - k, v: `[batch, kv_heads, seq_kv, head_dim]`
    /// - state and result: o `[batch, q_heads, seq_q, head_dim]`; m, l `[batch, q_heads, seq_q]`
    fn attention_forward_step(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        state: AttentionState<Self>,
        step: StepMask,
    ) -> AttentionState<Self> {
        crate::attention_tensor_ops::forward_step::<Self>(q, k, v, state, step)
    }

    /// A new running state of the query rows `q` with its first key/value chunk folded in:
    /// [`attention_state_empty`](Self::attention_state_empty) then
    /// [`attention_forward_step`](Self::attention_forward_step), which is the default. The kernel
    /// backends write the state in one launch, with no fill before it and no state read.
    ///
    /// # Shapes
    ///
    /// - q: `[batch, q_heads, seq_q, head_dim]`
    /// - k, v: `[batch, kv_heads, seq_kv, head_dim]`
    /// - result: o `[batch, q_heads, seq_q, head_dim]`; m, l `[batch, q_heads, seq_q]`
    fn attention_forward_first_step(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        step: StepMask,
    ) -> AttentionState<Self> {
        let shape: [usize; 4] = q.shape().dims();
        let empty = Self::attention_state_empty(shape, q.dtype(), &Self::float_device(&q));
        Self::attention_forward_step(q, k, v, empty, step)
    }

    /// Merges two partial states of the same query rows.
    ///
    /// # Shapes
    ///
    /// - a, b and result: o `[batch, heads, seq, head_dim]`; m, l `[batch, heads, seq]`
    fn attention_merge(a: AttentionState<Self>, b: AttentionState<Self>) -> AttentionState<Self> {
        step::merge::<Self>(a, b)
    }

    /// `(O, lse)` of a finished state, O in float type `output`.
    ///
    /// # Shapes
    ///
    /// - state: o `[batch, heads, seq, head_dim]`; m, l `[batch, heads, seq]`
    /// - O: `[batch, heads, seq, head_dim]`
    /// - lse: `[batch, heads, seq]`
    fn attention_finalize(
        state: AttentionState<Self>,
        output: DType,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        step::finalize::<Self>(state, output)
    }

    /// `delta = rowsum(dO * O)`, the backward's preprocessing.
    ///
    /// # Shapes
    ///
    /// - out, grad_out: `[batch, heads, seq, head_dim]`
    /// - delta: `[batch, heads, seq]`
    fn attention_delta(out: FloatTensor<Self>, grad_out: FloatTensor<Self>) -> FloatTensor<Self> {
        step::delta::<Self>(out, grad_out)
    }

    /// One (query chunk, key chunk) pair's `(dq, dk, dv)` from the full rows' lse and delta
    /// (f32 on the kernel backends, for accumulation across steps).
    ///
    /// # Shapes
    ///
    /// - q, grad_out: `[batch, q_heads, seq_q, head_dim]`
    /// - k, v: `[batch, kv_heads, seq_kv, head_dim]`
    /// - lse, delta: `[batch, q_heads, seq_q]`
    /// - dq: like q; dk, dv: like k
    #[allow(clippy::too_many_arguments)]
    fn attention_backward_step(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        grad_out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        delta: FloatTensor<Self>,
        step: StepMask,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        crate::attention_tensor_ops::gradients::<Self>(q, k, v, grad_out, lse, delta, step)
    }

    /// The backend that computes and communicates in sequence-parallel calls.
    type Inner: FlashAttentionBackend;

    /// `device` as the inner backend's device.
    fn inner_device(device: &Self::Device) -> Device<Self::Inner>;

    /// `(O, lse)` of this rank's shards (validated by the caller).
    ///
    /// # Shapes
    ///
    /// - q: `[batch, q_heads, shard_len, head_dim]`
    /// - k, v: `[batch, kv_heads, shard_len, head_dim]`
    /// - O: `[batch, q_heads, shard_len, head_dim]`
    /// - lse: `[batch, q_heads, shard_len]`
    ///
    /// # Errors
    ///
    /// A [`Error`] when moving tensors between the ranks fails (a peer that stays silent,
    /// disagrees or has left, or a group broken by an earlier failure).
    fn sequence_parallel_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        group: &DeviceGroup<Self::Inner>,
        options: &SequenceParallelOptions,
    ) -> Result<(FloatTensor<Self>, FloatTensor<Self>), Error>;

    /// `(dq, dk, dv)` of this rank's shards from the forward's O and lse.
    ///
    /// # Shapes
    ///
    /// - q, out, grad_out: `[batch, q_heads, shard_len, head_dim]`
    /// - k, v: `[batch, kv_heads, shard_len, head_dim]`
    /// - lse: `[batch, q_heads, shard_len]`
    /// - dq: like q; dk, dv: like k
    ///
    /// # Errors
    ///
    /// A [`Error`] when moving tensors between the ranks fails, as for
    /// [`sequence_parallel_attention`](Self::sequence_parallel_attention).
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
    ) -> Result<Grads<Self>, Error>;

    /// `x W` of a linear layer. cuBLAS on CUDA `CubeBackend` tensors (feature `cublas`;
    /// contiguous f32/f16/bf16 operands), Burn's `matmul` elsewhere; on `Autodiff` one node whose
    /// backward products take the same path.
    ///
    /// # Shapes
    ///
    /// - x: `[rows, d_in]`
    /// - weight: `[d_in, d_out]`
    /// - output: `[rows, d_out]`
    fn linear_product(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self> {
        let wrap = |t| Tensor::<Self, 2>::from_primitive(TensorPrimitive::Float(t));
        product(wrap(x), wrap(weight), Transposed::Neither)
            .into_primitive()
            .tensor()
    }

    /// `silu(gate) * up` (SwiGLU's hidden activation), `gate` and `up` of one shape and float
    /// type. One CubeCL pass on `CubeBackend` (computing in f32), Burn tensor operations elsewhere.
    ///
    /// # Shapes
    ///
    /// - gate, up: `[batch, seq, d_ff]`
    /// - output: `[batch, seq, d_ff]`
    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        layer_ops::tensor_ops::swiglu::<Self>(gate, up)
    }

    /// `(hidden, dgate, dup)` of [`swiglu`](Self::swiglu) for the hidden gradient `dhidden`:
    /// the activation recomputed (the down projection's weight gradient needs it) and the
    /// gradients of `gate` and `up`.
    ///
    /// # Shapes
    ///
    /// - gate, up, dhidden: `[batch, seq, d_ff]`
    /// - hidden, dgate, dup: `[batch, seq, d_ff]`
    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        dhidden: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        layer_ops::tensor_ops::swiglu_backward::<Self>(gate, up, dhidden)
    }

    /// `x / sqrt(mean(x^2) + eps) * weight` over the last dimension of `x`, statistics in f32,
    /// the result in `x`'s float type.
    ///
    /// # Shapes
    ///
    /// - x: `[batch, seq, d]`
    /// - weight: `[d]`
    /// - output: `[batch, seq, d]`
    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        layer_ops::tensor_ops::rms_norm::<Self>(x, weight, eps)
    }

    /// `(dx, dweight)` of [`rms_norm`](Self::rms_norm) at `x` for the output gradient `grad`.
    ///
    /// # Shapes
    ///
    /// - x, grad: `[batch, seq, d]`
    /// - weight: `[d]`
    /// - dx: `[batch, seq, d]`; dweight: `[d]`
    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        layer_ops::tensor_ops::rms_norm_backward::<Self>(x, weight, grad, eps)
    }

    /// The rotary embedding of `x` with tables `cos`, `sin`: `x cos + rotate_half(x) sin`,
    /// `rotate_half([x1, x2]) = [-x2, x1]`; with `transpose` its adjoint (the rotation by the
    /// opposite angle, which maps the rotated tensor's gradient to the input's). `x` may be a
    /// strided view; the result is contiguous.
    ///
    /// # Shapes
    ///
    /// - x: `[batch, heads, len, head_dim]`
    /// - cos, sin: `[1, 1, len, head_dim]`
    /// - output: `[batch, heads, len, head_dim]`
    fn rotary(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        transpose: bool,
    ) -> FloatTensor<Self> {
        layer_ops::tensor_ops::rotary::<Self>(x, cos, sin, transpose)
    }

    /// `segment` applied to `x`, with its activations checkpointed at `placement`: on `Autodiff`
    /// one node of the graph that keeps only `x` (and, at [`CheckpointPlacement::AttentionOutput`],
    /// attention's output and lse) and recomputes the rest in the backward, with the same
    /// `documents` (the call's packed-document boundaries, if any); on backends without autodiff
    /// there is nothing to store and the segment simply runs. `x` is not checked first
    /// ([`TransformerBlock::try_forward`](crate::layers::TransformerBlock::try_forward) checks it,
    /// then calls this). On `Autodiff`, a failure while the backward pass recomputes the segment (a
    /// failed peer) panics there, since a backward pass cannot return an error.
    ///
    /// # Shapes
    ///
    /// - x: `[batch, seq, d_model]`
    /// - output: `[batch, seq, d_model]`
    ///
    /// # Errors
    ///
    /// The errors of the segment's forward (for a block, those of its attention).
    ///
    /// # Panics
    ///
    /// On `Autodiff`, when the segment does not have `PARENTS - 1` float parameters, or when
    /// its backward returns no gradient for one of them.
    fn checkpointed<S, const PARENTS: usize>(
        segment: &S,
        x: Tensor<Self, 3>,
        context: &AttentionContext<Self>,
        documents: Option<&Documents>,
        placement: CheckpointPlacement,
    ) -> Result<Tensor<Self, 3>, Error>
    where
        S: CheckpointSegment<Self, PARENTS>,
    {
        let _ = placement;
        segment.forward_stored(x, context, documents)
    }
}

/// A part of a model that [`FlashAttentionBackend::checkpointed`] can run as one gradient
/// checkpoint: on `Autodiff`, one node over the segment's input and its `PARENTS - 1` float
/// parameters (in the order [`Module::visit`] visits them). The plugin's
/// [`TransformerBlock`](crate::layers::TransformerBlock) is one; the node is built from the
/// segment's parameter list, so a segment's layers can change without touching the node. Each
/// method gets the call's `documents` (packed-document boundaries, or `None`), the same in the
/// forward and in the backward that recomputes it.
pub trait CheckpointSegment<B: FlashAttentionBackend, const PARENTS: usize>:
    Module<B> + 'static
{
    /// The same segment with its parameters on backend `O`.
    type On<O: FlashAttentionBackend<Inner = B::Inner>>: CheckpointSegment<O, PARENTS>;

    /// The forward through ordinary tensor operations (under autodiff, the graph stores every
    /// activation).
    ///
    /// # Errors
    ///
    /// The errors of the segment's attention.
    fn forward_stored(
        &self,
        x: Tensor<B, 3>,
        context: &AttentionContext<B>,
        documents: Option<&Documents>,
    ) -> Result<Tensor<B, 3>, Error>;

    /// The forward of a checkpoint: the output, and what the backward keeps besides `x` at
    /// `placement` (attention's output and lse at [`CheckpointPlacement::AttentionOutput`]).
    ///
    /// # Errors
    ///
    /// As [`forward_stored`](Self::forward_stored).
    #[allow(clippy::type_complexity)]
    fn forward_keeping(
        &self,
        x: Tensor<B, 3>,
        context: &AttentionContext<B>,
        documents: Option<&Documents>,
        placement: CheckpointPlacement,
    ) -> Result<(Tensor<B, 3>, Vec<FloatTensor<B>>), Error>;

    /// The gradients of `x` and of every float parameter (by [`ParamId`]) for the output
    /// gradient `grad`, recomputing what the forward did not keep from `x` and `kept`.
    ///
    /// # Errors
    ///
    /// The errors of the recomputed attention (a failed peer).
    #[allow(clippy::type_complexity)]
    fn backward(
        &self,
        x: Tensor<B, 3>,
        kept: Vec<FloatTensor<B>>,
        grad: Tensor<B, 3>,
        context: &AttentionContext<B>,
        documents: Option<&Documents>,
    ) -> Result<(Tensor<B, 3>, Vec<(ParamId, FloatTensor<B>)>), Error>;

    /// Whether the checkpoint keeps what the backward needs (`x` and what
    /// [`forward_keeping`](Self::forward_keeping) returned) in host memory between the forward and
    /// the backward ([`crate::offload`]). Default: on the device.
    fn offloads(&self) -> bool {
        false
    }

    /// This segment on the backend under autodiff (Burn's `valid`), which the checkpoint node
    /// runs.
    fn valid_segment(&self) -> Self::On<B::InnerBackend>
    where
        B: AutodiffBackend,
        B::InnerBackend: FlashAttentionBackend<Inner = B::Inner>;
}
