//! Host-side entry points: validate shapes and types, pick a kernel variant, launch.

use cubecl::prelude::*;

use crate::dims::{AttentionDims, Mask};
use crate::error::KernelError;
use crate::portable::{self, ROWS_PER_CUBE};
use crate::state_kernels;
use crate::tensor::{DeviceTensor, ElemType};

/// Runs `$body` with the type alias `$E` bound to the Rust type of an [`ElemType`].
macro_rules! with_elem_type {
    ($elem:expr, $E:ident => $body:expr) => {
        match $elem {
            ElemType::F16 => {
                type $E = half::f16;
                $body
            }
            ElemType::BF16 => {
                type $E = half::bf16;
                $body
            }
            ElemType::F32 => {
                type $E = f32;
                $body
            }
        }
    };
}
pub(crate) use with_elem_type;

/// Which implementation runs a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Variant {
    /// The tensor-core variant where the runtime and shapes allow it, the portable one otherwise.
    #[default]
    Auto,
    /// Scalar kernels that run on every CubeCL runtime.
    Portable,
    /// Tensor-core kernels (CUDA with `mma.sync`); an error where unavailable.
    TensorCore,
}

/// Options of one attention step.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepOptions {
    /// Which keys each query sees.
    pub mask: Mask,
    /// Score scale; `None` means `1 / sqrt(head_dim)`.
    pub scale: Option<f32>,
    /// Kernel variant.
    pub variant: Variant,
}

impl StepOptions {
    /// The scale actually applied to `q . k`.
    pub fn resolved_scale(&self, head_dim: usize) -> f32 {
        self.scale.unwrap_or(1.0 / (head_dim as f32).sqrt())
    }
}

/// The running state `(o, m, l)` of a block of query rows, all f32: `o` is `[B, H, S, D]`,
/// `m` and `l` are `[B, H, S]`.
#[derive(Clone, Debug)]
pub struct SoftmaxState {
    /// Unnormalised output.
    pub o: DeviceTensor,
    /// Running max of the scores.
    pub m: DeviceTensor,
    /// Running sum of `exp(score - m)`.
    pub l: DeviceTensor,
}

/// f32 gradient accumulators of one (query chunk, key chunk) set.
#[derive(Clone, Debug)]
pub struct GradAccumulators {
    /// `[B, Hq, Sq, D]`.
    pub dq: DeviceTensor,
    /// `[B, Hkv, Skv, D]`.
    pub dk: DeviceTensor,
    /// `[B, Hkv, Skv, D]`.
    pub dv: DeviceTensor,
}

fn linear_count(len: usize, per_cube: usize) -> (CubeCount, CubeDim) {
    (
        CubeCount::Static(len.div_ceil(per_cube) as u32, 1, 1),
        CubeDim::new_1d(per_cube as u32),
    )
}

/// Fills an f32 tensor with `value`.
pub fn fill<R: Runtime>(
    client: &ComputeClient<R>,
    tensor: &DeviceTensor,
    value: f32,
) -> Result<(), KernelError> {
    tensor.expect_elem("tensor", ElemType::F32)?;
    let (count, dim) = linear_count(tensor.len(), 256);
    state_kernels::fill_f32::launch::<R>(
        client,
        count,
        dim,
        tensor.array_arg(),
        value,
        tensor.len() as u32,
    );
    Ok(())
}

/// A f32 tensor of zeros.
pub fn zeros_f32<R: Runtime>(client: &ComputeClient<R>, shape: Vec<usize>) -> DeviceTensor {
    let tensor = DeviceTensor::empty(client, shape, ElemType::F32);
    fill(client, &tensor, 0.0).expect("an f32 tensor");
    tensor
}

impl SoftmaxState {
    /// A state in which no row has seen any key yet (`o = 0, m = -inf, l = 0`).
    pub fn empty<R: Runtime>(
        client: &ComputeClient<R>,
        batch: usize,
        heads: usize,
        len: usize,
        head_dim: usize,
    ) -> Self {
        let o = zeros_f32(client, vec![batch, heads, len, head_dim]);
        let m = DeviceTensor::empty(client, vec![batch, heads, len], ElemType::F32);
        fill(client, &m, f32::NEG_INFINITY).expect("an f32 tensor");
        let l = zeros_f32(client, vec![batch, heads, len]);
        Self { o, m, l }
    }

    /// The state's `[batch, heads, len, head_dim]`.
    pub fn shape(&self) -> &[usize] {
        &self.o.shape
    }

    fn check(&self, name: &str) -> Result<(), KernelError> {
        let row_shape = &self.o.shape[..self.o.shape.len().saturating_sub(1)];
        if self.o.shape.len() != 4 {
            return Err(KernelError::ShapeMismatch {
                what: format!("{name}.o must be [batch, heads, len, head_dim]"),
                expected: vec![],
                got: self.o.shape.clone(),
            });
        }
        AttentionDims::expect_shape(&format!("{name}.m"), row_shape, &self.m.shape)?;
        AttentionDims::expect_shape(&format!("{name}.l"), row_shape, &self.l.shape)?;
        for (field, t) in [("o", &self.o), ("m", &self.m), ("l", &self.l)] {
            t.expect_elem(&format!("{name}.{field}"), ElemType::F32)?;
        }
        Ok(())
    }
}

impl GradAccumulators {
    /// Zeroed accumulators for the given dimensions.
    pub fn zeros<R: Runtime>(client: &ComputeClient<R>, dims: &AttentionDims) -> Self {
        Self {
            dq: zeros_f32(client, dims.q_shape()),
            dk: zeros_f32(client, dims.kv_shape()),
            dv: zeros_f32(client, dims.kv_shape()),
        }
    }
}

fn check_qkv(
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
) -> Result<AttentionDims, KernelError> {
    let dims = AttentionDims::from_qkv(&q.shape, &k.shape, &v.shape)?;
    k.expect_elem("k", q.elem)?;
    v.expect_elem("v", q.elem)?;
    if dims.batch * dims.q_heads > u16::MAX as usize {
        return Err(KernelError::BadLength {
            what: format!(
                "batch * q_heads = {} exceeds the grid limit 65535",
                dims.batch * dims.q_heads
            ),
        });
    }
    Ok(dims)
}

/// Rows of the other operand one portable launch may walk. Mesa's llvmpipe (the CPU Vulkan
/// driver CI runs on) silently stops a shader's loops after 65535 iterations in total, and the
/// portable kernels spend about `3 * head_dim` iterations per row walked; the stat-carrying
/// state (and the additive gradients) make splitting a step into launches exact.
fn portable_span(head_dim: usize) -> usize {
    const LOOP_BUDGET: usize = 60_000;
    (LOOP_BUDGET / (4 * head_dim + 8)).max(1)
}

/// `[begin, end)` ranges of at most `portable_span(head_dim)` rows covering `0..len`.
fn portable_ranges(len: usize, head_dim: usize) -> impl Iterator<Item = (u32, u32)> {
    let span = portable_span(head_dim);
    (0..len)
        .step_by(span)
        .map(move |begin| (begin as u32, (begin + span).min(len) as u32))
}

fn query_grid(dims: &AttentionDims) -> (CubeCount, CubeDim) {
    (
        CubeCount::Static(
            dims.q_len.div_ceil(ROWS_PER_CUBE) as u32,
            (dims.batch * dims.q_heads) as u32,
            1,
        ),
        CubeDim::new_1d(ROWS_PER_CUBE as u32),
    )
}

fn key_grid(dims: &AttentionDims) -> (CubeCount, CubeDim) {
    (
        CubeCount::Static(
            dims.kv_len.div_ceil(ROWS_PER_CUBE) as u32,
            (dims.batch * dims.kv_heads) as u32,
            1,
        ),
        CubeDim::new_1d(ROWS_PER_CUBE as u32),
    )
}

/// Whether the tensor-core variant can run these inputs on this client.
pub fn tensor_core_available<R: Runtime>(
    client: &ComputeClient<R>,
    elem: ElemType,
    head_dim: usize,
) -> bool {
    crate::tensor_core::supports(client, elem, head_dim)
}

fn use_tensor_cores<R: Runtime>(
    client: &ComputeClient<R>,
    variant: Variant,
    dims: &AttentionDims,
    elem: ElemType,
) -> Result<bool, KernelError> {
    let available = tensor_core_available(client, elem, dims.head_dim);
    match variant {
        Variant::Portable => Ok(false),
        Variant::Auto => Ok(available),
        Variant::TensorCore if available => Ok(true),
        Variant::TensorCore => Err(KernelError::DType {
            what: format!(
                "the tensor-core variant needs a runtime with f16/bf16 mma.sync and head_dim in {:?}; got {elem:?}, head_dim {}",
                crate::tensor_core::HEAD_DIMS,
                dims.head_dim
            ),
        }),
    }
}

/// Folds one key/value chunk into the running state of the query rows `q`.
pub fn forward_step<R: Runtime>(
    client: &ComputeClient<R>,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    state: &SoftmaxState,
    options: &StepOptions,
) -> Result<(), KernelError> {
    let dims = check_qkv(q, k, v)?;
    state.check("state")?;
    AttentionDims::expect_shape("state.o", &dims.q_shape(), &state.o.shape)?;
    let scale = options.resolved_scale(dims.head_dim);
    let shift = options.mask.diagonal_shift(&dims);
    if use_tensor_cores(client, options.variant, &dims, q.elem)? {
        return crate::tensor_core::forward_step(client, q, k, v, state, &dims, scale, shift);
    }
    for (key_begin, key_end) in portable_ranges(dims.kv_len, dims.head_dim) {
        let (count, dim) = query_grid(&dims);
        with_elem_type!(q.elem, E => portable::forward::forward_step_portable::launch::<E, R>(
            client,
            count,
            dim,
            q.array_arg(),
            k.array_arg(),
            v.array_arg(),
            state.o.array_arg(),
            state.m.array_arg(),
            state.l.array_arg(),
            scale,
            shift.unwrap_or(0),
            dims.q_len as u32,
            dims.kv_len as u32,
            dims.q_heads as u32,
            dims.group_size() as u32,
            key_begin,
            key_end,
            dims.head_dim,
            shift.is_some(),
        ));
    }
    Ok(())
}

/// Merges the partial state `other` into `into` (same shapes), in place.
pub fn merge<R: Runtime>(
    client: &ComputeClient<R>,
    into: &SoftmaxState,
    other: &SoftmaxState,
) -> Result<(), KernelError> {
    into.check("into")?;
    other.check("other")?;
    AttentionDims::expect_shape("other.o", &into.o.shape, &other.o.shape)?;
    let rows = into.m.len();
    let head_dim = into.o.shape[3];
    let (count, dim) = linear_count(rows, 64);
    state_kernels::merge_states::launch::<R>(
        client,
        count,
        dim,
        into.o.array_arg(),
        into.m.array_arg(),
        into.l.array_arg(),
        other.o.array_arg(),
        other.m.array_arg(),
        other.l.array_arg(),
        rows as u32,
        head_dim,
    );
    Ok(())
}

/// Turns a finished state into the output (in `elem`) and the f32 log-sum-exp `[B, H, S]`.
pub fn finalize<R: Runtime>(
    client: &ComputeClient<R>,
    state: &SoftmaxState,
    elem: ElemType,
) -> Result<(DeviceTensor, DeviceTensor), KernelError> {
    let out = DeviceTensor::empty(client, state.o.shape.clone(), elem);
    let lse = DeviceTensor::empty(client, state.m.shape.clone(), ElemType::F32);
    finalize_into(client, state, &out, &lse)?;
    Ok((out, lse))
}

/// [`finalize`] into caller-provided `out` (`[B, H, S, D]`, any element type) and `lse`
/// (`[B, H, S]`, f32); every element of both is written.
pub fn finalize_into<R: Runtime>(
    client: &ComputeClient<R>,
    state: &SoftmaxState,
    out: &DeviceTensor,
    lse: &DeviceTensor,
) -> Result<(), KernelError> {
    state.check("state")?;
    AttentionDims::expect_shape("out", &state.o.shape, &out.shape)?;
    AttentionDims::expect_shape("lse", &state.m.shape, &lse.shape)?;
    lse.expect_elem("lse", ElemType::F32)?;
    let rows = state.m.len();
    let head_dim = state.o.shape[3];
    let (count, dim) = linear_count(rows, 64);
    with_elem_type!(out.elem, E => state_kernels::finalize_state::launch::<E, R>(
        client,
        count,
        dim,
        state.o.array_arg(),
        state.m.array_arg(),
        state.l.array_arg(),
        out.array_arg(),
        lse.array_arg(),
        rows as u32,
        head_dim,
    ));
    Ok(())
}

/// `delta = rowsum(dO * O)` in f32, `[B, H, S]`: the backward's preprocessing.
pub fn backward_delta<R: Runtime>(
    client: &ComputeClient<R>,
    out: &DeviceTensor,
    grad_out: &DeviceTensor,
) -> Result<DeviceTensor, KernelError> {
    AttentionDims::expect_shape("grad_out", &out.shape, &grad_out.shape)?;
    grad_out.expect_elem("grad_out", out.elem)?;
    if out.shape.len() != 4 {
        return Err(KernelError::Rank {
            name: "out",
            expected: 4,
            got: out.shape.clone(),
        });
    }
    let rows = out.len() / out.shape[3];
    let delta = DeviceTensor::empty(client, out.shape[..3].to_vec(), ElemType::F32);
    let (count, dim) = linear_count(rows, 64);
    with_elem_type!(out.elem, E => portable::backward::backward_delta::launch::<E, R>(
        client,
        count,
        dim,
        out.array_arg(),
        grad_out.array_arg(),
        delta.array_arg(),
        rows as u32,
        out.shape[3],
    ));
    Ok(delta)
}

/// Adds this (query chunk, key chunk) pair's contribution to `grads.dq`, `grads.dk`, `grads.dv`,
/// from the stored full-row `lse` and `delta` (no forward recomputation).
#[allow(clippy::too_many_arguments)]
pub fn backward_step<R: Runtime>(
    client: &ComputeClient<R>,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    grad_out: &DeviceTensor,
    lse: &DeviceTensor,
    delta: &DeviceTensor,
    grads: &GradAccumulators,
    options: &StepOptions,
) -> Result<(), KernelError> {
    let dims = check_qkv(q, k, v)?;
    AttentionDims::expect_shape("grad_out", &dims.q_shape(), &grad_out.shape)?;
    grad_out.expect_elem("grad_out", q.elem)?;
    AttentionDims::expect_shape("lse", &dims.row_shape(), &lse.shape)?;
    AttentionDims::expect_shape("delta", &dims.row_shape(), &delta.shape)?;
    AttentionDims::expect_shape("dq", &dims.q_shape(), &grads.dq.shape)?;
    AttentionDims::expect_shape("dk", &dims.kv_shape(), &grads.dk.shape)?;
    AttentionDims::expect_shape("dv", &dims.kv_shape(), &grads.dv.shape)?;
    for (name, t) in [
        ("lse", lse),
        ("delta", delta),
        ("dq", &grads.dq),
        ("dk", &grads.dk),
        ("dv", &grads.dv),
    ] {
        t.expect_elem(name, ElemType::F32)?;
    }
    let scale = options.resolved_scale(dims.head_dim);
    let shift = options.mask.diagonal_shift(&dims);
    if use_tensor_cores(client, options.variant, &dims, q.elem)? {
        return crate::tensor_core::backward_step(
            client,
            (q, k, v),
            grad_out,
            lse,
            delta,
            grads,
            &dims,
            scale,
            shift,
        );
    }
    for (key_begin, key_end) in portable_ranges(dims.kv_len, dims.head_dim) {
        let (count, dim) = query_grid(&dims);
        with_elem_type!(q.elem, E => portable::backward::backward_dq_portable::launch::<E, R>(
            client,
            count,
            dim,
            q.array_arg(),
            k.array_arg(),
            v.array_arg(),
            grad_out.array_arg(),
            lse.array_arg(),
            delta.array_arg(),
            grads.dq.array_arg(),
            scale,
            shift.unwrap_or(0),
            dims.q_len as u32,
            dims.kv_len as u32,
            dims.q_heads as u32,
            dims.group_size() as u32,
            key_begin,
            key_end,
            dims.head_dim,
            shift.is_some(),
        ));
    }
    for (query_begin, query_end) in portable_ranges(dims.q_len, dims.head_dim * dims.group_size()) {
        let (count, dim) = key_grid(&dims);
        with_elem_type!(q.elem, E => portable::backward::backward_dkdv_portable::launch::<E, R>(
            client,
            count,
            dim,
            q.array_arg(),
            k.array_arg(),
            v.array_arg(),
            grad_out.array_arg(),
            lse.array_arg(),
            delta.array_arg(),
            grads.dk.array_arg(),
            grads.dv.array_arg(),
            scale,
            shift.unwrap_or(0),
            dims.q_len as u32,
            dims.kv_len as u32,
            dims.kv_heads as u32,
            dims.group_size() as u32,
            query_begin,
            query_end,
            dims.head_dim,
            shift.is_some(),
        ));
    }
    Ok(())
}

/// Casts an f32 tensor (an accumulator) to `elem`.
pub fn cast_f32<R: Runtime>(
    client: &ComputeClient<R>,
    input: &DeviceTensor,
    elem: ElemType,
) -> Result<DeviceTensor, KernelError> {
    input.expect_elem("input", ElemType::F32)?;
    if elem == ElemType::F32 {
        return Ok(input.clone());
    }
    let out = DeviceTensor::empty(client, input.shape.clone(), elem);
    let (count, dim) = linear_count(input.len(), 256);
    with_elem_type!(elem, E => state_kernels::cast_from_f32::launch::<E, R>(
        client,
        count,
        dim,
        input.array_arg(),
        out.array_arg(),
        input.len() as u32,
    ));
    Ok(out)
}

/// Whole attention in one call: `(O, lse)` for q against all of k, v.
pub fn attention<R: Runtime>(
    client: &ComputeClient<R>,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    options: &StepOptions,
) -> Result<(DeviceTensor, DeviceTensor), KernelError> {
    let dims = check_qkv(q, k, v)?;
    let state = SoftmaxState::empty(client, dims.batch, dims.q_heads, dims.q_len, dims.head_dim);
    forward_step(client, q, k, v, &state, options)?;
    finalize(client, &state, q.elem)
}

/// Whole attention backward in one call: `(dq, dk, dv)` in the input element type.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<R: Runtime>(
    client: &ComputeClient<R>,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    out: &DeviceTensor,
    lse: &DeviceTensor,
    grad_out: &DeviceTensor,
    options: &StepOptions,
) -> Result<(DeviceTensor, DeviceTensor, DeviceTensor), KernelError> {
    let dims = check_qkv(q, k, v)?;
    AttentionDims::expect_shape("out", &dims.q_shape(), &out.shape)?;
    let delta = backward_delta(client, out, grad_out)?;
    let grads = GradAccumulators::zeros(client, &dims);
    backward_step(client, q, k, v, grad_out, lse, &delta, &grads, options)?;
    Ok((
        cast_f32(client, &grads.dq, q.elem)?,
        cast_f32(client, &grads.dk, q.elem)?,
        cast_f32(client, &grads.dv, q.elem)?,
    ))
}
