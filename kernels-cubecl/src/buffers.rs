//! The f32 device buffers the entry points start from and add into: the running softmax state,
//! the gradient accumulators, and fills.

use cubecl::prelude::*;

use crate::dims::AttentionDims;
use crate::grid;
use crate::kernel_error::{launch_result, KernelError};
use crate::limits::DeviceLimits;
use crate::state_kernels::{self, ELEMENT_UNITS};
use crate::tensor::{DeviceTensor, ElemType};

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

/// Queues [`state_kernels::fill_f32`] on `tensor` (f32, checked by the caller).
pub(crate) fn enqueue_fill<R: Runtime>(
    client: &ComputeClient<R>,
    limits: &DeviceLimits,
    tensor: &DeviceTensor,
    value: f32,
) -> Result<(), KernelError> {
    let (count, dim) = grid::linear_launch("fill", tensor.len(), ELEMENT_UNITS, limits)?;
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

/// Fills an f32 tensor with `value`.
pub fn fill<R: Runtime>(
    client: &ComputeClient<R>,
    tensor: &DeviceTensor,
    value: f32,
) -> Result<(), KernelError> {
    tensor.expect_elem("tensor", ElemType::F32)?;
    enqueue_fill(client, &DeviceLimits::of(client), tensor, value)?;
    launch_result(client, "fill")
}

/// A new f32 tensor filled with `value`, queued (not flushed).
pub(crate) fn enqueue_filled<R: Runtime>(
    client: &ComputeClient<R>,
    limits: &DeviceLimits,
    shape: Vec<usize>,
    value: f32,
) -> Result<DeviceTensor, KernelError> {
    let tensor = DeviceTensor::empty(client, shape, ElemType::F32);
    enqueue_fill(client, limits, &tensor, value)?;
    Ok(tensor)
}

/// A f32 tensor of zeros.
pub fn zeros_f32<R: Runtime>(
    client: &ComputeClient<R>,
    shape: Vec<usize>,
) -> Result<DeviceTensor, KernelError> {
    let tensor = enqueue_filled(client, &DeviceLimits::of(client), shape, 0.0)?;
    launch_result(client, "zeros_f32")?;
    Ok(tensor)
}

impl SoftmaxState {
    /// A state in which no row has seen any key yet (`o = 0, m = -inf, l = 0`), queued.
    pub(crate) fn enqueue_empty<R: Runtime>(
        client: &ComputeClient<R>,
        limits: &DeviceLimits,
        [batch, heads, len, head_dim]: [usize; 4],
    ) -> Result<Self, KernelError> {
        let rows = vec![batch, heads, len];
        Ok(Self {
            o: enqueue_filled(client, limits, vec![batch, heads, len, head_dim], 0.0)?,
            m: enqueue_filled(client, limits, rows.clone(), f32::NEG_INFINITY)?,
            l: enqueue_filled(client, limits, rows, 0.0)?,
        })
    }

    /// A state whose tensors are allocated but not written: only for a kernel that writes every
    /// element before anything reads it (the tensor-core first step).
    pub(crate) fn unfilled<R: Runtime>(client: &ComputeClient<R>, shape: [usize; 4]) -> Self {
        let [batch, heads, len, head_dim] = shape;
        let rows = vec![batch, heads, len];
        Self {
            o: DeviceTensor::empty(client, vec![batch, heads, len, head_dim], ElemType::F32),
            m: DeviceTensor::empty(client, rows.clone(), ElemType::F32),
            l: DeviceTensor::empty(client, rows, ElemType::F32),
        }
    }

    /// A state in which no row has seen any key yet (`o = 0, m = -inf, l = 0`).
    pub fn empty<R: Runtime>(
        client: &ComputeClient<R>,
        batch: usize,
        heads: usize,
        len: usize,
        head_dim: usize,
    ) -> Result<Self, KernelError> {
        let state = Self::enqueue_empty(
            client,
            &DeviceLimits::of(client),
            [batch, heads, len, head_dim],
        )?;
        launch_result(client, "SoftmaxState::empty")?;
        Ok(state)
    }

    /// The state's `[batch, heads, len, head_dim]`.
    pub fn shape(&self) -> &[usize] {
        &self.o.shape
    }

    pub(crate) fn check(&self, name: &str) -> Result<(), KernelError> {
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
    /// Zeroed accumulators, queued.
    pub(crate) fn enqueue_zeros<R: Runtime>(
        client: &ComputeClient<R>,
        limits: &DeviceLimits,
        dims: &AttentionDims,
    ) -> Result<Self, KernelError> {
        Ok(Self {
            dq: enqueue_filled(client, limits, dims.q_shape(), 0.0)?,
            dk: enqueue_filled(client, limits, dims.kv_shape(), 0.0)?,
            dv: enqueue_filled(client, limits, dims.kv_shape(), 0.0)?,
        })
    }

    /// Zeroed accumulators for the given dimensions.
    pub fn zeros<R: Runtime>(
        client: &ComputeClient<R>,
        dims: &AttentionDims,
    ) -> Result<Self, KernelError> {
        let grads = Self::enqueue_zeros(client, &DeviceLimits::of(client), dims)?;
        launch_result(client, "GradAccumulators::zeros")?;
        Ok(grads)
    }
}
