//! Host-side entry points: validate inputs, plan the launches within the device's limits (see
//! [`crate::plan`]), queue them, and report a launch the runtime refused as an error.

use cubecl::prelude::*;

pub use crate::buffers::{fill, zeros_f32, GradAccumulators, SoftmaxState};
pub use crate::step_options::{StepOptions, Variant};

use crate::attention_params::CallParams;
use crate::buffers::enqueue_filled;
use crate::dims::AttentionDims;
use crate::grid;
use crate::hopper;
use crate::inputs::{check_backward, check_qkv};
use crate::kernel_error::{launch_result, KernelError};
use crate::limits::DeviceLimits;
use crate::mask::{DocumentTable, KernelMask};
use crate::plan::LaunchPlan;
use crate::portable::{self, ROWS_PER_CUBE};
use crate::state_kernels::{self, ELEMENT_UNITS, ROW_LANES, ROW_UNITS};
use crate::tensor::{with_elem_type, DeviceTensor, ElemType};
use crate::tensor_core::dq_fragments;
use crate::tensor_core::{DqTarget, ForwardTarget, KeyGrads};

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

fn portable_cube() -> CubeDim {
    CubeDim::new_1d(ROWS_PER_CUBE as u32)
}

/// Whether the tensor-core variant can run these inputs on this client (runtime features,
/// element type and head dim; `check_launch` also checks the device's limits).
pub fn tensor_core_available<R: Runtime>(
    client: &ComputeClient<R>,
    elem: ElemType,
    head_dim: usize,
) -> bool {
    crate::tensor_core::supports(client, elem, head_dim)
}

/// The forward step's launches, queued.
fn enqueue_forward<R: Runtime>(
    client: &ComputeClient<R>,
    plan: &LaunchPlan,
    (q, k, v): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    state: &SoftmaxState,
    dims: &AttentionDims,
    options: &StepOptions,
) {
    let portable = match plan {
        LaunchPlan::TensorCore(grids) => {
            let target = ForwardTarget::Step(state);
            return enqueue_tensor_core_forward(client, grids, (q, k, v), target, dims, options);
        }
        LaunchPlan::Portable(portable) => portable,
    };
    let params = CallParams::new(dims, options).queries;
    let docs = DocumentTable::of(client, &options.mask, &q.handle);
    for (key_begin, key_end) in portable_ranges(dims.kv_len, dims.head_dim) {
        with_elem_type!(q.elem, E => portable::forward::forward_step_portable::launch::<E, R>(
            client,
            portable.query_grid.clone(),
            portable_cube(),
            q.array_arg(),
            k.array_arg(),
            v.array_arg(),
            state.o.array_arg(),
            state.m.array_arg(),
            state.l.array_arg(),
            docs.array_arg(),
            params.launch_arg(),
            key_begin,
            key_end,
        ));
    }
}

/// Queues the Hopper forward of `q, k, v` into `target` where it runs the call
/// ([`hopper::choose_forward`]); whether it did.
fn enqueue_hopper_forward<R: Runtime>(
    client: &ComputeClient<R>,
    qkv: (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    target: &ForwardTarget,
    dims: &AttentionDims,
    options: &StepOptions,
) -> Result<bool, KernelError> {
    let Some(launch) = hopper::choose_forward(client, dims, options, qkv, target)? else {
        return Ok(false);
    };
    hopper::enqueue_forward(client, &launch, qkv, target, dims, options);
    Ok(true)
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
    let (_, plan) = LaunchPlan::for_call(client, &dims, q.elem, options)?;
    let target = ForwardTarget::Step(state);
    if !enqueue_hopper_forward(client, (q, k, v), &target, &dims, options)? {
        enqueue_forward(client, &plan, (q, k, v), state, &dims, options);
    }
    launch_result(client, "forward_step")
}

/// A new running state of the query rows `q` with the first key/value chunk folded in: what
/// [`SoftmaxState::empty`] and then [`forward_step`] give, in one kernel on the Hopper and
/// tensor-core paths (no kernel fills the empty state, and the step reads none).
///
/// # Errors
///
/// As [`forward_step`].
pub fn forward_first_step<R: Runtime>(
    client: &ComputeClient<R>,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    options: &StepOptions,
) -> Result<SoftmaxState, KernelError> {
    let dims = check_qkv(q, k, v)?;
    let (limits, plan) = LaunchPlan::for_call(client, &dims, q.elem, options)?;
    let shape = [dims.batch, dims.q_heads, dims.q_len, dims.head_dim];
    let unfilled = SoftmaxState::unfilled(client, shape);
    let target = ForwardTarget::FirstStep(&unfilled);
    if enqueue_hopper_forward(client, (q, k, v), &target, &dims, options)? {
        launch_result(client, "forward_first_step")?;
        return Ok(unfilled);
    }
    let state = match &plan {
        LaunchPlan::TensorCore(grids) => {
            let target = ForwardTarget::FirstStep(&unfilled);
            enqueue_tensor_core_forward(client, grids, (q, k, v), target, &dims, options);
            unfilled
        }
        LaunchPlan::Portable(_) => {
            let state = SoftmaxState::enqueue_empty(client, &limits, shape)?;
            enqueue_forward(client, &plan, (q, k, v), &state, &dims, options);
            state
        }
    };
    launch_result(client, "forward_first_step")?;
    Ok(state)
}

/// Folds the last key/value chunk into `state` and returns the finished output (in the inputs'
/// element type) and f32 log-sum-exp `[B, H, S]`: what [`forward_step`] and then [`finalize`]
/// give, in one kernel on the Hopper and tensor-core paths (no kernel writes the state back or
/// reads it again). The state is consumed: those paths leave its tensors as they were.
///
/// # Errors
///
/// As [`forward_step`].
pub fn forward_last_step<R: Runtime>(
    client: &ComputeClient<R>,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    state: SoftmaxState,
    options: &StepOptions,
) -> Result<(DeviceTensor, DeviceTensor), KernelError> {
    let dims = check_qkv(q, k, v)?;
    state.check("state")?;
    AttentionDims::expect_shape("state.o", &dims.q_shape(), &state.o.shape)?;
    finished_forward(
        client,
        (q, k, v),
        Some(&state),
        &dims,
        options,
        "forward_last_step",
    )
}

/// `(O, lse)` of the keys `k`, `v` merged into `state` (a last step) or, without one, of the
/// keys alone (a whole attention), for validated `dims`: one kernel on the Hopper and
/// tensor-core paths (Hopper where it is chosen, see [`hopper::choose_forward`]); an empty state
/// where none is given, the forward and the finalisation on the portable one.
fn finished_forward<R: Runtime>(
    client: &ComputeClient<R>,
    (q, k, v): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    state: Option<&SoftmaxState>,
    dims: &AttentionDims,
    options: &StepOptions,
    call: &str,
) -> Result<(DeviceTensor, DeviceTensor), KernelError> {
    let (limits, plan) = LaunchPlan::for_call(client, dims, q.elem, options)?;
    let out = DeviceTensor::empty(client, dims.q_shape(), q.elem);
    let lse = DeviceTensor::empty(client, dims.row_shape(), ElemType::F32);
    let target = |(out, lse)| match state {
        Some(state) => ForwardTarget::LastStep { state, out, lse },
        None => ForwardTarget::Finished { out, lse },
    };
    if enqueue_hopper_forward(client, (q, k, v), &target((&out, &lse)), dims, options)? {
        launch_result(client, call)?;
        return Ok((out, lse));
    }
    match &plan {
        LaunchPlan::TensorCore(grids) => {
            let target = target((&out, &lse));
            enqueue_tensor_core_forward(client, grids, (q, k, v), target, dims, options);
        }
        LaunchPlan::Portable(_) => {
            let state = match state {
                Some(state) => state.clone(),
                None => SoftmaxState::enqueue_empty(
                    client,
                    &limits,
                    [dims.batch, dims.q_heads, dims.q_len, dims.head_dim],
                )?,
            };
            enqueue_forward(client, &plan, (q, k, v), &state, dims, options);
            enqueue_finalize(client, &limits, &state, &out, &lse)?;
        }
    }
    launch_result(client, call)?;
    Ok((out, lse))
}

/// The tensor-core forward of `target`, with the options' scale and mask resolved for `dims`.
fn enqueue_tensor_core_forward<R: Runtime>(
    client: &ComputeClient<R>,
    grids: &crate::tensor_core::Grids,
    (q, k, v): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    target: ForwardTarget,
    dims: &AttentionDims,
    options: &StepOptions,
) {
    let params = CallParams::new(dims, options).queries;
    let docs = DocumentTable::of(client, &options.mask, &q.handle);
    crate::tensor_core::forward(client, q, k, v, target, grids, &params, &docs);
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
    let (count, dim) = grid::linear_launch(
        "merge",
        rows * ROW_LANES,
        ROW_UNITS,
        &DeviceLimits::of(client),
    )?;
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
    launch_result(client, "merge")
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

/// [`finalize_into`]'s launch, queued (arguments checked by the caller).
fn enqueue_finalize<R: Runtime>(
    client: &ComputeClient<R>,
    limits: &DeviceLimits,
    state: &SoftmaxState,
    out: &DeviceTensor,
    lse: &DeviceTensor,
) -> Result<(), KernelError> {
    let rows = state.m.len();
    let head_dim = state.o.shape[3];
    let (count, dim) = grid::linear_launch("finalize", rows * ROW_LANES, ROW_UNITS, limits)?;
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
    let limits = DeviceLimits::of(client);
    limits.expect_elem(out.elem)?;
    enqueue_finalize(client, &limits, state, out, lse)?;
    launch_result(client, "finalize")
}

/// [`backward_delta`]'s launch, queued.
fn enqueue_delta<R: Runtime>(
    client: &ComputeClient<R>,
    limits: &DeviceLimits,
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
    limits.expect_elem(out.elem)?;
    let rows = out.len() / out.shape[3];
    let (count, dim) = grid::linear_launch("backward_delta", rows * ROW_LANES, ROW_UNITS, limits)?;
    let delta = DeviceTensor::empty(client, out.shape[..3].to_vec(), ElemType::F32);
    with_elem_type!(out.elem, E => state_kernels::backward_delta::launch::<E, R>(
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

/// `delta = rowsum(dO * O)` in f32, `[B, H, S]`: the backward's preprocessing.
pub fn backward_delta<R: Runtime>(
    client: &ComputeClient<R>,
    out: &DeviceTensor,
    grad_out: &DeviceTensor,
) -> Result<DeviceTensor, KernelError> {
    let delta = enqueue_delta(client, &DeviceLimits::of(client), out, grad_out)?;
    launch_result(client, "backward_delta")?;
    Ok(delta)
}

/// The backward step's launches, queued (arguments checked by the caller). The tensor-core
/// backward, unless deterministic, adds dQ into a zeroed scratch in fragment order (see
/// [`crate::tensor_core::dq_fragments`]) and then the scratch into `grads.dq`.
#[allow(clippy::too_many_arguments)]
fn enqueue_backward<R: Runtime>(
    client: &ComputeClient<R>,
    limits: &DeviceLimits,
    plan: &LaunchPlan,
    (q, k, v): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    grad_out: &DeviceTensor,
    lse: &DeviceTensor,
    delta: &DeviceTensor,
    grads: &GradAccumulators,
    dims: &AttentionDims,
    options: &StepOptions,
) -> Result<(), KernelError> {
    let params = CallParams::new(dims, options);
    let docs = DocumentTable::of(client, &options.mask, &q.handle);
    let scale = params.queries.scale;
    let portable = match plan {
        LaunchPlan::TensorCore(grids) => {
            let key_grads = KeyGrads {
                dk: &grads.dk,
                dv: &grads.dv,
                finished: false,
            };
            let tensor_core_step = |dq| {
                crate::tensor_core::backward_step(
                    client,
                    (q, k, v),
                    grad_out,
                    lse,
                    delta,
                    dq,
                    key_grads,
                    grids,
                    &params,
                    &docs,
                )
            };
            if options.deterministic {
                tensor_core_step(DqTarget::Rows(&grads.dq));
            } else {
                let scratch = enqueue_dq_scratch(client, limits, dims)?;
                tensor_core_step(DqTarget::Scratch(&scratch));
                enqueue_unpack_dq_scratch(client, limits, &scratch, &grads.dq, dims, scale, true)?;
            }
            return Ok(());
        }
        LaunchPlan::Portable(portable) => portable,
    };
    for (key_begin, key_end) in portable_ranges(dims.kv_len, dims.head_dim) {
        with_elem_type!(q.elem, E => portable::backward::backward_dq_portable::launch::<E, R>(
            client,
            portable.query_grid.clone(),
            portable_cube(),
            q.array_arg(),
            k.array_arg(),
            v.array_arg(),
            grad_out.array_arg(),
            lse.array_arg(),
            delta.array_arg(),
            grads.dq.array_arg(),
            docs.array_arg(),
            params.queries.launch_arg(),
            key_begin,
            key_end,
            portable.dq_tile_rows,
        ));
    }
    for (query_begin, query_end) in portable_ranges(dims.q_len, dims.head_dim * dims.group_size()) {
        with_elem_type!(q.elem, E => portable::backward::backward_dkdv_portable::launch::<E, R>(
            client,
            portable.key_grid.clone(),
            portable_cube(),
            q.array_arg(),
            k.array_arg(),
            v.array_arg(),
            grad_out.array_arg(),
            lse.array_arg(),
            delta.array_arg(),
            grads.dk.array_arg(),
            grads.dv.array_arg(),
            docs.array_arg(),
            params.keys.launch_arg(),
            query_begin,
            query_end,
            portable.dkdv_tile_rows,
        ));
    }
    Ok(())
}

/// A zeroed f32 scratch for the fused backward's dQ, in fragment order (see [`dq_fragments`]),
/// queued.
fn enqueue_dq_scratch<R: Runtime>(
    client: &ComputeClient<R>,
    limits: &DeviceLimits,
    dims: &AttentionDims,
) -> Result<DeviceTensor, KernelError> {
    let rows = dims.batch * dims.q_heads * dq_fragments::scratch_rows(dims.q_len);
    enqueue_filled(client, limits, vec![rows, dims.head_dim], 0.0)
}

/// Queues the unpacking of the fused backward's dQ scratch (unscaled `dS K`) into the row-major
/// `dq`, times the softmax `scale`: added to an f32 accumulator (`accumulate`), or written in
/// `dq`'s element type.
#[allow(clippy::too_many_arguments)]
fn enqueue_unpack_dq_scratch<R: Runtime>(
    client: &ComputeClient<R>,
    limits: &DeviceLimits,
    scratch: &DeviceTensor,
    dq: &DeviceTensor,
    dims: &AttentionDims,
    scale: f32,
    accumulate: bool,
) -> Result<(), KernelError> {
    let len = dq.len();
    // One warp per row (see `unpack_fragment_scratch`).
    let units = len / dims.head_dim * dq_fragments::UNPACK_COLS;
    let (count, dim) =
        grid::linear_launch("the dQ scratch unpacking", units, ELEMENT_UNITS, limits)?;
    with_elem_type!(dq.elem, T => dq_fragments::unpack_fragment_scratch::launch::<T, R>(
        client,
        count,
        dim,
        scratch.array_arg(),
        dq.array_arg(),
        scale,
        dims.q_len as u32,
        len as u32,
        dims.head_dim,
        accumulate,
    ));
    Ok(())
}

/// A whole attention's backward on the tensor cores, queued: dK and dV are written in the
/// inputs' element type by the kernel that computes them; dQ is unpacked from the fused
/// kernel's scratch in that type too (deterministic: the dQ kernel's f32 sum, cast). No f32
/// accumulator is filled, read back or cast.
#[allow(clippy::too_many_arguments)]
fn enqueue_finished_backward<R: Runtime>(
    client: &ComputeClient<R>,
    limits: &DeviceLimits,
    grids: &crate::tensor_core::Grids,
    (q, k, v): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    grad_out: &DeviceTensor,
    lse: &DeviceTensor,
    delta: &DeviceTensor,
    dims: &AttentionDims,
    options: &StepOptions,
) -> Result<(DeviceTensor, DeviceTensor, DeviceTensor), KernelError> {
    let dk = DeviceTensor::empty(client, dims.kv_shape(), q.elem);
    let dv = DeviceTensor::empty(client, dims.kv_shape(), q.elem);
    let key_grads = KeyGrads {
        dk: &dk,
        dv: &dv,
        finished: true,
    };
    let params = CallParams::new(dims, options);
    let docs = DocumentTable::of(client, &options.mask, &q.handle);
    let scale = params.queries.scale;
    let tensor_core_step = |dq| {
        crate::tensor_core::backward_step(
            client,
            (q, k, v),
            grad_out,
            lse,
            delta,
            dq,
            key_grads,
            grids,
            &params,
            &docs,
        )
    };
    let dq = if options.deterministic {
        let sum = enqueue_filled(client, limits, dims.q_shape(), 0.0)?;
        tensor_core_step(DqTarget::Rows(&sum));
        enqueue_cast(client, limits, &sum, q.elem)?
    } else {
        let scratch = enqueue_dq_scratch(client, limits, dims)?;
        tensor_core_step(DqTarget::Scratch(&scratch));
        let dq = DeviceTensor::empty(client, dims.q_shape(), q.elem);
        enqueue_unpack_dq_scratch(client, limits, &scratch, &dq, dims, scale, false)?;
        dq
    };
    Ok((dq, dk, dv))
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
    options.check()?;
    options.mask.check(&dims)?;
    // Before the launch plan: under Variant::Hopper the Hopper backward's refusals, not the
    // forward's (which the plan checks), name what a step cannot run.
    let buffers = [
        ("q", q),
        ("k", k),
        ("v", v),
        ("grad_out", grad_out),
        ("lse", lse),
        ("delta", delta),
        ("dq", &grads.dq),
        ("dk", &grads.dk),
        ("dv", &grads.dv),
    ];
    if let Some(launch) = hopper::choose_backward_step(client, &dims, options, &buffers)? {
        let inputs = (q, k, v, grad_out);
        hopper::enqueue_backward_step(
            client,
            &launch,
            inputs,
            (lse, delta),
            grads,
            &dims,
            options,
        )?;
        return launch_result(client, "backward_step");
    }
    let (limits, plan) = LaunchPlan::for_call(client, &dims, q.elem, options)?;
    enqueue_backward(
        client,
        &limits,
        &plan,
        (q, k, v),
        grad_out,
        lse,
        delta,
        grads,
        &dims,
        options,
    )?;
    launch_result(client, "backward_step")
}

/// [`cast_f32`]'s launch, queued (`input` is f32, checked by the caller).
fn enqueue_cast<R: Runtime>(
    client: &ComputeClient<R>,
    limits: &DeviceLimits,
    input: &DeviceTensor,
    elem: ElemType,
) -> Result<DeviceTensor, KernelError> {
    if elem == ElemType::F32 {
        return Ok(input.clone());
    }
    limits.expect_elem(elem)?;
    let (count, dim) = grid::linear_launch("cast_f32", input.len(), ELEMENT_UNITS, limits)?;
    let out = DeviceTensor::empty(client, input.shape.clone(), elem);
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

/// Casts an f32 tensor (an accumulator) to `elem`.
pub fn cast_f32<R: Runtime>(
    client: &ComputeClient<R>,
    input: &DeviceTensor,
    elem: ElemType,
) -> Result<DeviceTensor, KernelError> {
    input.expect_elem("input", ElemType::F32)?;
    let out = enqueue_cast(client, &DeviceLimits::of(client), input, elem)?;
    launch_result(client, "cast_f32")?;
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
    finished_forward(client, (q, k, v), None, &dims, options, "attention")
}

/// Whole attention backward in one call: `(dq, dk, dv)` in the input element type. On a Hopper
/// GPU where [`hopper::attention_backward`] covers the call ([`Variant::Hopper`], or
/// [`Variant::Auto`]), that kernel's three launches; else the tensor-core or portable backward.
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
    let dims = check_backward((q, k, v), out, lse, grad_out)?;
    options.check()?;
    options.mask.check(&dims)?;
    let tensors = hopper::ForwardTensors { q, k, v, out, lse };
    if let Some(launch) =
        hopper::choose_backward(client, &dims, options, (&tensors, grad_out), &[])?
    {
        let dq = DeviceTensor::empty(client, dims.q_shape(), q.elem);
        let dk = DeviceTensor::empty(client, dims.kv_shape(), q.elem);
        let dv = DeviceTensor::empty(client, dims.kv_shape(), q.elem);
        let grads = (&dq, &dk, &dv);
        hopper::enqueue_backward(client, &launch, &tensors, grad_out, grads, &dims, options)?;
        launch_result(client, "attention_backward")?;
        return Ok((dq, dk, dv));
    }
    let (limits, plan) = LaunchPlan::for_call(client, &dims, q.elem, options)?;
    let delta = enqueue_delta(client, &limits, out, grad_out)?;
    if let LaunchPlan::TensorCore(grids) = &plan {
        let grads = enqueue_finished_backward(
            client,
            &limits,
            grids,
            (q, k, v),
            grad_out,
            lse,
            &delta,
            &dims,
            options,
        )?;
        launch_result(client, "attention_backward")?;
        return Ok(grads);
    }
    let grads = GradAccumulators::enqueue_zeros(client, &limits, &dims)?;
    enqueue_backward(
        client,
        &limits,
        &plan,
        (q, k, v),
        grad_out,
        lse,
        &delta,
        &grads,
        &dims,
        options,
    )?;
    let cast = |t: &DeviceTensor| enqueue_cast(client, &limits, t, q.elem);
    let (dq, dk, dv) = (cast(&grads.dq)?, cast(&grads.dk)?, cast(&grads.dv)?);
    launch_result(client, "attention_backward")?;
    Ok((dq, dk, dv))
}
