//! The launch plan of one attention call: which variant runs, the tile heights of the portable
//! backward kernels, and every kernel's grid, all checked against the device's limits before
//! anything is launched.

use cubecl::prelude::*;

use crate::dims::AttentionDims;
use crate::grid::{self, Rows};
use crate::kernel_error::KernelError;
use crate::limits::DeviceLimits;
use crate::mask::KernelMask;
use crate::portable::backward::{dkdv_shared_bytes, dq_shared_bytes};
use crate::portable::{backward_tile_rows, ROWS_PER_CUBE};
use crate::state_kernels::{ELEMENT_UNITS, ROW_LANES, ROW_UNITS};
use crate::step_options::{StepOptions, Variant};
use crate::tensor::ElemType;
use crate::tensor_core;

/// Launch choices of the portable kernels for one call.
#[derive(Debug, Clone)]
pub(crate) struct PortablePlan {
    /// Forward and dQ: blocks of [`ROWS_PER_CUBE`] query rows, slices = batch * q_heads.
    pub query_grid: CubeCount,
    /// dK/dV: blocks of [`ROWS_PER_CUBE`] keys, slices = batch * kv_heads.
    pub key_grid: CubeCount,
    /// Keys per shared-memory tile of the dQ kernel.
    pub dq_tile_rows: usize,
    /// Queries per shared-memory tile of the dK/dV kernel.
    pub dkdv_tile_rows: usize,
}

/// Which kernels run one call, and how.
#[derive(Debug, Clone)]
pub(crate) enum LaunchPlan {
    /// The scalar kernels.
    Portable(PortablePlan),
    /// The CUDA tensor-core kernels.
    TensorCore(tensor_core::Grids),
}

impl PortablePlan {
    fn new(dims: &AttentionDims, limits: &DeviceLimits) -> Result<Self, KernelError> {
        limits.expect_units("the portable attention kernels", ROWS_PER_CUBE)?;
        let tile = |kernel: &str, bytes: fn(usize, usize) -> usize| {
            backward_tile_rows(limits.max_shared_memory, |rows| bytes(rows, dims.head_dim))
                .ok_or_else(|| KernelError::DeviceLimit {
                    what: format!(
                        "{kernel} at head dim {} needs at least {} bytes of shared memory per \
                         cube; the device allows {}",
                        dims.head_dim,
                        bytes(2, dims.head_dim),
                        limits.max_shared_memory
                    ),
                })
        };
        Ok(Self {
            query_grid: grid::blocks(
                "the portable forward and dQ kernels",
                dims,
                Rows::Query,
                ROWS_PER_CUBE,
                limits,
            )?,
            key_grid: grid::blocks(
                "the portable dK/dV kernel",
                dims,
                Rows::Key,
                ROWS_PER_CUBE,
                limits,
            )?,
            dq_tile_rows: tile("the portable dQ kernel", dq_shared_bytes)?,
            dkdv_tile_rows: tile("the portable dK/dV kernel", dkdv_shared_bytes)?,
        })
    }
}

impl LaunchPlan {
    /// The plan for `dims` and `elem` on a device with `limits`, where `tensor_cores` says
    /// whether the runtime has what the tensor-core kernels need (see
    /// [`crate::tensor_core_available`]). Refuses an element type the device cannot run, and any
    /// call whose forward or backward kernels, or the state kernels on its tensors, exceed the
    /// device's limits. `Variant::Auto` falls back to the portable kernels where the
    /// tensor-core ones do not fit.
    pub(crate) fn new(
        limits: &DeviceLimits,
        tensor_cores: bool,
        dims: &AttentionDims,
        elem: ElemType,
        variant: Variant,
    ) -> Result<Self, KernelError> {
        limits.expect_elem(elem)?;
        check_state_kernels(dims, limits)?;
        let tensor_core_plan = || tensor_core::grids(dims, limits).map(LaunchPlan::TensorCore);
        match variant {
            Variant::Portable => PortablePlan::new(dims, limits).map(LaunchPlan::Portable),
            Variant::Auto if tensor_cores => tensor_core_plan()
                .or_else(|_| PortablePlan::new(dims, limits).map(LaunchPlan::Portable)),
            Variant::Auto => PortablePlan::new(dims, limits).map(LaunchPlan::Portable),
            // The Hopper variant runs attention on its own kernels (refusing the rest);
            // the tensor-core plan checks the call's other limits.
            Variant::TensorCore | Variant::Hopper if tensor_cores => tensor_core_plan(),
            Variant::TensorCore | Variant::Hopper => Err(KernelError::DType {
                what: format!(
                    "the tensor-core variant needs a runtime with f16/bf16 mma.sync and head_dim \
                     in {:?}; got {elem:?}, head_dim {}",
                    tensor_core::HEAD_DIMS,
                    dims.head_dim
                ),
            }),
        }
    }

    /// The options checked, then `client`'s device limits and [`LaunchPlan::new`] for them.
    pub(crate) fn for_call<R: Runtime>(
        client: &ComputeClient<R>,
        dims: &AttentionDims,
        elem: ElemType,
        options: &StepOptions,
    ) -> Result<(DeviceLimits, Self), KernelError> {
        options.check()?;
        options.mask.check(dims)?;
        let limits = DeviceLimits::of(client);
        // The tensor-core kernels take the row max of raw scores and scale it once, which needs
        // a positive scale; other scales run on the portable kernels.
        let scale = options.resolved_scale(dims.head_dim);
        let positive_scale = scale > 0.0 && scale.is_finite();
        if options.variant == Variant::Hopper {
            // What the Hopper forward does not cover is refused under its variant, whichever
            // entry point asks.
            let ends = crate::hopper::ForwardEnds::Whole;
            crate::hopper::plan_forward(client, dims, elem, options, ends)?;
        }
        if options.variant == Variant::TensorCore && !positive_scale {
            return Err(KernelError::BadOption {
                what: format!(
                    "the tensor-core variant needs a positive, finite score scale; got {scale} \
                     (Variant::Auto runs other scales on the portable kernels)"
                ),
            });
        }
        let tensor_cores = positive_scale && tensor_core::supports(client, elem, dims.head_dim);
        let plan = Self::new(&limits, tensor_cores, dims, elem, options.variant)?;
        Ok((limits, plan))
    }
}

/// The element- and row-wise kernels on this call's largest tensor and its rows fit the grid.
fn check_state_kernels(dims: &AttentionDims, limits: &DeviceLimits) -> Result<(), KernelError> {
    limits.expect_units("the state kernels", ELEMENT_UNITS.max(ROW_UNITS))?;
    let rows = dims.batch * dims.q_heads.max(dims.kv_heads) * dims.q_len.max(dims.kv_len);
    grid::linear(
        "the element-wise kernels",
        (rows * dims.head_dim).div_ceil(ELEMENT_UNITS),
        limits,
    )?;
    grid::linear(
        "the row-wise kernels",
        (rows * ROW_LANES).div_ceil(ROW_UNITS),
        limits,
    )?;
    Ok(())
}

/// Checks, without launching anything, that attention with these dimensions, element type and
/// options (forward and backward, stepped or one-shot) can run on `client`'s device: valid
/// options, an element type the device runs, and grids, cubes and shared memory within the
/// device's limits. The launch functions make the same checks; callers that must refuse bad
/// input before doing other work (the Burn op) call this first.
pub fn check_launch<R: Runtime>(
    client: &ComputeClient<R>,
    dims: &AttentionDims,
    elem: ElemType,
    options: &StepOptions,
) -> Result<(), KernelError> {
    LaunchPlan::for_call(client, dims, elem, options).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lavapipe_like() -> DeviceLimits {
        DeviceLimits {
            max_shared_memory: 32768,
            max_cube_count: (65535, 65535, 65535),
            max_units_per_cube: 1024,
            max_cube_dim_x: 1024,
            f16: true,
            bf16: false,
            stmatrix: false,
        }
    }

    fn dims(batch: usize, heads: usize, len: usize, head_dim: usize) -> AttentionDims {
        AttentionDims {
            batch,
            q_heads: heads,
            kv_heads: heads,
            q_len: len,
            kv_len: len,
            head_dim,
        }
    }

    /// The plan of a call on a device with `limits`, without tensor cores unless `variant` asks.
    fn plan(
        limits: &DeviceLimits,
        d: AttentionDims,
        elem: ElemType,
        variant: Variant,
    ) -> Result<LaunchPlan, KernelError> {
        LaunchPlan::new(limits, variant != Variant::Portable, &d, elem, variant)
    }

    fn refusal(
        limits: &DeviceLimits,
        d: AttentionDims,
        elem: ElemType,
        variant: Variant,
    ) -> String {
        plan(limits, d, elem, variant).unwrap_err().to_string()
    }

    #[test]
    fn backward_tiles_fit_the_shared_memory_of_the_device() {
        let limits = lavapipe_like();
        for head_dim in crate::SUPPORTED_HEAD_DIMS {
            let d = dims(1, 1, 9, head_dim);
            let Ok(LaunchPlan::Portable(p)) = plan(&limits, d, ElemType::F32, Variant::Portable)
            else {
                panic!("expected a portable plan at head dim {head_dim}");
            };
            assert!(dq_shared_bytes(p.dq_tile_rows, head_dim) <= 32768);
            assert!(dkdv_shared_bytes(p.dkdv_tile_rows, head_dim) <= 32768);
            // The largest tile that fits: 16 rows everywhere but dK/dV at head dim 256.
            let expected = if head_dim == 256 { 8 } else { 16 };
            assert_eq!((p.dq_tile_rows, p.dkdv_tile_rows), (16, expected));
        }
        let tiny = DeviceLimits {
            max_shared_memory: 1024,
            ..limits
        };
        let err = refusal(&tiny, dims(1, 1, 9, 256), ElemType::F32, Variant::Portable);
        assert!(
            err.contains("shared memory") && err.contains("allows 1024"),
            "{err}"
        );
    }

    #[test]
    fn limits_are_refused_before_launch() {
        let limits = lavapipe_like();
        let portable = Variant::Portable;
        // 65,536 (batch, head) slices fold into the grid.
        assert!(plan(&limits, dims(2, 32768, 3, 16), ElemType::F32, portable).is_ok());
        // A prime number of slices above 65535 cannot be folded exactly.
        let err = refusal(&limits, dims(1, 65537, 1, 16), ElemType::F32, portable);
        assert!(err.contains("65537"), "{err}");
        let err = refusal(&limits, dims(1, 1, 3, 16), ElemType::BF16, portable);
        assert!(err.contains("BF16"), "{err}");
        let few_units = DeviceLimits {
            max_units_per_cube: 16,
            ..limits
        };
        let err = refusal(&few_units, dims(1, 1, 3, 16), ElemType::F32, portable);
        assert!(err.contains("units"), "{err}");
    }

    #[test]
    fn tensor_cores_fall_back_or_refuse_when_they_do_not_fit() {
        let small = DeviceLimits {
            max_shared_memory: 48 * 1024,
            ..lavapipe_like()
        };
        let d = dims(1, 2, 100, 128);
        let auto = plan(&small, d, ElemType::F16, Variant::Auto).unwrap();
        assert!(matches!(auto, LaunchPlan::Portable(_)));
        let err = refusal(&small, d, ElemType::F16, Variant::TensorCore);
        assert!(err.contains("shared memory"), "{err}");
        let big = DeviceLimits {
            max_shared_memory: 227 * 1024,
            ..small
        };
        let auto = plan(&big, d, ElemType::F16, Variant::Auto).unwrap();
        assert!(matches!(auto, LaunchPlan::TensorCore(_)));
    }
}
