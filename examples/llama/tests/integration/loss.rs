//! The next-token loss against f64: the cross-entropy sum and its gradient with respect to the
//! logits, through `Autodiff` on wgpu (the fused kernels; Mesa's software Vulkan in CI), on
//! ndarray (Burn's log-softmax) and, with `--ignored` on the GPU machine, on CUDA in f32, f16 and
//! bf16; vocabularies that take every vector width, and a target in the first and last column.

use crate::common::exclusive_wgpu;
use crate::common::host_values::host;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_autodiff::Autodiff;
use distflash_llama::loss::CrossEntropyBackend;

type WgpuF32 = Autodiff<burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>>;
type CudaBf16 = Autodiff<burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, half::bf16, i32, u8>>;
type CudaF32 = Autodiff<burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>>;
type Cpu = Autodiff<burn::backend::NdArray<f32>>;

/// `(rows, vocab)` cases: vectors of 8, 4, 2 and 1 elements, one row and many.
const CASES: [(usize, usize); 5] = [(1, 8), (5, 1000), (3, 30), (7, 257), (33, 4096)];

/// `len` values uniform in `[-scale, scale)` from the stream `seed`.
pub(crate) fn values(len: usize, seed: u64, scale: f64) -> Vec<f64> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(7);
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            scale * (2.0 * ((state >> 11) as f64 / (1u64 << 53) as f64) - 1.0)
        })
        .collect()
}

/// `rows` target ids below `vocab`: the first and last column and spread between.
pub(crate) fn spread_targets(rows: usize, vocab: usize) -> Vec<i64> {
    (0..rows)
        .map(|r| match r % 3 {
            0 => 0,
            1 => vocab as i64 - 1,
            _ => ((r * 7919) % vocab) as i64,
        })
        .collect()
}

fn check<B: AutodiffBackend + CrossEntropyBackend>(device: &B::Device, dtype: DType, tol: f64) {
    for (case, &(rows, vocab)) in CASES.iter().enumerate() {
        let data = values(rows * vocab, case as u64, 8.0);
        let logits = Tensor::<B, 1>::from_data(TensorData::new(data, [rows * vocab]), device)
            .cast(DType::F32)
            .cast(dtype)
            .reshape([rows, vocab]);
        let x = host(logits.clone());
        let targets = spread_targets(rows, vocab);
        let target_tensor =
            Tensor::<B, 1, Int>::from_data(TensorData::new(targets.clone(), [rows]), device);
        let logits = logits.require_grad();
        let loss = B::cross_entropy_sum(logits.clone(), target_tensor);
        let scale = 0.37;
        let grads = (loss.clone() * scale).backward();
        let dlogits = host(logits.grad(&grads).expect("logits gradient"));
        let (mut expected_loss, mut expected_grad) = (0.0, vec![0.0; rows * vocab]);
        for r in 0..rows {
            let row = &x[r * vocab..(r + 1) * vocab];
            let m = row.iter().cloned().fold(f64::MIN, f64::max);
            let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
            let t = targets[r] as usize;
            expected_loss += lse - row[t];
            for j in 0..vocab {
                let onehot = if j == t { 1.0 } else { 0.0 };
                expected_grad[r * vocab + j] = scale * ((row[j] - lse).exp() - onehot);
            }
        }
        let got_loss = host(loss)[0];
        let loss_err = (got_loss - expected_loss).abs() / expected_loss.abs();
        assert!(
            loss_err <= 1e-5,
            "{dtype:?} {rows}x{vocab}: loss {got_loss} against f64 {expected_loss}"
        );
        let worst = dlogits
            .iter()
            .zip(&expected_grad)
            .map(|(g, e)| (g - e).abs() / e.abs().max(scale * 1e-3))
            .fold(0.0, f64::max);
        assert!(
            worst <= tol,
            "{dtype:?} {rows}x{vocab}: gradient differs from f64 by {worst:.2e} (tolerance {tol:.1e})"
        );
    }
}

#[test]
fn wgpu_fused_cross_entropy_matches_f64() {
    let _wgpu = exclusive_wgpu();
    check::<WgpuF32>(&cubecl::wgpu::WgpuDevice::Cpu, DType::F32, 1e-4);
}

#[test]
fn ndarray_cross_entropy_matches_f64() {
    check::<Cpu>(&Default::default(), DType::F32, 1e-4);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn cuda_fused_cross_entropy_matches_f64_in_every_dtype() {
    let device = cubecl::cuda::CudaDevice::new(0);
    check::<CudaF32>(&device, DType::F32, 1e-4);
    check::<CudaBf16>(&device, DType::BF16, 2.0 / 128.0);
    check::<CudaBf16>(&device, DType::F16, 2.0 / 1024.0);
}

#[test]
fn wgpu_fused_loss_of_an_out_of_range_target_is_nan() {
    let _wgpu = exclusive_wgpu();
    let device = cubecl::wgpu::WgpuDevice::Cpu;
    let logits =
        Tensor::<WgpuF32, 2>::from_floats([[1.0, 2.0, 3.0, 4.0], [1.0, 0.0, 0.0, 0.0]], &device);
    let targets = Tensor::<WgpuF32, 1, Int>::from_ints([1, 4], &device);
    let loss = host(WgpuF32::cross_entropy_sum(logits, targets))[0];
    assert!(
        loss.is_nan(),
        "a target past the vocabulary gives NaN, got {loss}"
    );
}
