//! The Hopper bf16 matrix product on the host: the variant's source, its tensor maps, the
//! persistent grid and the launch (the device code is `gemm.cu`).

use cubecl::prelude::*;

use super::gemm_shape::{GemmLayout, GemmShape, SHARED_BYTES, TILE_K, TILE_M, TILE_N, UNITS};
use super::source_task::{self, CudaSource, SourceArguments, TiledMap, PTX_PRELUDE};
use crate::kernel_error::{launch_result, KernelError};
use crate::limits::DeviceLimits;
use crate::tensor::{DeviceTensor, ElemType};

/// The device code, compiled per variant with the switches of [`gemm_source`].
const GEMM_CU: &str = include_str!("gemm.cu");

/// The kernel's entry point in `gemm.cu`.
const ENTRY_POINT: &str = "distflash_hopper_gemm";

/// The CUDA source of one variant: its switches (B's layout, C's type), the PTX building
/// blocks (`ptx.cuh`), then `gemm.cu`.
pub fn gemm_source(layout: GemmLayout, out: ElemType) -> String {
    let b_mn_major = u8::from(layout == GemmLayout::BRowMajor);
    let c_f32 = u8::from(out == ElemType::F32);
    format!(
        "#define DISTFLASH_B_MN_MAJOR {b_mn_major}\n#define DISTFLASH_C_F32 {c_f32}\n\
         {PTX_PRELUDE}{GEMM_CU}"
    )
}

/// `c = a b^T` (`layout` [`GemmLayout::BTransposed`], `b` is `[N, K]`) or `c = a b`
/// ([`GemmLayout::BRowMajor`], `b` is `[K, N]`) on a Hopper GPU: `a` `[M, K]` and `b` in bf16,
/// accumulated in f32, `c` `[M, N]` written in bf16 or f32 (its element type). All row-major and
/// contiguous; M, N and K positive multiples of 128, 256 and 64.
///
/// Refused before anything runs: shapes that disagree or miss the tile, other element types, a
/// device that is not CUDA compute capability 9.0 ([`super::available`]). A launch the runtime
/// reports as failed is [`KernelError::Launch`].
pub fn gemm<R: Runtime>(
    client: &ComputeClient<R>,
    a: &DeviceTensor,
    b: &DeviceTensor,
    c: &DeviceTensor,
    layout: GemmLayout,
) -> Result<(), KernelError> {
    let shape = GemmShape::check(
        (&a.shape, a.elem),
        (&b.shape, b.elem),
        (&c.shape, c.elem),
        layout,
    )?;
    if !super::available(client) {
        return Err(KernelError::DeviceLimit {
            what: "the Hopper matrix product needs a CUDA GPU of compute capability 9.0 \
                   (wgmma and the bulk tensor copy engine)"
                .into(),
        });
    }
    let limits = DeviceLimits::of(client);
    limits.expect_units("the Hopper matrix product", UNITS)?;
    limits.expect_shared("the Hopper matrix product", SHARED_BYTES)?;

    let swizzle = TensorMapSwizzle::B128;
    let mut arguments = SourceArguments::new();
    arguments.tiled_map(
        a,
        TiledMap {
            view: &a.shape,
            box_shape: &[TILE_M, TILE_K],
            swizzle,
        },
    );
    let b_box = match layout {
        GemmLayout::BTransposed => [TILE_N, TILE_K],
        // Boxes of 64 columns (128 bytes) by one stage's depth; four per stage.
        GemmLayout::BRowMajor => [TILE_K, 64],
    };
    arguments.tiled_map(
        b,
        TiledMap {
            view: &b.shape,
            box_shape: &b_box,
            swizzle,
        },
    );
    arguments.buffer(c);
    for value in shape.scalars() {
        arguments.scalar(value);
    }
    let kernel = CudaSource::new(
        ENTRY_POINT,
        gemm_source(layout, c.elem),
        UNITS as u32,
        SHARED_BYTES,
    );
    let cubes = shape.cubes(client.properties().hardware.num_streaming_multiprocessors);
    // SAFETY: the runtime is CUDA on an sm_90 device (checked above); the arguments follow
    // `distflash_hopper_gemm`'s parameters (A's and B's tensor maps, their buffers, C, the four
    // scalars); the shapes were checked to be whole tiles, so every box copied and every
    // element stored is inside its matrix, and every loop is bounded by the tile counts.
    unsafe { source_task::launch(client, kernel, CubeCount::Static(cubes, 1, 1), arguments) };
    launch_result(client, "the Hopper matrix product")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_variant_sets_its_switches_before_the_device_code() {
        let source = gemm_source(GemmLayout::BRowMajor, ElemType::F32);
        assert!(source.starts_with("#define DISTFLASH_B_MN_MAJOR 1\n#define DISTFLASH_C_F32 1\n"));
        let source = gemm_source(GemmLayout::BTransposed, ElemType::BF16);
        assert!(source.starts_with("#define DISTFLASH_B_MN_MAJOR 0\n#define DISTFLASH_C_F32 0\n"));
        assert!(source.ends_with(&format!("{PTX_PRELUDE}{GEMM_CU}")));
    }

    #[test]
    fn the_source_declares_the_parameters_in_launch_order() {
        // Tensor maps by value, their buffers, C, then the scalars by value (see
        // `source_task`'s comment): what `gemm` registers.
        let signature = GEMM_CU
            .split(&format!("{ENTRY_POINT}("))
            .nth(1)
            .and_then(|rest| rest.split(')').next())
            .expect("gemm.cu defines the entry point");
        let parameters: Vec<&str> = signature.split(',').map(str::trim).collect();
        assert_eq!(
            parameters,
            [
                "const __grid_constant__ TensorMap a_map",
                "const __grid_constant__ TensorMap b_map",
                "const void* a_buffer",
                "const void* b_buffer",
                "void* c",
                "const __grid_constant__ GemmInfo info",
            ]
        );
        assert_eq!(GEMM_CU.matches("__global__").count(), 1);
        assert!(!GEMM_CU.contains("#include"));
        assert!(GEMM_CU.contains("__launch_bounds__(DF_THREADS, 1)"));
        assert!(GEMM_CU.contains("#define DF_THREADS (128 * (DF_CONSUMERS + 1))"));
        assert_eq!(UNITS, 128 * 3);
    }
}
