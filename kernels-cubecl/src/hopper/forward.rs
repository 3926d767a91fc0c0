//! The Hopper attention forward on the host: when a call runs on it (`Variant::Hopper`, or
//! `Variant::Auto` where it covers the call), its checks against the device and the buffers,
//! the variant's source, its tensor maps and grid, and the launch (the device code is
//! `attention_forward.cu`).

use cubecl::prelude::*;

use super::forward_plan::{self, ForwardVariant, BLOCK_KEYS, BLOCK_ROWS, BOX_COLUMNS, UNITS};
use super::schedule;
use super::source_task::{
    self, check_alignment, CudaSource, KernelCache, SourceArguments, TiledMap, ATTENTION_PRELUDE,
    PTX_PRELUDE,
};
use crate::dims::AttentionDims;
use crate::inputs::check_qkv;
use crate::kernel_error::{launch_result, KernelError};
use crate::mask::KernelMask;
use crate::step_options::{StepOptions, Variant};
use crate::tensor::{DeviceTensor, ElemType};

/// The device code, compiled per variant with the switches of [`ForwardVariant::switches`].
const FORWARD_CU: &str = include_str!("attention_forward.cu");

/// The kernel's entry point in `attention_forward.cu`.
const ENTRY_POINT: &str = "distflash_hopper_attention_forward";

/// The CUDA source of one variant: its switches, the PTX building blocks (`ptx.cuh`), what the
/// attention kernels share (`attention.cuh`), then `attention_forward.cu`.
pub fn forward_source(variant: &ForwardVariant) -> String {
    format!(
        "{}{PTX_PRELUDE}{ATTENTION_PRELUDE}{FORWARD_CU}",
        variant.switches()
    )
}

/// The kernel of `variant`: built and fingerprinted on its first launch in the process, cloned
/// (its source shared) on every later one.
fn kernel(variant: &ForwardVariant) -> CudaSource {
    static KERNELS: KernelCache<ForwardVariant> = KernelCache::new();
    KERNELS.get(*variant, || {
        CudaSource::new(
            ENTRY_POINT,
            forward_source(variant),
            UNITS as u32,
            forward_plan::shared_bytes(variant.head_dim),
        )
    })
}

/// A Hopper forward ready to launch on one device: the variant and its grid.
#[derive(Debug, Clone)]
pub(crate) struct ForwardLaunch {
    variant: ForwardVariant,
    grid: CubeCount,
}

/// The launch of a whole attention of `dims` with `options` in `elem` on `client`'s device, or
/// why the Hopper forward cannot run it there: what the kernel does not cover
/// ([`ForwardVariant::for_call`]), a device that is not CUDA compute capability 9.0, or limits
/// the kernel's cubes, shared memory or grid exceed.
pub(crate) fn plan<R: Runtime>(
    client: &ComputeClient<R>,
    dims: &AttentionDims,
    elem: ElemType,
    options: &StepOptions,
) -> Result<ForwardLaunch, KernelError> {
    let scale = options.resolved_scale(dims.head_dim);
    let variant = ForwardVariant::for_call(dims, elem, &options.mask, scale, schedule::current())?;
    // One cube per block of query rows of each slice, in one dimension (see `cube_work` in the
    // kernel).
    let grid = super::device_grid(
        client,
        "the Hopper attention forward",
        UNITS,
        forward_plan::shared_bytes(dims.head_dim),
        (
            dims.batch * dims.q_heads * dims.q_len.div_ceil(BLOCK_ROWS),
            "batch x heads x blocks of 128 query rows",
        ),
    )?;
    Ok(ForwardLaunch { variant, grid })
}

/// The launch of the whole attention `q, k, v -> out` (the four `buffers`, q's type) of `dims`,
/// or why the Hopper forward cannot run it: [`plan`], then the buffers' alignment.
fn launch_for<R: Runtime>(
    client: &ComputeClient<R>,
    dims: &AttentionDims,
    options: &StepOptions,
    buffers: [(&str, &DeviceTensor); 4],
) -> Result<ForwardLaunch, KernelError> {
    let launch = plan(client, dims, buffers[0].1.elem, options)?;
    check_alignment("the Hopper attention forward", &buffers)?;
    Ok(launch)
}

/// Whether the Hopper forward runs the whole attention `q, k, v -> out` (the four `buffers`) of
/// `dims`: with [`Variant::Hopper`] it must (an error where it cannot); with [`Variant::Auto`]
/// it does wherever it can ([`launch_for`]); other variants never use it.
pub(crate) fn choose<R: Runtime>(
    client: &ComputeClient<R>,
    dims: &AttentionDims,
    options: &StepOptions,
    buffers: [(&str, &DeviceTensor); 4],
) -> Result<Option<ForwardLaunch>, KernelError> {
    match options.variant {
        Variant::Hopper => launch_for(client, dims, options, buffers).map(Some),
        Variant::Auto => Ok(launch_for(client, dims, options, buffers).ok()),
        Variant::Portable | Variant::TensorCore => Ok(None),
    }
}

/// Queues `launch` for `q, k, v` (`[B, Hq, Sq, D]`, `[B, Hkv, Skv, D]`), writing every element
/// of `out` (`[B, Hq, Sq, D]`, the inputs' type) and `lse` (`[B, Hq, Sq]`, f32); arguments
/// checked by the caller.
#[allow(clippy::too_many_arguments)]
pub(crate) fn enqueue<R: Runtime>(
    client: &ComputeClient<R>,
    launch: &ForwardLaunch,
    (q, k, v): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    out: &DeviceTensor,
    lse: &DeviceTensor,
    dims: &AttentionDims,
    options: &StepOptions,
) {
    let q_view = [dims.batch * dims.q_heads, dims.q_len, dims.head_dim];
    let kv_view = [dims.batch * dims.kv_heads, dims.kv_len, dims.head_dim];
    let swizzle = TensorMapSwizzle::B128;
    let mut arguments = SourceArguments::new();
    for (tensor, view, rows) in [
        (q, &q_view, BLOCK_ROWS),
        (k, &kv_view, BLOCK_KEYS),
        (v, &kv_view, BLOCK_KEYS),
        // Each consumer warpgroup stores its 64 rows.
        (out, &q_view, BLOCK_ROWS / 2),
    ] {
        arguments.tiled_map(
            tensor,
            TiledMap {
                view,
                box_shape: &[1, rows, BOX_COLUMNS],
                swizzle,
            },
        );
    }
    arguments.buffer(lse);
    let scale = options.resolved_scale(dims.head_dim);
    let grouped = launch.variant.schedule.grouped_slices;
    for value in forward_plan::scalars(dims, &options.mask, scale, grouped) {
        arguments.scalar(value);
    }
    let kernel = kernel(&launch.variant);
    // SAFETY: `plan` checked that the runtime is CUDA on an sm_90 device and that the cubes,
    // shared memory and grid fit it; the arguments follow `distflash_hopper_attention_forward`'s
    // parameters (the four tensor maps, their buffers, lse, the eight scalars). The tensor maps
    // bound every copy to its tensor (rows past a slice read as zeros and are not stored), lse
    // is written only at rows below `q_len`, and the loops are bounded by the tile counts.
    unsafe { source_task::launch(client, kernel, launch.grid.clone(), arguments) };
}

/// The whole attention of `q` against `k`, `v` on a Hopper GPU, into caller-provided `out`
/// (`[B, Hq, Sq, D]`, the inputs' type) and `lse` (`[B, Hq, Sq]`, f32): every element of both
/// is written. What [`crate::attention`] runs under [`Variant::Hopper`] (and, where it covers the
/// call, [`Variant::Auto`]), whatever `options.variant` says.
///
/// # Errors
///
/// Shapes and types that disagree, bad options, and everything [`Variant::Hopper`] refuses
/// (the device, the element type, the head dim, masks other than causal, unaligned buffers),
/// before anything runs; a launch the runtime reports as failed is [`KernelError::Launch`].
pub fn attention_forward<R: Runtime>(
    client: &ComputeClient<R>,
    (q, k, v): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    out: &DeviceTensor,
    lse: &DeviceTensor,
    options: &StepOptions,
) -> Result<(), KernelError> {
    let dims = check_qkv(q, k, v)?;
    AttentionDims::expect_shape("out", &dims.q_shape(), &out.shape)?;
    out.expect_elem("out", q.elem)?;
    AttentionDims::expect_shape("lse", &dims.row_shape(), &lse.shape)?;
    lse.expect_elem("lse", ElemType::F32)?;
    options.check()?;
    options.mask.check(&dims)?;
    let buffers = [("q", q), ("k", k), ("v", v), ("out", out)];
    let launch = launch_for(client, &dims, options, buffers)?;
    enqueue(client, &launch, (q, k, v), out, lse, &dims, options);
    launch_result(client, "the Hopper attention forward")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hopper::source_task::parameters;

    #[test]
    fn the_source_declares_the_parameters_in_launch_order() {
        // Tensor maps by value, their buffers, lse, then the scalars by value (see
        // `source_task`'s comment): what `enqueue` registers.
        assert_eq!(
            parameters(FORWARD_CU, ENTRY_POINT),
            [
                "const __grid_constant__ TensorMap q_map",
                "const __grid_constant__ TensorMap k_map",
                "const __grid_constant__ TensorMap v_map",
                "const __grid_constant__ TensorMap o_map",
                "const void* q_buffer",
                "const void* k_buffer",
                "const void* v_buffer",
                "void* o_buffer",
                "float* lse",
                "const __grid_constant__ ForwardInfo info",
            ]
        );
        assert_eq!(FORWARD_CU.matches("__global__").count(), 1);
        assert!(!FORWARD_CU.contains("#include"));
        assert!(FORWARD_CU.contains("__launch_bounds__(DF_THREADS, 1)"));
    }

    #[test]
    fn each_variant_is_built_once_and_then_shared() {
        let variant = |causal| ForwardVariant {
            head_dim: 64,
            elem: ElemType::F16,
            causal,
            schedule: schedule::ForwardSchedule::default(),
        };
        let (first, again, other) = (
            kernel(&variant(true)),
            kernel(&variant(true)),
            kernel(&variant(false)),
        );
        assert_eq!(first.source().as_ptr(), again.source().as_ptr());
        assert_eq!(first.source(), forward_source(&variant(true)));
        assert_ne!(first.fingerprint(), other.fingerprint());
        assert_eq!(
            (first.units, first.shared_bytes),
            (384, forward_plan::shared_bytes(64))
        );
    }

    #[test]
    fn each_variant_sets_its_switches_before_the_building_blocks() {
        let variant = ForwardVariant {
            head_dim: 128,
            elem: ElemType::BF16,
            causal: true,
            schedule: schedule::ForwardSchedule::default(),
        };
        let source = forward_source(&variant);
        assert!(source.starts_with(&variant.switches()));
        assert!(source.ends_with(&format!("{PTX_PRELUDE}{ATTENTION_PRELUDE}{FORWARD_CU}")));
    }
}
