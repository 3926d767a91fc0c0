//! The Burn op on several backends: forward and all three gradients (through `Autodiff`)
//! against the f64 reference, causal and full masks, GQA, odd lengths, and bad input refused with
//! a clear error. Half precision on wgpu runs in `burn_op_f16.rs`: Burn 0.21 fixes one default
//! float type per device and process.

mod common;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::Tensor;
use burn_distflash::{flash_attention, flash_attention_with_lse, FlashAttentionOptions};
use common::burn_case::{check_backend, check_steps, to_host};
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
    check_backend::<Autodiff<burn_fusion::Fusion<CudaF32>>>(
        &cubecl::cuda::CudaDevice::new(0),
        ElemType::F32,
    );
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
    let err =
        flash_attention(t([1, 3, 8, 64]), t([1, 2, 8, 64]), t([1, 2, 8, 64]), opts).unwrap_err();
    assert!(
        err.to_string().contains("multiple of key/value heads"),
        "{err}"
    );
    let err =
        flash_attention(t([1, 2, 8, 64]), t([1, 2, 8, 64]), t([1, 2, 9, 64]), opts).unwrap_err();
    assert!(err.to_string().contains("v against k"), "{err}");
    let err =
        flash_attention(t([1, 2, 8, 40]), t([1, 2, 8, 40]), t([1, 2, 8, 40]), opts).unwrap_err();
    assert!(
        err.to_string()
            .contains("head dimension 40 is not supported"),
        "{err}"
    );
}
