//! The Hopper attention backward on the host: when a call runs on it (`Variant::Hopper`, or
//! `Variant::Auto` where it covers the call), a whole attention's backward or a backward step
//! (gradients added to f32 accumulators), its checks against the device and the buffers, the
//! sources of its three kernels (the row kernels of `backward_rows.cu` before and after the
//! main kernel of `attention_backward.cu`; a fourth, converting dK and dV, after a whole
//! attention whose GQA groups' heads the plan split over several cubes), their scratch buffers,
//! tensor maps and grids, and the launches.

use cubecl::prelude::*;

use super::backward_plan::{self, BackwardVariant, BLOCK_KEYS, ROW_UNITS, TILE_ROWS, UNITS};
use super::forward_plan::BOX_COLUMNS;
use super::schedule;
use super::source_task::{
    self, check_alignment, CudaSource, KernelCache, SourceArguments, TiledMap, ATTENTION_PRELUDE,
    PTX_PRELUDE,
};
use crate::buffers::enqueue_filled;
use crate::dims::AttentionDims;
use crate::inputs::check_backward;
use crate::kernel_error::{launch_result, KernelError};
use crate::limits::DeviceLimits;
use crate::mask::{DocumentTable, KernelMask, MaskKind};
use crate::step_options::{StepOptions, Variant};
use crate::tensor::{DeviceTensor, ElemType};

/// The main kernel's device code, compiled per variant with [`BackwardVariant::switches`].
const BACKWARD_CU: &str = include_str!("attention_backward.cu");
/// The row kernels' device code, compiled per head dim and type.
const ROWS_CU: &str = include_str!("backward_rows.cu");

/// The main kernel's entry point in `attention_backward.cu`.
const ENTRY_POINT: &str = "distflash_hopper_attention_backward";
/// The row kernels' entry points in `backward_rows.cu`: before and after the main kernel, for a
/// whole attention and for a step.
const PREPARE_ENTRY_POINT: &str = "distflash_hopper_backward_prepare";
const DQ_ENTRY_POINT: &str = "distflash_hopper_backward_dq";
const PREPARE_STEP_ENTRY_POINT: &str = "distflash_hopper_backward_prepare_step";
const DQ_ADD_ENTRY_POINT: &str = "distflash_hopper_backward_dq_add";
/// The row kernel after a split whole attention's main kernel: dK and dV from their f32 sums.
const KV_CONVERT_ENTRY_POINT: &str = "distflash_hopper_backward_kv_convert";

/// What the kernel names in its messages.
const KERNEL: &str = "the Hopper attention backward";

/// The CUDA source of one variant of the main kernel: its switches, the PTX building blocks
/// (`ptx.cuh`), what the attention kernels share (`attention.cuh`), then
/// `attention_backward.cu`.
pub fn backward_source(variant: &BackwardVariant) -> String {
    format!(
        "{}{PTX_PRELUDE}{ATTENTION_PRELUDE}{BACKWARD_CU}",
        variant.switches()
    )
}

/// The variant whose switches the row kernels are compiled with: `variant`'s head dim and type
/// (its mask, accumulation, determinism and split do not enter them).
fn rows_variant(variant: &BackwardVariant) -> BackwardVariant {
    BackwardVariant {
        mask: MaskKind::default(),
        accumulate: false,
        deterministic: false,
        split: false,
        producer_adds: false,
        ..*variant
    }
}

/// The CUDA source of the row kernels for one variant's head dim and type: the same preludes,
/// then `backward_rows.cu`.
pub fn backward_rows_source(variant: &BackwardVariant) -> String {
    format!(
        "{}{PTX_PRELUDE}{ATTENTION_PRELUDE}{ROWS_CU}",
        rows_variant(variant).switches()
    )
}

/// The three kernels of `variant`, each built and fingerprinted on its first launch in the
/// process and shared after: the prepare kernel, the main kernel, the dQ kernel (a step's row
/// kernels take the given delta and add to the dQ accumulator).
fn kernels(variant: &BackwardVariant) -> [CudaSource; 3] {
    static MAIN: KernelCache<BackwardVariant> = KernelCache::new();
    let row_kernel = |entry_point| row_kernel(variant, entry_point);
    let main = MAIN.get(*variant, || {
        CudaSource::new(
            ENTRY_POINT,
            backward_source(variant),
            UNITS as u32,
            variant.shared_bytes(),
        )
    });
    let (prepare, dq) = if variant.accumulate {
        (PREPARE_STEP_ENTRY_POINT, DQ_ADD_ENTRY_POINT)
    } else {
        (PREPARE_ENTRY_POINT, DQ_ENTRY_POINT)
    };
    [row_kernel(prepare), main, row_kernel(dq)]
}

/// The row kernel `entry_point` for `variant`'s head dim and type, built and fingerprinted on
/// its first launch in the process and shared after.
fn row_kernel(variant: &BackwardVariant, entry_point: &'static str) -> CudaSource {
    static ROWS: KernelCache<(BackwardVariant, &'static str)> = KernelCache::new();
    ROWS.get((rows_variant(variant), entry_point), || {
        // The row kernels declare no shared memory; the shell asks a word per thread.
        let shared = ROW_UNITS * 4;
        CudaSource::new(
            entry_point,
            backward_rows_source(variant),
            ROW_UNITS as u32,
            shared,
        )
    })
}

/// A Hopper backward ready to launch on one device: the variant, the three kernels' grids, the
/// cubes each GQA group's query heads are split over (1: none), and with a split whole
/// attention the grid of the conversion of dK and dV.
#[derive(Debug, Clone)]
pub(crate) struct BackwardLaunch {
    variant: BackwardVariant,
    grids: [CubeCount; 3],
    head_parts: usize,
    convert_grid: Option<CubeCount>,
}

/// The launch of a whole attention's backward (or, to `accumulate`, a backward step) of `dims`
/// with `options` in `elem` on `client`'s device, or why the Hopper backward cannot run it
/// there: what the kernel does not cover ([`BackwardVariant::for_call`]), a device that is not
/// CUDA compute capability 9.0, or limits the kernels' cubes, shared memory or grids exceed.
/// Each GQA group's query heads go over [`backward_plan::head_parts`] cubes per block of keys
/// (the thread's [`schedule::current_backward`] forcing it or not).
fn plan<R: Runtime>(
    client: &ComputeClient<R>,
    dims: &AttentionDims,
    elem: ElemType,
    options: &StepOptions,
    accumulate: bool,
) -> Result<BackwardLaunch, KernelError> {
    let scale = options.resolved_scale(dims.head_dim);
    let mask = (&options.mask, scale);
    let schedule = schedule::current_backward();
    let head_parts = backward_plan::head_parts(
        dims,
        client.properties().hardware.num_streaming_multiprocessors,
        (options.deterministic, accumulate),
        schedule.head_split,
    );
    let variant = BackwardVariant::for_call(dims, elem, mask, options.deterministic, accumulate)?
        .with_head_parts(head_parts)
        .with_deterministic_adds(schedule.deterministic_adds);
    let row_grid = |what: &str, threads: usize| {
        super::device_grid(
            client,
            KERNEL,
            ROW_UNITS,
            ROW_UNITS * 4,
            (threads.div_ceil(ROW_UNITS), what),
        )
    };
    let prepare = row_grid(
        "a warp per padded query row",
        backward_plan::prepared_rows(dims) * 32,
    )?;
    // One cube per block of keys of each key/value slice and part of its group's query heads,
    // in one dimension (see `grouped_cube` in the kernel).
    let main = super::device_grid(
        client,
        KERNEL,
        UNITS,
        variant.shared_bytes(),
        (
            backward_plan::unsplit_cubes(dims) * head_parts,
            "batch x key/value heads x blocks of 128 keys x parts of a group's query heads",
        ),
    )?;
    let dq = row_grid(
        "a thread per four values of the padded rows' dQ sum",
        backward_plan::prepared_rows(dims) * dims.head_dim / 4,
    )?;
    let convert_grid = match variant.split && !accumulate {
        true => Some(row_grid(
            "a thread per two values of dK and of dV",
            backward_plan::key_grad_elements(dims) / 2,
        )?),
        false => None,
    };
    Ok(BackwardLaunch {
        variant,
        grids: [prepare, main, dq],
        head_parts,
        convert_grid,
    })
}

/// Whether the Hopper backward runs the whole attention's backward of `dims` from the forward's
/// `tensors` and `grad_out` into the named `outputs` (none where the caller allocates them):
/// with [`Variant::Hopper`] it must (an error where it cannot); with [`Variant::Auto`] it does
/// wherever it can ([`plan`], then the buffers' alignment); other variants never use it.
pub(crate) fn choose<R: Runtime>(
    client: &ComputeClient<R>,
    dims: &AttentionDims,
    options: &StepOptions,
    (tensors, grad_out): (&ForwardTensors, &DeviceTensor),
    outputs: &[(&str, &DeviceTensor)],
) -> Result<Option<BackwardLaunch>, KernelError> {
    chosen(options.variant, || {
        let launch = plan(client, dims, tensors.q.elem, options, false)?;
        let inputs = [
            ("q", tensors.q),
            ("k", tensors.k),
            ("v", tensors.v),
            ("out", tensors.out),
            ("lse", tensors.lse),
            ("grad_out", grad_out),
        ];
        check_alignment(KERNEL, &inputs)?;
        check_alignment(KERNEL, outputs)?;
        Ok(launch)
    })
}

/// Whether the Hopper backward runs the backward step of `dims` (q, k, v, the output gradient,
/// the full-row lse and delta and the f32 accumulators: the named `buffers`), as [`choose`]
/// decides for a whole attention.
pub(crate) fn choose_step<R: Runtime>(
    client: &ComputeClient<R>,
    dims: &AttentionDims,
    options: &StepOptions,
    buffers: &[(&str, &DeviceTensor)],
) -> Result<Option<BackwardLaunch>, KernelError> {
    chosen(options.variant, || {
        let launch = plan(client, dims, buffers[0].1.elem, options, true)?;
        check_alignment(KERNEL, buffers)?;
        Ok(launch)
    })
}

/// The launch `launch_for` gives under [`Variant::Hopper`] (or its error), where it gives one
/// under [`Variant::Auto`], none under the other variants.
fn chosen(
    variant: Variant,
    launch_for: impl FnOnce() -> Result<BackwardLaunch, KernelError>,
) -> Result<Option<BackwardLaunch>, KernelError> {
    match variant {
        Variant::Hopper => launch_for().map(Some),
        Variant::Auto => Ok(launch_for().ok()),
        Variant::Portable | Variant::TensorCore => Ok(None),
    }
}

/// The forward's tensors a backward reads: q, k, v, the output and its f32 log-sum-exp.
pub(crate) struct ForwardTensors<'a> {
    /// `[B, Hq, Sq, D]`.
    pub q: &'a DeviceTensor,
    /// `[B, Hkv, Skv, D]`.
    pub k: &'a DeviceTensor,
    /// `[B, Hkv, Skv, D]`.
    pub v: &'a DeviceTensor,
    /// `[B, Hq, Sq, D]`, the inputs' type.
    pub out: &'a DeviceTensor,
    /// `[B, Hq, Sq]`, f32.
    pub lse: &'a DeviceTensor,
}

/// Queues `launch` (a whole attention's) from the forward's `tensors` and the output gradient
/// `grad_out`, writing every element of `dq` (`[B, Hq, Sq, D]`), `dk` and `dv`
/// (`[B, Hkv, Skv, D]`), all the inputs' type; arguments checked by the caller. Three launches:
/// the prepare kernel (deltas, base-2 log-sum-exps, the zeroed dQ sum), the main kernel, the dQ
/// kernel (after a fill of the deterministic backward's zeroed counters).
pub(crate) fn enqueue<R: Runtime>(
    client: &ComputeClient<R>,
    launch: &BackwardLaunch,
    tensors: &ForwardTensors,
    grad_out: &DeviceTensor,
    (dq, dk, dv): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    dims: &AttentionDims,
    options: &StepOptions,
) -> Result<(), KernelError> {
    debug_assert!(!launch.variant.accumulate);
    let inputs = (tensors.q, tensors.k, tensors.v, grad_out);
    let prepare_inputs = [tensors.out, grad_out, tensors.lse];
    let grads = (dq, dk, dv);
    enqueue_launches(
        client,
        launch,
        inputs,
        &prepare_inputs,
        grads,
        dims,
        options,
    )
}

/// Queues `launch` (a step's) for q, k, v and the output gradient `grad_out` with the full-row
/// `lse` and `delta` (`[B, Hq, Sq]`, f32), adding the pair's gradients to the f32 accumulators
/// `grads`; arguments checked by the caller. The same three launches as [`enqueue`]: the
/// prepare kernel pads the given delta, the dQ kernel adds to `grads.dq`, the main kernel adds
/// to `grads.dk` and `grads.dv`.
pub(crate) fn enqueue_step<R: Runtime>(
    client: &ComputeClient<R>,
    launch: &BackwardLaunch,
    (q, k, v, grad_out): (&DeviceTensor, &DeviceTensor, &DeviceTensor, &DeviceTensor),
    (lse, delta): (&DeviceTensor, &DeviceTensor),
    grads: &crate::GradAccumulators,
    dims: &AttentionDims,
    options: &StepOptions,
) -> Result<(), KernelError> {
    debug_assert!(launch.variant.accumulate);
    let grads = (&grads.dq, &grads.dk, &grads.dv);
    let inputs = (q, k, v, grad_out);
    enqueue_launches(client, launch, inputs, &[lse, delta], grads, dims, options)
}

/// The three launches of `launch` for q, k, v and `grad_out`: the prepare kernel reading
/// `prepare_inputs` (a whole attention's output, output gradient and lse; a step's lse and
/// delta), the main kernel storing (a whole attention) or adding (a step) dK and dV, the dQ
/// kernel writing or adding dQ; a deterministic variant's counters are zeroed first. A split
/// whole attention's main kernel adds dK and dV to f32 sums zeroed first, which a fourth launch
/// converts into `dk` and `dv`. Only the fills can fail (a grid past the device's limits),
/// before anything else is queued.
fn enqueue_launches<R: Runtime>(
    client: &ComputeClient<R>,
    launch: &BackwardLaunch,
    (q, k, v, grad_out): (&DeviceTensor, &DeviceTensor, &DeviceTensor, &DeviceTensor),
    prepare_inputs: &[&DeviceTensor],
    (dq, dk, dv): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    dims: &AttentionDims,
    options: &StepOptions,
) -> Result<(), KernelError> {
    // Zero bits: the kernel reads these f32 zeros as u32 counters.
    let dq_turns = match launch.variant.deterministic {
        true => Some(enqueue_filled(
            client,
            &DeviceLimits::of(client),
            vec![backward_plan::dq_turns(dims)],
            0.0,
        )?),
        false => None,
    };
    // A split whole attention's dK and dV sums, zeroed: its cubes add to them with atomics.
    let split_sums = match launch.convert_grid {
        Some(_) => {
            let zeros = || {
                enqueue_filled(
                    client,
                    &DeviceLimits::of(client),
                    vec![backward_plan::key_grad_elements(dims)],
                    0.0,
                )
            };
            Some((zeros()?, zeros()?))
        }
        None => None,
    };
    let scale = options.resolved_scale(dims.head_dim);
    let rows = backward_plan::prepared_rows(dims);
    let lse_log2 = DeviceTensor::empty(client, vec![rows], ElemType::F32);
    let delta = DeviceTensor::empty(client, vec![rows], ElemType::F32);
    let dq_sum = DeviceTensor::empty(client, vec![rows, dims.head_dim], ElemType::F32);
    let [prepare_kernel, main_kernel, dq_kernel] = kernels(&launch.variant);
    let [prepare_grid, main_grid, dq_grid] = launch.grids.clone();
    let row_scalars = backward_plan::row_scalars(dims, scale);
    let accumulate = launch.variant.accumulate;
    // The main kernel adds dK and dV to f32 sums (a step's accumulators, a split whole
    // attention's zeroed sums) instead of storing them through tensor maps.
    let (dk_target, dv_target) = match &split_sums {
        Some((dk_sum, dv_sum)) => (dk_sum, dv_sum),
        None => (dk, dv),
    };
    let adds_key_grads = accumulate || split_sums.is_some();

    let mut prepare = SourceArguments::new();
    for buffer in prepare_inputs
        .iter()
        .copied()
        .chain([&lse_log2, &delta, &dq_sum])
    {
        prepare.buffer(buffer);
    }
    row_scalars
        .into_iter()
        .for_each(|value| prepare.scalar(value));

    let q_view = [dims.batch * dims.q_heads, dims.q_len, dims.head_dim];
    let kv_view = [dims.batch * dims.kv_heads, dims.kv_len, dims.head_dim];
    let mut maps = vec![
        (q, &q_view, TILE_ROWS),
        (k, &kv_view, BLOCK_KEYS),
        (v, &kv_view, BLOCK_KEYS),
        (grad_out, &q_view, TILE_ROWS),
    ];
    if !adds_key_grads {
        // Each consumer warpgroup stores its 64 keys.
        maps.extend([
            (dk, &kv_view, BLOCK_KEYS / 2),
            (dv, &kv_view, BLOCK_KEYS / 2),
        ]);
    }
    let mut main = SourceArguments::new();
    for (tensor, view, rows) in maps {
        main.tiled_map(
            tensor,
            TiledMap {
                view,
                box_shape: &[1, rows, BOX_COLUMNS],
                swizzle: TensorMapSwizzle::B128,
            },
        );
    }
    for buffer in [&lse_log2, &delta, &dq_sum].into_iter().chain(&dq_turns) {
        main.buffer(buffer);
    }
    if adds_key_grads {
        main.buffer(dk_target);
        main.buffer(dv_target);
    }
    // Kept alive by the launch's binding.
    if options.mask.documents.is_some() {
        main.table(&DocumentTable::of(client, &options.mask, &q.handle));
    }
    backward_plan::scalars(dims, &options.mask, scale, launch.head_parts)
        .into_iter()
        .for_each(|value| main.scalar(value));

    let mut finish = SourceArguments::new();
    finish.buffer(&dq_sum);
    finish.buffer(dq);
    row_scalars
        .into_iter()
        .for_each(|value| finish.scalar(value));
    let convert =
        split_sums
            .as_ref()
            .zip(launch.convert_grid.clone())
            .map(|((dk_sum, dv_sum), grid)| {
                let mut arguments = SourceArguments::new();
                for buffer in [dk_sum, dv_sum, dk, dv] {
                    arguments.buffer(buffer);
                }
                backward_plan::key_row_scalars(dims, scale)
                    .into_iter()
                    .for_each(|value| arguments.scalar(value));
                (
                    row_kernel(&launch.variant, KV_CONVERT_ENTRY_POINT),
                    grid,
                    arguments,
                )
            });

    // SAFETY: `plan` checked that the runtime is CUDA on an sm_90 device and that the cubes,
    // shared memory and grids fit it; the arguments follow the three kernels' parameters for the
    // variant (the prepare kernel's inputs, its three buffers and four scalars; the main kernel's
    // tensor maps, their buffers, its three buffers, the deterministic variant's counters, a
    // step's two accumulators or a split whole attention's two sums, the documents' table with
    // documents, and sixteen scalars; the dQ kernel's two buffers and four scalars; the
    // conversion's four buffers and four scalars). The counters hold one per tile and 64 columns
    // the kernel indexes (`dq_turns`), and a wait that outlives any walk traps instead of
    // hanging. The grid holds `head_parts` cubes per block and key/value slice, `head_parts`
    // divides the group (`backward_plan::head_parts`), and the sums hold the keys' rows the
    // kernel adds to (`key_grad_elements`), which the conversion reads back pair by pair.
    // The scratch buffers hold the padded rows the kernels index (`prepared_rows`), the tensor
    // maps bound every copy to its tensor (rows past a slice read as zeros and are not stored),
    // the row kernels guard their rows and values, the main kernel reads the table at positions
    // `Mask::check_call` checked against it and adds to accumulator rows below `kv_len` only,
    // and its loops are bounded by the tile counts.
    unsafe {
        source_task::launch(client, prepare_kernel, prepare_grid, prepare);
        source_task::launch(client, main_kernel, main_grid, main);
        source_task::launch(client, dq_kernel, dq_grid, finish);
        if let Some((kernel, grid, arguments)) = convert {
            source_task::launch(client, kernel, grid, arguments);
        }
    }
    Ok(())
}

/// The gradients of the whole attention `out = attention(q, k, v)` (with its f32 log-sum-exp
/// `lse`) for the output gradient `grad_out` on a Hopper GPU, into caller-provided `dq`
/// (`[B, Hq, Sq, D]`), `dk` and `dv` (`[B, Hkv, Skv, D]`), all the inputs' type: every element
/// of the three is written. What [`crate::attention_backward`] runs under [`Variant::Hopper`]
/// (and, where it covers the call, [`Variant::Auto`]), whatever `options.variant` says.
///
/// # Errors
///
/// Shapes and types that disagree, bad options, and everything [`Variant::Hopper`] refuses
/// (the device, the element type, the head dim, the deterministic backward under packed
/// documents, unaligned buffers), before anything runs; a launch the runtime reports as failed is
/// [`KernelError::Launch`].
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<R: Runtime>(
    client: &ComputeClient<R>,
    (q, k, v): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    out: &DeviceTensor,
    lse: &DeviceTensor,
    grad_out: &DeviceTensor,
    (dq, dk, dv): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    options: &StepOptions,
) -> Result<(), KernelError> {
    let dims = check_backward((q, k, v), out, lse, grad_out)?;
    for (name, tensor, shape) in [
        ("dq", dq, dims.q_shape()),
        ("dk", dk, dims.kv_shape()),
        ("dv", dv, dims.kv_shape()),
    ] {
        AttentionDims::expect_shape(name, &shape, &tensor.shape)?;
        tensor.expect_elem(name, q.elem)?;
    }
    options.check()?;
    options.mask.check(&dims)?;
    let hopper = StepOptions {
        variant: Variant::Hopper,
        ..options.clone()
    };
    let tensors = ForwardTensors { q, k, v, out, lse };
    let outputs = [("dq", dq), ("dk", dk), ("dv", dv)];
    let launch = choose(client, &dims, &hopper, (&tensors, grad_out), &outputs)?
        .expect("Variant::Hopper always chooses the Hopper backward or refuses");
    enqueue(
        client,
        &launch,
        &tensors,
        grad_out,
        (dq, dk, dv),
        &dims,
        options,
    )?;
    launch_result(client, KERNEL)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hopper::source_task::{parameters, preprocessed_parameters};

    /// The main kernel's parameters as the preprocessor leaves them, for a step (`accumulate`)
    /// or a whole attention, with or without `documents`, `deterministic` or not.
    fn main_parameters(accumulate: bool, documents: bool, deterministic: bool) -> Vec<String> {
        preprocessed_parameters(BACKWARD_CU, ENTRY_POINT, |condition| match condition {
            "DISTFLASH_ACCUMULATE" => accumulate,
            "!DISTFLASH_ACCUMULATE" => !accumulate,
            "DISTFLASH_DOCUMENTS" => documents,
            "DISTFLASH_DETERMINISTIC" => deterministic,
            other => panic!("unexpected condition `{other}`"),
        })
    }

    #[test]
    fn the_sources_declare_the_parameters_in_launch_order() {
        // Tensor maps by value, their buffers, the plain buffers, then the scalars by value
        // (see `source_task`'s comment): what `enqueue_launches` registers for each kernel.
        let maps = [
            "const __grid_constant__ TensorMap q_map",
            "const __grid_constant__ TensorMap k_map",
            "const __grid_constant__ TensorMap v_map",
            "const __grid_constant__ TensorMap do_map",
        ];
        let buffers = [
            "const void* q_buffer",
            "const void* k_buffer",
            "const void* v_buffer",
            "const void* do_buffer",
        ];
        let stored_maps = [
            "const __grid_constant__ TensorMap dk_map",
            "const __grid_constant__ TensorMap dv_map",
        ];
        let stored_buffers = ["void* dk_buffer", "void* dv_buffer"];
        let scratch = [
            "const float* lse_log2",
            "const float* delta",
            "float* dq_sum",
        ];
        let accumulators = ["float* dk_sum", "float* dv_sum"];
        let docs = ["const u32* docs"];
        let info = ["const __grid_constant__ BackwardInfo info"];
        let turns = ["u32* dq_turns"];
        let cases = [
            (false, &[][..], &[][..]),
            (false, &docs[..], &[][..]),
            (true, &[][..], &turns[..]),
        ];
        for (deterministic, table, counters) in cases {
            let documents = !table.is_empty();
            assert_eq!(
                main_parameters(false, documents, deterministic),
                [
                    &maps[..],
                    &stored_maps,
                    &buffers,
                    &stored_buffers,
                    &scratch,
                    counters,
                    table,
                    &info
                ]
                .concat()
            );
            assert_eq!(
                main_parameters(true, documents, deterministic),
                [
                    &maps[..],
                    &buffers,
                    &scratch,
                    counters,
                    &accumulators,
                    table,
                    &info
                ]
                .concat()
            );
        }
        assert_eq!(
            parameters(ROWS_CU, PREPARE_STEP_ENTRY_POINT),
            [
                "const float* lse",
                "const float* given_delta",
                "float* lse_log2",
                "float* delta",
                "float* dq_sum",
                "const __grid_constant__ RowsInfo info",
            ]
        );
        assert_eq!(
            parameters(ROWS_CU, DQ_ADD_ENTRY_POINT),
            [
                "const float* dq_sum",
                "float* dq",
                "const __grid_constant__ RowsInfo info",
            ]
        );
        assert_eq!(
            parameters(ROWS_CU, PREPARE_ENTRY_POINT),
            [
                "const u32* out",
                "const u32* grad_out",
                "const float* lse",
                "float* lse_log2",
                "float* delta",
                "float* dq_sum",
                "const __grid_constant__ RowsInfo info",
            ]
        );
        assert_eq!(
            parameters(ROWS_CU, DQ_ENTRY_POINT),
            [
                "const float* dq_sum",
                "u32* dq",
                "const __grid_constant__ RowsInfo info",
            ]
        );
        assert_eq!(
            parameters(ROWS_CU, KV_CONVERT_ENTRY_POINT),
            [
                "const float* dk_sum",
                "const float* dv_sum",
                "u32* dk",
                "u32* dv",
                "const __grid_constant__ RowsInfo info",
            ]
        );
        assert_eq!(BACKWARD_CU.matches("__global__").count(), 1);
        assert_eq!(ROWS_CU.matches("__global__").count(), 5);
        for source in [BACKWARD_CU, ROWS_CU] {
            assert!(!source.contains("#include"));
        }
        assert!(BACKWARD_CU.contains("__launch_bounds__(DF_THREADS, 1)"));
    }

    #[test]
    fn each_variant_is_built_once_and_the_row_kernels_are_shared_by_masks() {
        let variant = |causal| BackwardVariant {
            head_dim: 64,
            elem: ElemType::BF16,
            mask: MaskKind {
                upper: causal,
                ..MaskKind::default()
            },
            accumulate: false,
            deterministic: false,
            split: false,
            producer_adds: false,
        };
        let [prepare, main, dq] = kernels(&variant(true));
        let [prepare_again, main_again, dq_again] = kernels(&variant(true));
        let [other_prepare, other_main, _] = kernels(&variant(false));
        assert_eq!(main.source().as_ptr(), main_again.source().as_ptr());
        assert_eq!(prepare.source().as_ptr(), prepare_again.source().as_ptr());
        assert_eq!(dq.source().as_ptr(), dq_again.source().as_ptr());
        assert_eq!(prepare.source().as_ptr(), other_prepare.source().as_ptr());
        assert_ne!(main.fingerprint(), other_main.fingerprint());
        assert_eq!(prepare.source(), dq.source());
        assert_ne!(prepare.fingerprint(), dq.fingerprint());
        assert_eq!(main.source(), backward_source(&variant(true)));
        assert_eq!(
            (main.units, main.shared_bytes),
            (384, backward_plan::shared_bytes(64))
        );
        assert_eq!(
            (prepare.entry_point, dq.entry_point),
            (PREPARE_ENTRY_POINT, DQ_ENTRY_POINT)
        );
        assert_eq!(prepare.units, 256);
        // A step's: its own main kernel, the same row source with the step's entry points.
        let step = BackwardVariant {
            accumulate: true,
            ..variant(true)
        };
        let [step_prepare, step_main, step_dq] = kernels(&step);
        assert_eq!(
            (step_prepare.entry_point, step_dq.entry_point),
            (PREPARE_STEP_ENTRY_POINT, DQ_ADD_ENTRY_POINT)
        );
        assert_eq!(step_prepare.source(), prepare.source());
        assert_ne!(step_main.fingerprint(), main.fingerprint());
        // The deterministic variant: its own main kernel, the same row kernels.
        let deterministic = BackwardVariant {
            deterministic: true,
            ..variant(true)
        };
        let [det_prepare, det_main, det_dq] = kernels(&deterministic);
        assert_eq!(det_prepare.fingerprint(), prepare.fingerprint());
        assert_eq!(det_dq.fingerprint(), dq.fingerprint());
        assert_ne!(det_main.fingerprint(), main.fingerprint());
        // The producer's ordered adds: its own main kernel, with the dQ buffers' shared memory,
        // the same row kernels.
        let producer = deterministic.with_deterministic_adds(schedule::DeterministicAdds::Producer);
        let [producer_prepare, producer_main, producer_dq] = kernels(&producer);
        assert_eq!(producer_prepare.fingerprint(), prepare.fingerprint());
        assert_eq!(producer_dq.fingerprint(), dq.fingerprint());
        assert_ne!(producer_main.fingerprint(), det_main.fingerprint());
        assert_eq!(
            producer_main.shared_bytes,
            backward_plan::shared_bytes_for(64, true)
        );
        assert_eq!(det_main.shared_bytes, backward_plan::shared_bytes(64));
        // The split variant: its own main kernel (a step's source with atomics), the whole
        // attention's row kernels, and the conversion from the same row source.
        let split = variant(true).with_head_parts(2);
        let [split_prepare, split_main, split_dq] = kernels(&split);
        assert_eq!(split_prepare.fingerprint(), prepare.fingerprint());
        assert_eq!(split_dq.fingerprint(), dq.fingerprint());
        assert_ne!(split_main.fingerprint(), main.fingerprint());
        assert_ne!(split_main.fingerprint(), step_main.fingerprint());
        let convert = row_kernel(&split, KV_CONVERT_ENTRY_POINT);
        assert_eq!(convert.source(), prepare.source());
        assert_eq!(convert.entry_point, KV_CONVERT_ENTRY_POINT);
        assert_eq!(
            row_kernel(&variant(false), KV_CONVERT_ENTRY_POINT).fingerprint(),
            convert.fingerprint()
        );
    }

    #[test]
    fn each_source_sets_its_switches_before_the_building_blocks() {
        let variant = BackwardVariant {
            head_dim: 128,
            elem: ElemType::F16,
            mask: MaskKind {
                upper: true,
                lower: true,
                documents: true,
            },
            accumulate: true,
            deterministic: true,
            split: false,
            producer_adds: false,
        };
        let main = backward_source(&variant);
        assert!(main.starts_with(&variant.switches()));
        assert!(main.ends_with(&format!("{PTX_PRELUDE}{ATTENTION_PRELUDE}{BACKWARD_CU}")));
        let rows = backward_rows_source(&variant);
        assert!(rows.starts_with(
            "#define DISTFLASH_HEAD_DIM 128\n#define DISTFLASH_F16 1\n#define DISTFLASH_UPPER 0\n\
             #define DISTFLASH_LOWER 0\n#define DISTFLASH_DOCUMENTS 0\n\
             #define DISTFLASH_ACCUMULATE 0\n#define DISTFLASH_DETERMINISTIC 0\n\
             #define DISTFLASH_SPLIT 0\n"
        ));
        assert!(rows.ends_with(ROWS_CU));
    }
}
