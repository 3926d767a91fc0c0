//! Tensor-core kernels (CUDA `mma.sync` m16n8k16 through CubeCL's manual MMA): forward step,
//! and the backward step as one dK/dV kernel that also adds dQ with atomics, or (deterministic)
//! a dQ kernel and a dK/dV kernel.

pub mod backward;
pub mod dkdv;
pub(crate) mod dq_fragments;
pub mod fast_exp2;
pub mod forward;
pub(crate) mod fragments;
pub(crate) mod tiles;
pub(crate) mod walk;
pub(crate) mod warp_tile;

use cubecl::features::MmaConfig;
use cubecl::prelude::*;

use crate::attention_params::{AttentionParams, CallParams};
use crate::buffers::SoftmaxState;
use crate::dims::AttentionDims;
use crate::grid::{self, Rows};
use crate::kernel_error::KernelError;
use crate::limits::DeviceLimits;
use crate::mask::DocumentTable;
use crate::tensor::{DeviceTensor, ElemType};
use backward::{KEY_ROWS, QUERY_ROWS};
use dkdv::{DKDV_KEYS, DKDV_UNITS};
use fast_exp2::LaunchArguments;
use forward::{BLOCK_KEYS, BLOCK_ROWS, UNITS};
use tiles::padded_stride;

/// Head dimensions the tensor-core kernels are compiled for.
pub const HEAD_DIMS: [usize; 2] = [64, 128];

/// Index width of the tensor-core kernels (the `address_type` of their `#[cube]` attributes,
/// which must match). With 32-bit indices CubeCL emits a load as `base_ptr + (u32)(i + c)`, and
/// the zero-extension keeps ptxas from folding the constant `c` into the instruction: every
/// `ldmatrix` and every asynchronous copy costs an add and a `LEA`. 64-bit indices fold them
/// (`cuda-sass`, bf16, head dim 128, causal: fused dK/dV loop 2409 -> 2071 instructions per 448
/// `mma`; the forward's loop 1463 -> 1403 per 256 `mma` once its staging copies were written as
/// a per-unit base plus compile-time offsets, with spills 420 -> 260 bytes).
pub const KERNEL_ADDRESS: AddressType = AddressType::U64;

/// Whether this client can run the tensor-core kernels for `elem` and `head_dim`: f16 or bf16
/// inputs, a supported head dimension, planes of 32, asynchronous copies and `m16n8k16` manual
/// MMA with f32 accumulation (shared memory is checked with the launch plan, `grids`).
pub fn supports<R: Runtime>(client: &ComputeClient<R>, elem: ElemType, head_dim: usize) -> bool {
    let storage = match elem {
        ElemType::F16 => half::f16::as_type_native_unchecked().storage_type(),
        ElemType::BF16 => half::bf16::as_type_native_unchecked().storage_type(),
        ElemType::F32 => return false,
    };
    let properties = client.properties();
    let config = MmaConfig {
        a_type: storage,
        b_type: storage,
        cd_type: f32::as_type_native_unchecked().storage_type(),
        m: 16,
        n: 8,
        k: 16,
    };
    HEAD_DIMS.contains(&head_dim)
        && properties.hardware.plane_size_min == 32
        && properties.hardware.plane_size_max == 32
        && properties.features.copy_async
        && properties.supports_address(KERNEL_ADDRESS)
        && properties.features.matmul.mma.contains(&config)
}

/// Shared memory of the hungriest of the three kernels at `head_dim`, in bytes (f16/bf16 tiles,
/// rows padded to [`padded_stride`], each 16-byte aligned, plus barriers): the forward's
/// [`BLOCK_ROWS`] query rows and two [`BLOCK_KEYS`]-row key/value tiles, the dQ kernel's Q and
/// dO tiles and double-buffered K and V tiles, the dK/dV kernel's (see
/// [`dkdv::shared_memory_bytes`]). Must
/// cover every kernel's `SharedMemory` declarations: the host checks it against the device
/// before choosing this variant.
pub(crate) fn shared_memory_bytes(head_dim: usize) -> usize {
    let tile = |rows: usize| (rows * padded_stride(head_dim) * 2).next_multiple_of(16) + 16;
    let barrier = 16;
    let forward = tile(BLOCK_ROWS) + 2 * tile(BLOCK_KEYS) + 2 * barrier;
    let dq = 2 * tile(QUERY_ROWS) + 2 * tile(2 * KEY_ROWS) + 2 * barrier;
    let dkdv = dkdv::shared_memory_bytes(head_dim);
    forward.max(dq).max(dkdv)
}

/// The grids of the three kernels for one call, slice-major (see [`crate::grid::slice_major`]:
/// x = the (batch, head) slice, y = block of rows), so that every slice's first blocks (the
/// heaviest under a causal mask, where the kernels take blocks in that order) start first.
#[derive(Debug, Clone)]
pub(crate) struct Grids {
    /// Forward: blocks of [`BLOCK_ROWS`] query rows, slices = batch * q_heads.
    pub forward: CubeCount,
    /// dQ: blocks of [`QUERY_ROWS`] query rows, slices = batch * q_heads.
    pub dq: CubeCount,
    /// dK/dV: blocks of [`DKDV_KEYS`] keys, slices = batch * kv_heads.
    pub dkdv: CubeCount,
    /// Whether the dK/dV kernel stores P^T and dS^T with `stmatrix` (see
    /// [`DeviceLimits::stmatrix`]).
    pub stmatrix: bool,
}

/// The kernels' grids for `dims`, once their cubes, shared memory and grids are known to fit
/// `limits`.
pub(crate) fn grids(dims: &AttentionDims, limits: &DeviceLimits) -> Result<Grids, KernelError> {
    limits.expect_units("the tensor-core kernels", UNITS.max(DKDV_UNITS))?;
    limits.expect_shared(
        "the tensor-core kernels",
        shared_memory_bytes(dims.head_dim),
    )?;
    let blocks = |kernel, rows, per_block| grid::slice_major(kernel, dims, rows, per_block, limits);
    Ok(Grids {
        forward: blocks("the tensor-core forward", Rows::Query, BLOCK_ROWS)?,
        dq: blocks("the tensor-core dQ kernel", Rows::Query, QUERY_ROWS)?,
        dkdv: grid::blocks(
            "the tensor-core dK/dV kernel",
            dims,
            Rows::Key,
            DKDV_KEYS,
            limits,
        )?,
        stmatrix: limits.stmatrix,
    })
}

/// What the tensor-core forward reads and writes.
pub(crate) enum ForwardTarget<'a> {
    /// Fold the keys into this running state (a step, see [`crate::forward_step`]).
    Step(&'a SoftmaxState),
    /// Write this state from the keys alone, reading nothing: its previous contents are never
    /// read and every element is written (see [`crate::forward_first_step`]).
    FirstStep(&'a SoftmaxState),
    /// Merge the keys with this state and write the finished output and log-sum-exp, leaving the
    /// state alone (see [`crate::forward_last_step`]).
    LastStep {
        /// The running state, read only.
        state: &'a SoftmaxState,
        /// The output `[B, H, S, D]`, in the inputs' element type.
        out: &'a DeviceTensor,
        /// The f32 log-sum-exp `[B, H, S]`.
        lse: &'a DeviceTensor,
    },
    /// A whole attention (see [`crate::attention`]): start from the empty state and write the
    /// finished output `[B, H, S, D]` (the inputs' element type) and f32 log-sum-exp `[B, H, S]`.
    Finished {
        /// The output.
        out: &'a DeviceTensor,
        /// The log-sum-exp.
        lse: &'a DeviceTensor,
    },
}

/// The forward kernel's state and output arguments for one [`ForwardTarget`], with one-element
/// placeholders where the kernel never touches them, and its two epilogue flags.
struct ForwardArguments {
    /// The running state `(o, m, l)`.
    state: [DeviceTensor; 3],
    /// The finished output and log-sum-exp.
    finished: [DeviceTensor; 2],
    /// Whether the kernel merges the stored state.
    reads_state: bool,
    /// Whether it writes the finished output and lse (else the state).
    finishes: bool,
}

impl ForwardTarget<'_> {
    /// The kernel's arguments for this target (`elem`: the inputs' element type).
    fn arguments<R: Runtime>(&self, client: &ComputeClient<R>, elem: ElemType) -> ForwardArguments {
        let placeholder = |elem| DeviceTensor::empty(client, vec![1], elem);
        let state_of = |s: &SoftmaxState| [s.o.clone(), s.m.clone(), s.l.clone()];
        let no_output = || [placeholder(elem), placeholder(ElemType::F32)];
        let (state, finished, reads_state, finishes) = match self {
            ForwardTarget::Step(s) => (state_of(s), no_output(), true, false),
            ForwardTarget::FirstStep(s) => (state_of(s), no_output(), false, false),
            ForwardTarget::LastStep { state, out, lse } => (
                state_of(state),
                [(*out).clone(), (*lse).clone()],
                true,
                true,
            ),
            ForwardTarget::Finished { out, lse } => {
                let none = placeholder(ElemType::F32);
                (
                    [none.clone(), none.clone(), none],
                    [(*out).clone(), (*lse).clone()],
                    false,
                    true,
                )
            }
        };
        ForwardArguments {
            state,
            finished,
            reads_state,
            finishes,
        }
    }
}

/// Tensor-core forward: a step into a running state, a first or last step, or a whole attention
/// (see [`ForwardTarget`]), of the call `params` with the mask's document table `docs`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward<R: Runtime>(
    client: &ComputeClient<R>,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    target: ForwardTarget,
    grids: &Grids,
    params: &AttentionParams,
    docs: &DocumentTable,
) {
    let ForwardArguments {
        state: [o, m, l],
        finished: [out, lse],
        reads_state,
        finishes,
    } = target.arguments(client, q.elem);
    let mut args = LaunchArguments::new(KERNEL_ADDRESS);
    crate::tensor::with_elem_type!(q.elem, E => {
        let kernel = forward::forward_step_mma::ForwardStepMma::<E, R>::new(
            settings(UNITS),
            client.clone(),
            args.array(q),
            args.array(k),
            args.array(v),
            args.array(&o),
            args.array(&m),
            args.array(&l),
            args.array(&out),
            args.array(&lse),
            args.table(docs),
            args.params(params),
            reads_state,
            finishes,
        );
        // SAFETY: shapes were validated by the caller; the kernel guards every global access
        // against `q_len`/`kv_len` (see `forward_step_mma`), and the arguments follow its
        // parameters.
        unsafe { fast_exp2::launch_unchecked(client, grids.forward.clone(), kernel, args) }
    });
}

/// Where the tensor-core backward adds dQ.
pub(crate) enum DqTarget<'a> {
    /// The deterministic dQ kernel adds into this row-major f32 `[B, Hq, Sq, D]` tensor.
    Rows(&'a DeviceTensor),
    /// The fused dK/dV kernel adds with atomics into this zeroed scratch in fragment order
    /// (see [`dq_fragments`]); the caller unpacks it.
    Scratch(&'a DeviceTensor),
}

/// Where the tensor-core backward writes dK and dV: `[B, Hkv, Skv, D]` f32 accumulators it adds
/// to (a step), or, `finished`, tensors of the inputs' element type it writes (a whole
/// attention).
pub(crate) struct KeyGrads<'a> {
    /// dK.
    pub dk: &'a DeviceTensor,
    /// dV.
    pub dv: &'a DeviceTensor,
    /// Whether `dk`, `dv` are a whole attention's finished gradients.
    pub finished: bool,
}

/// Tensor-core backward (see [`crate::backward_step`]) of the call `params` with the mask's
/// document table `docs`: with [`DqTarget::Scratch`] the fused dK/dV kernel alone, adding dQ to
/// the scratch with f32 atomics; with [`DqTarget::Rows`] the dQ kernel and the dK/dV kernel.
/// The kernel's dK/dV arguments of the other kind get one-element placeholders (it never
/// touches them).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_step<R: Runtime>(
    client: &ComputeClient<R>,
    (q, k, v): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    grad_out: &DeviceTensor,
    lse: &DeviceTensor,
    delta: &DeviceTensor,
    dq: DqTarget,
    key_grads: KeyGrads,
    grids: &Grids,
    params: &CallParams,
    docs: &DocumentTable,
) {
    let (dq, fuse_dq) = match dq {
        DqTarget::Rows(rows) => {
            let mut args = LaunchArguments::new(KERNEL_ADDRESS);
            crate::tensor::with_elem_type!(q.elem, E => {
                let kernel = backward::backward_dq_mma::BackwardDqMma::<E, R>::new(
                    settings(UNITS),
                    client.clone(),
                    args.array(q),
                    args.array(k),
                    args.array(v),
                    args.array(grad_out),
                    args.array(lse),
                    args.array(delta),
                    args.array(rows),
                    args.table(docs),
                    args.params(&params.queries),
                );
                // SAFETY: shapes were validated by the caller; the kernel guards every global
                // access against `q_len`/`kv_len`, and the arguments follow its parameters.
                unsafe { fast_exp2::launch_unchecked(client, grids.dq.clone(), kernel, args) }
            });
            (rows, false)
        }
        DqTarget::Scratch(scratch) => (scratch, true),
    };
    let placeholder = |elem| DeviceTensor::empty(client, vec![1], elem);
    let (dk, dv, dk_out, dv_out) = if key_grads.finished {
        (
            placeholder(ElemType::F32),
            placeholder(ElemType::F32),
            key_grads.dk.clone(),
            key_grads.dv.clone(),
        )
    } else {
        (
            key_grads.dk.clone(),
            key_grads.dv.clone(),
            placeholder(q.elem),
            placeholder(q.elem),
        )
    };
    let mut args = LaunchArguments::new(KERNEL_ADDRESS);
    crate::tensor::with_elem_type!(q.elem, E => {
        let kernel = dkdv::backward_dkdv_mma::BackwardDkdvMma::<E, R>::new(
            settings(DKDV_UNITS),
            client.clone(),
            args.array(q),
            args.array(k),
            args.array(v),
            args.array(grad_out),
            args.array(lse),
            args.array(delta),
            args.array(&dk),
            args.array(&dv),
            args.array(dq),
            args.array(&dk_out),
            args.array(&dv_out),
            args.table(docs),
            args.params(&params.keys),
            fuse_dq,
            key_grads.finished,
            grids.stmatrix,
        );
        // SAFETY: as above.
        unsafe { fast_exp2::launch_unchecked(client, grids.dkdv.clone(), kernel, args) }
    });
}

/// Settings of a tensor-core kernel launched with cubes of `units` units.
fn settings(units: usize) -> KernelSettings {
    KernelSettings::default()
        .cube_dim(CubeDim::new_1d(units as u32))
        .address_type(KERNEL_ADDRESS)
}
