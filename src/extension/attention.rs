//! The attention capability of a backend: exact softmax attention with its statistics and a
//! fused backward, one-shot or step by step over the running state `(o, m, l)`.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, TensorMetadata};

use distflash_kernels::AttentionDims;

use crate::options::FlashAttentionOptions;
use crate::step::{self, AttentionState, StepRows};
use crate::Error;

/// Attention on a Burn backend: the one-shot `(O, lse)` and its backward, and the step
/// operations sequence-parallel attention is built from (an empty state, folding one key/value
/// chunk in, merging partial states, finishing a state, the backward's `delta` and one pair's
/// gradients, returned or added into the caller's accumulators). The defaults are Burn tensor
/// operations (every backend has them); the CubeCL backends run this project's kernels instead.
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
///   [`lse_dtype`](AttentionBackend::lse_dtype) (f32 where the backend allows it)
///
/// # Panics
///
/// Callers validate the inputs first, [`AttentionBackend::check_attention_limits`] included
/// (the public functions do); implementations may panic on invalid input, and panic (never
/// return silent zeros) when a kernel launch fails anyway.
pub trait AttentionBackend: Backend {
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

    /// Folds one key/value chunk into the running state of the query rows `q`, under `options`
    /// whose mask sits at the chunks' absolute offsets ([`Mask::at`](crate::Mask::at)).
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
        options: FlashAttentionOptions,
    ) -> AttentionState<Self> {
        crate::attention_tensor_ops::forward_step::<Self>(q, k, v, state, options)
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
        options: FlashAttentionOptions,
    ) -> AttentionState<Self> {
        let shape: [usize; 4] = q.shape().dims();
        let empty = Self::attention_state_empty(shape, q.dtype(), &Self::float_device(&q));
        Self::attention_forward_step(q, k, v, empty, options)
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

    /// `t` cut along the sequence (dimension 2) into `chunks` tensors of equal length, in order,
    /// each of which the step operations take as it is. The kernel backends make each chunk
    /// contiguous (the kernels take contiguous buffers, and a chunk's rows of
    /// `[batch, heads, seq, ..]` are `batch x heads` separate runs: copied into a buffer of
    /// their own unless `batch x heads` is 1), so `t`'s buffer is then freed with its last
    /// handle; the default is the chunks' slices of `t`. One chunk is `t` itself, never copied.
    ///
    /// # Shapes
    ///
    /// - t: `[batch, heads, seq, ..]`, `seq` a multiple of `chunks`
    /// - each chunk: `[batch, heads, seq / chunks, ..]`
    fn attention_chunks(t: FloatTensor<Self>, chunks: usize) -> Vec<FloatTensor<Self>> {
        step::chunk_slices::<Self>(t, chunks)
    }

    /// One (query chunk, key chunk) pair's `(dq, dk, dv)` from the full rows' lse and delta
    /// (f32 on the kernel backends, for accumulation across steps), under `options` whose mask
    /// sits at the chunks' absolute offsets.
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
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        crate::attention_tensor_ops::gradients::<Self>(q, k, v, grad_out, lse, delta, options)
    }

    /// One (query chunk, key chunk) pair's `(dq, dk, dv)`, as
    /// [`attention_backward_step`](Self::attention_backward_step) computes them, added into rows
    /// `rows` of the caller's f32 accumulators `grads` (shaped like the whole query and
    /// key/value shards; see [`StepRows`]); returns the accumulators. The default is the step
    /// and then a tensor-op addition into the rows ([`step::add_step_grads`]). The kernel
    /// backends add into the accumulators themselves, in place when the caller holds them alone
    /// (no gradient of the pair's size beside them; rows that are not all of an accumulator go
    /// through a contiguous copy of those rows).
    ///
    /// # Shapes
    ///
    /// - q, grad_out: `[batch, q_heads, seq_q, head_dim]`
    /// - k, v: `[batch, kv_heads, seq_kv, head_dim]`
    /// - lse, delta: `[batch, q_heads, seq_q]`
    /// - grads: dq `[batch, q_heads, rows_q, head_dim]` with `rows.query` of length `seq_q`
    ///   within `0..rows_q`; dk, dv `[batch, kv_heads, rows_kv, head_dim]` with `rows.kv` of
    ///   length `seq_kv` within `0..rows_kv`; all f32
    #[allow(clippy::too_many_arguments)]
    fn attention_backward_step_add(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        grad_out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        delta: FloatTensor<Self>,
        grads: (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>),
        rows: &StepRows,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let step = Self::attention_backward_step(q, k, v, grad_out, lse, delta, options);
        step::add_step_grads::<Self>(grads, rows, step)
    }
}
