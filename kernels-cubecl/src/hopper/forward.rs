//! The Hopper attention forward on the host: when a call runs on it (`Variant::Hopper`, or
//! `Variant::Auto` where it covers the call), a whole attention or a step of the stat-carrying
//! contract, its checks against the device and the buffers, the variant's source, its tensor
//! maps and grid, and the launch (the device code is `attention_forward.cu`).

use cubecl::prelude::*;

use super::forward_plan::{
    self, ForwardEnds, ForwardVariant, BLOCK_KEYS, BLOCK_ROWS, BOX_COLUMNS, UNITS,
};
use super::schedule;
use super::source_task::{
    self, check_alignment, CudaSource, KernelCache, SourceArguments, TiledMap, ATTENTION_PRELUDE,
    PTX_PRELUDE,
};
use crate::dims::AttentionDims;
use crate::inputs::check_qkv;
use crate::kernel_error::{launch_result, KernelError};
use crate::mask::{DocumentTable, KernelMask};
use crate::step_options::{StepOptions, Variant};
use crate::tensor::{DeviceTensor, ElemType};
use crate::tensor_core::ForwardTarget;

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
            variant.shared_bytes(),
        )
    })
}

/// A Hopper forward ready to launch on one device: the variant and its grid.
#[derive(Debug, Clone)]
pub(crate) struct ForwardLaunch {
    variant: ForwardVariant,
    grid: CubeCount,
}

/// What a forward of `target` starts from and writes.
fn ends_of(target: &ForwardTarget) -> ForwardEnds {
    match target {
        ForwardTarget::Finished { .. } => ForwardEnds::Whole,
        ForwardTarget::FirstStep(_) => ForwardEnds::FirstStep,
        ForwardTarget::Step(_) => ForwardEnds::Step,
        ForwardTarget::LastStep { .. } => ForwardEnds::LastStep,
    }
}

/// The launch of attention of `dims` with `options` in `elem` from and to `ends` on `client`'s
/// device, or why the Hopper forward cannot run it there: what the kernel does not cover
/// ([`ForwardVariant::for_call`]), a device that is not CUDA compute capability 9.0, or limits
/// the kernel's cubes, shared memory or grid exceed.
pub(crate) fn plan<R: Runtime>(
    client: &ComputeClient<R>,
    dims: &AttentionDims,
    elem: ElemType,
    options: &StepOptions,
    ends: ForwardEnds,
) -> Result<ForwardLaunch, KernelError> {
    let scale = options.resolved_scale(dims.head_dim);
    let mask = (&options.mask, scale);
    let variant = ForwardVariant::for_call(dims, elem, mask, schedule::current(), ends)?;
    // One cube per block of query rows of each slice, in one dimension (see `cube_work` in the
    // kernel), or on a persistent grid one per multiprocessor, never more than there are blocks.
    let blocks = dims.batch * dims.q_heads * dims.q_len.div_ceil(BLOCK_ROWS);
    let cubes = match variant.schedule.persistent {
        true => (
            forward_plan::persistent_cubes(
                blocks,
                client.properties().hardware.num_streaming_multiprocessors,
            ),
            "one per multiprocessor, at most one per block of 128 query rows",
        ),
        false => (blocks, "batch x heads x blocks of 128 query rows"),
    };
    let grid = super::device_grid(
        client,
        "the Hopper attention forward",
        UNITS,
        variant.shared_bytes(),
        cubes,
    )?;
    Ok(ForwardLaunch { variant, grid })
}

/// The output and lse `target` has the kernel write, if it finishes the attention.
fn finished_output<'a>(target: &ForwardTarget<'a>) -> Option<(&'a DeviceTensor, &'a DeviceTensor)> {
    match *target {
        ForwardTarget::Finished { out, lse } | ForwardTarget::LastStep { out, lse, .. } => {
            Some((out, lse))
        }
        ForwardTarget::FirstStep(_) | ForwardTarget::Step(_) => None,
    }
}

/// The running state `target` has the kernel read or write, if any.
fn state_of<'a>(target: &ForwardTarget<'a>) -> Option<&'a crate::SoftmaxState> {
    match *target {
        ForwardTarget::Step(state)
        | ForwardTarget::FirstStep(state)
        | ForwardTarget::LastStep { state, .. } => Some(state),
        ForwardTarget::Finished { .. } => None,
    }
}

/// The launch of attention `q, k, v -> target` of `dims`, or why the Hopper forward cannot run
/// it: [`plan`], then the buffers' alignment (the copy engine's and the state's vector accesses).
fn launch_for<R: Runtime>(
    client: &ComputeClient<R>,
    dims: &AttentionDims,
    options: &StepOptions,
    (q, k, v): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    target: &ForwardTarget,
) -> Result<ForwardLaunch, KernelError> {
    let launch = plan(client, dims, q.elem, options, ends_of(target))?;
    let mut buffers = vec![("q", q), ("k", k), ("v", v)];
    if let Some((out, _)) = finished_output(target) {
        buffers.push(("out", out));
    }
    if let Some(state) = state_of(target) {
        buffers.extend([
            ("state.o", &state.o),
            ("state.m", &state.m),
            ("state.l", &state.l),
        ]);
    }
    check_alignment("the Hopper attention forward", &buffers)?;
    Ok(launch)
}

/// Whether the Hopper forward runs attention `q, k, v -> target` of `dims` (a whole attention
/// or a step): with [`Variant::Hopper`] it must (an error where it cannot); with
/// [`Variant::Auto`] it does wherever it can ([`launch_for`]); other variants never use it.
pub(crate) fn choose<R: Runtime>(
    client: &ComputeClient<R>,
    dims: &AttentionDims,
    options: &StepOptions,
    qkv: (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    target: &ForwardTarget,
) -> Result<Option<ForwardLaunch>, KernelError> {
    match options.variant {
        Variant::Hopper => launch_for(client, dims, options, qkv, target).map(Some),
        Variant::Auto => Ok(launch_for(client, dims, options, qkv, target).ok()),
        Variant::Portable | Variant::TensorCore => Ok(None),
    }
}

/// Queues `launch` for `q, k, v` (`[B, Hq, Sq, D]`, `[B, Hkv, Skv, D]`) into `target` (the
/// variant `launch` was planned for): every element of the finished output (`[B, Hq, Sq, D]`,
/// the inputs' type) and lse (`[B, Hq, Sq]`, f32), or of the running state, is written;
/// arguments checked by the caller.
pub(crate) fn enqueue<R: Runtime>(
    client: &ComputeClient<R>,
    launch: &ForwardLaunch,
    (q, k, v): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    target: &ForwardTarget,
    dims: &AttentionDims,
    options: &StepOptions,
) {
    debug_assert_eq!(launch.variant.ends, ends_of(target));
    let q_view = [dims.batch * dims.q_heads, dims.q_len, dims.head_dim];
    let kv_view = [dims.batch * dims.kv_heads, dims.kv_len, dims.head_dim];
    let swizzle = TensorMapSwizzle::B128;
    let finished = finished_output(target);
    let mut arguments = SourceArguments::new();
    let mut maps = vec![
        (q, &q_view, BLOCK_ROWS),
        (k, &kv_view, BLOCK_KEYS),
        (v, &kv_view, BLOCK_KEYS),
    ];
    if let Some((out, _)) = finished {
        // Each consumer warpgroup stores its 64 rows.
        maps.push((out, &q_view, BLOCK_ROWS / 2));
    }
    for (tensor, view, rows) in maps {
        arguments.tiled_map(
            tensor,
            TiledMap {
                view,
                box_shape: &[1, rows, BOX_COLUMNS],
                swizzle,
            },
        );
    }
    if let Some((_, lse)) = finished {
        arguments.buffer(lse);
    }
    if let Some(state) = state_of(target) {
        for tensor in [&state.o, &state.m, &state.l] {
            arguments.buffer(tensor);
        }
    }
    // Kept alive by the launch's binding.
    if launch.variant.mask.documents {
        arguments.table(&DocumentTable::of(client, &options.mask, &q.handle));
    }
    // A persistent grid's item counter, zero at launch (each launch its own: launches on other
    // streams may run at the same time).
    if launch.variant.schedule.persistent {
        arguments.handle(client.create_from_slice(&0u32.to_le_bytes()));
    }
    let scale = options.resolved_scale(dims.head_dim);
    let grouped = launch.variant.schedule.grouped_slices;
    for value in forward_plan::scalars(dims, &options.mask, scale, grouped) {
        arguments.scalar(value);
    }
    let kernel = kernel(&launch.variant);
    // SAFETY: `plan` checked that the runtime is CUDA on an sm_90 device and that the cubes,
    // shared memory and grid fit it; the arguments follow `distflash_hopper_attention_forward`'s
    // parameters for the variant's ends and mask (the tensor maps of q, k, v and a finished
    // output, their buffers, lse for a finished output, the state's o, m and l for a step, the
    // documents' table with documents, a persistent grid's zeroed item counter, the fourteen
    // scalars). The tensor maps bound every copy to its tensor (rows past a slice read as zeros
    // and are not stored), lse and the state are read and written only at rows below `q_len`, the
    // table only at positions `Mask::check_call` checked against it (rows below `q_len`), the
    // counter only by one atomic add per item and cube, and the loops are bounded by the tile
    // counts and, on a persistent grid, by the number of blocks.
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
/// (the device, the element type, the head dim, unaligned buffers),
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
    let target = ForwardTarget::Finished { out, lse };
    let launch = launch_for(client, &dims, options, (q, k, v), &target)?;
    enqueue(client, &launch, (q, k, v), &target, &dims, options);
    launch_result(client, "the Hopper attention forward")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hopper::source_task::preprocessed_parameters;
    use crate::mask::MaskKind;
    use crate::Mask;

    /// The entry point's parameters as the preprocessor leaves them for `ends`, with or without
    /// `documents`.
    fn parameters_for(ends: ForwardEnds, documents: bool, persistent: bool) -> Vec<String> {
        let (state_in, state_out) = (ends.reads_state(), ends.writes_state());
        preprocessed_parameters(FORWARD_CU, ENTRY_POINT, |condition| match condition {
            "!DISTFLASH_STATE_OUT" => !state_out,
            "DISTFLASH_STATE_IN || DISTFLASH_STATE_OUT" => state_in || state_out,
            "DISTFLASH_DOCUMENTS" => documents,
            "DISTFLASH_PERSISTENT" => persistent,
            other => panic!("unexpected condition `{other}`"),
        })
    }

    #[test]
    fn the_source_declares_the_parameters_in_launch_order() {
        // Tensor maps by value, their buffers, lse or the state, then the scalars by value (see
        // `source_task`'s comment): what `enqueue` registers for each target.
        let maps = [
            "const __grid_constant__ TensorMap q_map",
            "const __grid_constant__ TensorMap k_map",
            "const __grid_constant__ TensorMap v_map",
        ];
        let buffers = [
            "const void* q_buffer",
            "const void* k_buffer",
            "const void* v_buffer",
        ];
        let output_map = ["const __grid_constant__ TensorMap o_map"];
        let output = ["void* o_buffer", "float* lse"];
        let state = ["float* state_o", "float* state_m", "float* state_l"];
        let docs = ["const u32* docs"];
        let counter = ["u32* work_counter"];
        let info = ["const __grid_constant__ ForwardInfo info"];
        let expected = |parts: &[&[&str]]| -> Vec<String> {
            parts.concat().into_iter().map(String::from).collect()
        };
        for (documents, table) in [(false, &[][..]), (true, &docs[..])] {
            assert_eq!(
                parameters_for(ForwardEnds::Whole, documents, false),
                expected(&[&maps, &output_map, &buffers, &output, table, &info])
            );
            // The persistent grid (a whole attention only) adds its item counter.
            assert_eq!(
                parameters_for(ForwardEnds::Whole, documents, true),
                expected(&[
                    &maps,
                    &output_map,
                    &buffers,
                    &output,
                    table,
                    &counter,
                    &info
                ])
            );
            assert_eq!(
                parameters_for(ForwardEnds::LastStep, documents, false),
                expected(&[&maps, &output_map, &buffers, &output, &state, table, &info])
            );
            for ends in [ForwardEnds::FirstStep, ForwardEnds::Step] {
                assert_eq!(
                    parameters_for(ends, documents, false),
                    expected(&[&maps, &buffers, &state, table, &info])
                );
            }
        }
        assert_eq!(FORWARD_CU.matches("__global__").count(), 1);
        assert!(!FORWARD_CU.contains("#include"));
        assert!(FORWARD_CU.contains("__launch_bounds__(DF_THREADS, 1)"));
    }

    #[test]
    fn each_variant_is_built_once_and_then_shared() {
        let variant = |causal| ForwardVariant {
            head_dim: 64,
            elem: ElemType::F16,
            mask: MaskKind {
                upper: causal,
                ..MaskKind::default()
            },
            schedule: schedule::ForwardSchedule::default(),
            ends: ForwardEnds::Whole,
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
            (384, forward_plan::shared_bytes_for(64, true))
        );
    }

    #[test]
    fn each_variant_sets_its_switches_before_the_building_blocks() {
        let variant = ForwardVariant {
            head_dim: 128,
            elem: ElemType::BF16,
            mask: Mask::causal().kind(),
            schedule: schedule::ForwardSchedule::default(),
            ends: ForwardEnds::Step,
        };
        let source = forward_source(&variant);
        assert!(source.starts_with(&variant.switches()));
        assert!(source.ends_with(&format!("{PTX_PRELUDE}{ATTENTION_PRELUDE}{FORWARD_CU}")));
    }
}
