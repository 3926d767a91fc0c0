//! The Burn op on several backends: forward and all three gradients (through `Autodiff`)
//! against the f64 reference, causal and full masks, GQA, odd lengths, the coverage matrix of
//! head dims, head groupings, float types, masks and one-shot/stepped calls, the Hopper kernels
//! under the op on an H100/H200, a grid folded past 65,535 (batch x heads), and bad input
//! (shapes, float types, devices, options, device limits) refused with a clear error before any
//! work. Half precision on wgpu runs in the `half_precision` test binary: Burn 0.21 fixes one
//! default float type per device and process.

use crate::common::burn_case::{check_backend, check_case, check_steps, to_host};
use crate::common::matrix::check_matrix;
use burn::backend::{Autodiff, NdArray};
use burn::tensor::{DType, Tensor};
use burn_distflash::{flash_attention, flash_attention_with_lse, FlashAttentionOptions};
use distflash_kernels::ElemType;

type WgpuF32 = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>;
/// What `burn-wgpu`/`burn-cuda` give with default features: the CubeCL backend under `Fusion`.
type FusedWgpuF32 = burn_fusion::Fusion<WgpuF32>;

#[test]
fn ndarray_matches_reference() {
    check_backend::<Autodiff<NdArray<f32>>>(&Default::default(), ElemType::F32);
}

#[test]
fn wgpu_f32_matches_reference() {
    check_backend::<Autodiff<WgpuF32>>(&cubecl::wgpu::WgpuDevice::Cpu, ElemType::F32);
}

#[test]
fn fused_wgpu_f32_matches_reference() {
    check_backend::<Autodiff<FusedWgpuF32>>(&cubecl::wgpu::WgpuDevice::Cpu, ElemType::F32);
}

type CudaF32 = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn cuda_f32_matches_reference() {
    check_backend::<Autodiff<CudaF32>>(&cubecl::cuda::CudaDevice::new(0), ElemType::F32);
    check_steps::<CudaF32>(&cubecl::cuda::CudaDevice::new(0), ElemType::F32);
    check_backend::<Autodiff<burn_fusion::Fusion<CudaF32>>>(
        &cubecl::cuda::CudaDevice::new(0),
        ElemType::F32,
    );
}

/// The coverage matrix (see `common/matrix.rs`) on every backend CI has. Every float type runs
/// in this process: the matrix creates tensors with their float type explicitly.
#[test]
fn ndarray_matrix() {
    check_matrix::<Autodiff<NdArray<f32>>>(&Default::default(), "ndarray");
}

#[test]
fn wgpu_matrix() {
    check_matrix::<Autodiff<WgpuF32>>(&cubecl::wgpu::WgpuDevice::Cpu, "wgpu (lavapipe)");
}

#[test]
fn fused_wgpu_matrix() {
    check_matrix::<Autodiff<FusedWgpuF32>>(&cubecl::wgpu::WgpuDevice::Cpu, "fused wgpu (lavapipe)");
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn cuda_matrix() {
    let device = cubecl::cuda::CudaDevice::new(0);
    check_matrix::<Autodiff<CudaF32>>(&device, "cuda");
    check_matrix::<Autodiff<burn_fusion::Fusion<CudaF32>>>(&device, "fused cuda");
}

#[test]
fn steps_match_reference() {
    check_steps::<NdArray<f32>>(&Default::default(), ElemType::F32);
    check_steps::<WgpuF32>(&cubecl::wgpu::WgpuDevice::Cpu, ElemType::F32);
    check_steps::<FusedWgpuF32>(&cubecl::wgpu::WgpuDevice::Cpu, ElemType::F32);
}

#[test]
fn runs_on_a_plain_backend_and_returns_lse() {
    // Without autodiff too: the op works on the plain backends.
    let device = Default::default();
    let q = Tensor::<NdArray<f32>, 4>::ones([1, 1, 3, 64], &device);
    let (out, lse) =
        flash_attention_with_lse(q.clone(), q.clone(), q, FlashAttentionOptions::causal()).unwrap();
    let lse = to_host(lse);
    assert!(lse.iter().all(|x| x.is_finite()), "{lse:?}");
    assert!(to_host(out).iter().all(|x| (x - 1.0).abs() < 1e-6));
}

#[test]
fn bad_input_is_refused() {
    let device = Default::default();
    let t = |shape: [usize; 4]| Tensor::<NdArray<f32>, 4>::zeros(shape, &device);
    let opts = FlashAttentionOptions::default();
    let err = flash_attention(
        t([1, 3, 8, 64]),
        t([1, 2, 8, 64]),
        t([1, 2, 8, 64]),
        opts.clone(),
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("multiple of key/value heads"),
        "{err}"
    );
    let err = flash_attention(
        t([1, 2, 8, 64]),
        t([1, 2, 8, 64]),
        t([1, 2, 9, 64]),
        opts.clone(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("v against k"), "{err}");
    let err = flash_attention(
        t([1, 2, 8, 40]),
        t([1, 2, 8, 40]),
        t([1, 2, 8, 40]),
        opts.clone(),
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("head dimension 40 is not supported"),
        "{err}"
    );

    // Float types: unsupported, or not shared by q, k and v.
    let typed = |dtype| Tensor::<NdArray<f32>, 4>::zeros([1, 2, 8, 64], (&device, dtype));
    let err = flash_attention(
        typed(DType::F64),
        typed(DType::F64),
        typed(DType::F64),
        opts.clone(),
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("q is F64; expected f16, bf16 or f32"),
        "{err}"
    );
    let err = flash_attention(
        typed(DType::F32),
        typed(DType::F64),
        typed(DType::F32),
        opts.clone(),
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("k is F64; expected q's float type F32"),
        "{err}"
    );

    // Options: the scale must be finite.
    let nan_scale = FlashAttentionOptions::default().with_scale(f32::NAN);
    let q = t([1, 2, 8, 64]);
    let err = flash_attention(q.clone(), q.clone(), q, nan_scale).unwrap_err();
    assert!(err.to_string().contains("scale must be finite"), "{err}");
}

/// q, k and v on two devices are refused before anything runs.
#[test]
fn tensors_on_two_devices_are_refused() {
    use cubecl::wgpu::WgpuDevice;
    let on = |device: &WgpuDevice| Tensor::<WgpuF32, 4>::zeros([1, 2, 8, 16], device);
    let (cpu, other) = (WgpuDevice::Cpu, WgpuDevice::DefaultDevice);
    let err = flash_attention(on(&cpu), on(&other), on(&cpu), Default::default()).unwrap_err();
    assert!(err.to_string().contains("expected q's device"), "{err}");
}

/// batch x heads = 65,536 used to panic in the backend (grid limit 65535): the grid folds, and
/// output and gradients match the reference. Beyond what the device's grid can hold (a prime
/// number of slices above 65535), the call is refused with an error, before any work.
#[test]
fn wgpu_grid_folds_past_65535_heads() {
    let device = cubecl::wgpu::WgpuDevice::Cpu;
    let (heads, lens) = ((2, 32768, 32768), (2, 3, 16));
    check_case::<Autodiff<WgpuF32>>(&device, ElemType::F32, heads, lens, true);
    check_case::<Autodiff<FusedWgpuF32>>(&device, ElemType::F32, heads, lens, false);
    let q = Tensor::<WgpuF32, 4>::zeros([1, 65537, 1, 16], &device);
    let err = flash_attention(q.clone(), q.clone(), q, Default::default()).unwrap_err();
    assert!(err.to_string().contains("device limit"), "{err}");
}

/// On an H100/H200 the op's whole-attention calls run the Hopper kernels (`Variant::Auto`):
/// the forward output and all three gradients through `Autodiff` against the f64 reference,
/// both 16-bit types and head dims, GQA causal and MHA full, lengths over several query tiles
/// and key blocks of those kernels, the last of each partial.
#[test]
#[ignore = "needs an H100/H200 (CUDA compute capability 9.0): run with --ignored there"]
fn cuda_hopper_kernels_match_reference() {
    let device = cubecl::cuda::CudaDevice::new(0);
    let client = <cubecl::cuda::CudaRuntime as cubecl::Runtime>::client(&device);
    assert!(
        distflash_kernels::hopper::available(&client),
        "not a compute capability 9.0 GPU"
    );
    for elem in [ElemType::BF16, ElemType::F16] {
        for head_dim in [64, 128] {
            for (heads, causal) in [((1, 4, 2), true), ((2, 2, 2), false)] {
                let lens = (200, 333, head_dim);
                check_case::<Autodiff<CudaF32>>(&device, elem, heads, lens, causal);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn cuda_grid_folds_past_65535_heads() {
    let device = cubecl::cuda::CudaDevice::new(0);
    let (heads, lens) = ((2, 32768, 32768), (2, 3, 64));
    for elem in [ElemType::F32, ElemType::F16] {
        check_case::<Autodiff<CudaF32>>(&device, elem, heads, lens, true);
        check_case::<Autodiff<burn_fusion::Fusion<CudaF32>>>(&device, elem, heads, lens, false);
    }
}
