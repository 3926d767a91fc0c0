//! The layers' element-wise operations (SwiGLU, RMS norm, rotary embedding; forward and
//! backward) against f64 references written out here: the fused CubeCL kernels on wgpu (Mesa's
//! software Vulkan in CI) and, with `--ignored` on the GPU machine, on CUDA in f32, f16 and bf16;
//! the tensor-operation versions on ndarray. Odd row counts, widths that take every vector width,
//! norm rows spanning several weight-gradient chunks, and rotary inputs given as strided views.
//! The linear layers' product and its two gradient products (`dx = dy W^T`, `dW = x^T dy`, the
//! transposed operands of every backend's matmul) for every row count from 1 to 64 and widths
//! around every vector width and tile, under `Autodiff`.

use crate::common::host_values::{host, upload};
use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorPrimitive};
use burn_distflash::{FlashAttentionBackend, LayerOpsBackend};
use burn_fusion::Fusion;

type WgpuF32 = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>;
type CudaF32 = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;
type CudaBf16 = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, half::bf16, i32, u8>;
type Cpu = burn::backend::NdArray<f32>;
type FusedWgpuF32 = Fusion<WgpuF32>;

const EPS: f64 = 1e-5;

fn values(len: usize, seed: u64, scale: f64) -> Vec<f64> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(11);
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            scale * (2.0 * ((state >> 11) as f64 / (1u64 << 53) as f64) - 1.0)
        })
        .collect()
}

fn prim<B: Backend, const D: usize>(t: Tensor<B, D>) -> burn::tensor::ops::FloatTensor<B> {
    t.into_primitive().tensor()
}

fn read<B: Backend, const D: usize>(t: burn::tensor::ops::FloatTensor<B>) -> Vec<f64> {
    host(Tensor::<B, D>::from_primitive(TensorPrimitive::Float(t)))
}

/// `got` within `tol` of `expected`, relative to the larger of 1 and the largest expected value.
fn assert_near(what: &str, got: &[f64], expected: &[f64], tol: f64) {
    assert_eq!(got.len(), expected.len(), "{what}: length");
    let scale = expected.iter().fold(1.0f64, |m, v| m.max(v.abs()));
    for (i, (g, e)) in got.iter().zip(expected).enumerate() {
        assert!(
            (g - e).abs() <= tol * scale && g.is_finite(),
            "{what}[{i}]: got {g}, expected {e} (tolerance {} )",
            tol * scale
        );
    }
}

fn sigmoid(g: f64) -> f64 {
    1.0 / (1.0 + (-g).exp())
}

/// `(rows, width)` of the SwiGLU and norm cases: every vector width, rows over several chunks.
const CASES: [(usize, usize); 4] = [(1, 8), (13, 40), (130, 36), (7, 30)];

fn check_swiglu<B: FlashAttentionBackend>(device: &B::Device, dtype: DType, tol: f64) {
    for (case, &(rows, width)) in CASES.iter().enumerate() {
        let shape = [1, rows, width];
        let n = rows * width;
        let seed = 10 * case as u64;
        let (gate, g) = upload::<B, 3>(values(n, seed, 6.0), shape, dtype, device);
        let (up, u) = upload::<B, 3>(values(n, seed + 1, 2.0), shape, dtype, device);
        let (dh_t, dh) = upload::<B, 3>(values(n, seed + 2, 2.0), shape, dtype, device);
        let hidden: Vec<f64> = (0..n).map(|i| g[i] * sigmoid(g[i]) * u[i]).collect();
        let got = read::<B, 3>(B::swiglu(prim(gate.clone()), prim(up.clone())));
        assert_near(&format!("swiglu {case}"), &got, &hidden, tol);
        let (h, dg, du) = B::swiglu_backward(prim(gate), prim(up), prim(dh_t));
        let dgate: Vec<f64> = (0..n)
            .map(|i| {
                let s = sigmoid(g[i]);
                dh[i] * u[i] * s * (1.0 + g[i] * (1.0 - s))
            })
            .collect();
        let dup: Vec<f64> = (0..n).map(|i| dh[i] * g[i] * sigmoid(g[i])).collect();
        assert_near(
            &format!("swiglu hidden {case}"),
            &read::<B, 3>(h),
            &hidden,
            tol,
        );
        assert_near(
            &format!("swiglu dgate {case}"),
            &read::<B, 3>(dg),
            &dgate,
            tol,
        );
        assert_near(&format!("swiglu dup {case}"), &read::<B, 3>(du), &dup, tol);
    }
}

fn check_rms_norm<B: FlashAttentionBackend>(device: &B::Device, dtype: DType, tol: f64) {
    for (case, &(rows, width)) in CASES.iter().enumerate() {
        let shape = [1, rows, width];
        let n = rows * width;
        let seed = 100 + 10 * case as u64;
        let (x_t, x) = upload::<B, 3>(values(n, seed, 3.0), shape, dtype, device);
        let (w_t, w) = upload::<B, 1>(values(width, seed + 1, 1.5), [width], dtype, device);
        let (g_t, g) = upload::<B, 3>(values(n, seed + 2, 1.0), shape, dtype, device);
        let inv_rms: Vec<f64> = (0..rows)
            .map(|r| {
                let row = &x[r * width..(r + 1) * width];
                1.0 / (row.iter().map(|v| v * v).sum::<f64>() / width as f64 + EPS).sqrt()
            })
            .collect();
        let out: Vec<f64> = (0..n)
            .map(|i| x[i] * inv_rms[i / width] * w[i % width])
            .collect();
        let got = read::<B, 3>(B::rms_norm(prim(x_t.clone()), prim(w_t.clone()), EPS));
        assert_near(&format!("rms_norm {case}"), &got, &out, tol);
        let mut dx = vec![0.0; n];
        let mut dw = vec![0.0; width];
        for (r, &r_inv) in inv_rms.iter().enumerate() {
            let at = |j: usize| r * width + j;
            let normed = |j: usize| x[at(j)] * r_inv;
            let projection =
                (0..width).map(|j| g[at(j)] * w[j] * normed(j)).sum::<f64>() / width as f64;
            for j in 0..width {
                dx[at(j)] = (g[at(j)] * w[j] - normed(j) * projection) * r_inv;
                dw[j] += g[at(j)] * normed(j);
            }
        }
        let (got_dx, got_dw) = B::rms_norm_backward(prim(x_t), prim(w_t), prim(g_t), EPS);
        assert_near(
            &format!("rms_norm dx {case}"),
            &read::<B, 3>(got_dx),
            &dx,
            tol,
        );
        assert_near(
            &format!("rms_norm dweight {case}"),
            &read::<B, 1>(got_dw),
            &dw,
            tol,
        );
    }
}

fn check_rotary<B: FlashAttentionBackend>(device: &B::Device, dtype: DType, tol: f64) {
    // (batch, heads, len, head_dim, x given as the [batch, len, heads, head_dim] buffer's view)
    let cases = [
        (1, 1, 1, 2, false),
        (2, 3, 5, 16, true),
        (1, 4, 9, 6, true),
        (2, 2, 7, 32, false),
    ];
    for (case, &(batch, heads, len, head_dim, strided)) in cases.iter().enumerate() {
        let n = batch * heads * len * head_dim;
        let seed = 200 + 10 * case as u64;
        let (x_t, x) = if strided {
            let (t, held) = upload::<B, 4>(
                values(n, seed, 2.0),
                [batch, len, heads, head_dim],
                dtype,
                device,
            );
            // Logical [batch, heads, len, head_dim] values of the view.
            let mut logical = vec![0.0; n];
            for b in 0..batch {
                for s in 0..len {
                    for h in 0..heads {
                        for d in 0..head_dim {
                            let from = ((b * len + s) * heads + h) * head_dim + d;
                            logical[((b * heads + h) * len + s) * head_dim + d] = held[from];
                        }
                    }
                }
            }
            (t.swap_dims(1, 2), logical)
        } else {
            upload::<B, 4>(
                values(n, seed, 2.0),
                [batch, heads, len, head_dim],
                dtype,
                device,
            )
        };
        let table = [1, 1, len, head_dim];
        let (cos_t, cos) =
            upload::<B, 4>(values(len * head_dim, seed + 1, 1.0), table, dtype, device);
        let (sin_t, sin) =
            upload::<B, 4>(values(len * head_dim, seed + 2, 1.0), table, dtype, device);
        let half = head_dim / 2;
        for transpose in [false, true] {
            let expected: Vec<f64> = (0..n)
                .map(|i| {
                    let (j, row) = (i % head_dim, (i / head_dim) % len);
                    let base = i - j;
                    let t = |k: usize| row * head_dim + k;
                    let rotated = match (transpose, j < half) {
                        (false, true) => -x[base + j + half] * sin[t(j)],
                        (false, false) => x[base + j - half] * sin[t(j)],
                        (true, true) => x[base + j + half] * sin[t(j + half)],
                        (true, false) => -x[base + j - half] * sin[t(j - half)],
                    };
                    x[i] * cos[t(j)] + rotated
                })
                .collect();
            let got = B::rotary(
                prim(x_t.clone()),
                prim(cos_t.clone()),
                prim(sin_t.clone()),
                transpose,
            );
            let what = format!("rotary {case} transpose={transpose}");
            assert_near(&what, &read::<B, 4>(got), &expected, tol);
        }
    }
}

/// Widths `(d_in, d_out)` of the linear-product cases: both projections of a 33-head, head-dim-16
/// attention over a 40-wide model (the output projection's input gradient, `[rows, 40]` times
/// the transpose of `[528, 40]`, is where Burn 0.21's matmul of a transposed view went wrong on
/// wgpu), widths of 1, odd widths, every vector width, and head dims 16 to 256 of odd and GQA
/// head counts.
const LINEAR_WIDTHS: [(usize, usize); 10] = [
    (528, 40),
    (40, 528),
    (1, 7),
    (3, 5),
    (40, 48),
    (48, 40),
    (24, 80),
    (256, 33),
    (64, 3 * 256),
    (130, 9),
];

/// Which linear-product cases a test runs.
#[derive(Clone, Copy)]
enum LinearCases {
    /// Every row count from 1 to 64, and 65 and 129, at every width of [`LINEAR_WIDTHS`].
    Exhaustive,
    /// The row counts around each vector width and tile at the first two widths, and three row
    /// counts at the others.
    Standard,
    /// The first half of `Standard`: the row counts around each tile at the first two widths.
    TileRows,
    /// The second half of `Standard`: three row counts at the other widths.
    OtherWidths,
}

/// `(rows, d_in, d_out)` of the linear-product cases `which`.
fn linear_cases(which: LinearCases) -> Vec<(usize, usize, usize)> {
    let all_rows: Vec<usize> = (1..=64).chain([65, 129]).collect();
    let around_tiles = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65];
    let mut cases = Vec::new();
    for (i, &(d_in, d_out)) in LINEAR_WIDTHS.iter().enumerate() {
        let first_two = i < 2;
        let rows: &[usize] = match which {
            LinearCases::Exhaustive => &all_rows,
            LinearCases::Standard | LinearCases::TileRows if first_two => &around_tiles,
            LinearCases::Standard | LinearCases::OtherWidths if !first_two => &[1, 8, 17],
            _ => &[],
        };
        cases.extend(rows.iter().map(|&r| (r, d_in, d_out)));
    }
    cases
}

/// `y = x W` through [`LayerOpsBackend::linear_product`] on `Autodiff<B>` and its
/// gradients for the output gradient `g`, against f64 products of the values the tensors hold.
fn check_linear<B: FlashAttentionBackend>(
    device: &B::Device,
    dtype: DType,
    tol: f64,
    which: LinearCases,
) {
    type Ad<B> = Autodiff<B>;
    for (case, (rows, d_in, d_out)) in linear_cases(which).into_iter().enumerate() {
        let seed = 1000 + 3 * case as u64;
        let (x_t, x) =
            upload::<Ad<B>, 2>(values(rows * d_in, seed, 2.0), [rows, d_in], dtype, device);
        let (w_t, w) = upload::<Ad<B>, 2>(
            values(d_in * d_out, seed + 1, 1.0),
            [d_in, d_out],
            dtype,
            device,
        );
        let (g_t, g) = upload::<Ad<B>, 2>(
            values(rows * d_out, seed + 2, 3.0),
            [rows, d_out],
            dtype,
            device,
        );
        let (x_t, w_t) = (x_t.require_grad(), w_t.require_grad());
        let y = Tensor::<Ad<B>, 2>::from_primitive(TensorPrimitive::Float(
            <Ad<B> as LayerOpsBackend>::linear_product(prim(x_t.clone()), prim(w_t.clone())),
        ));
        let grads = (y.clone() * g_t).sum().backward();
        let product =
            |a: &dyn Fn(usize, usize) -> f64, b: &dyn Fn(usize, usize) -> f64, m, k, n| {
                let mut out = vec![0.0; m * n];
                for i in 0..m {
                    for j in 0..n {
                        out[i * n + j] = (0..k).map(|l| a(i, l) * b(l, j)).sum();
                    }
                }
                out
            };
        let what = |name: &str| format!("linear {name}, {rows} rows, {d_in} -> {d_out}");
        let expected_y = product(
            &|i, l| x[i * d_in + l],
            &|l, j| w[l * d_out + j],
            rows,
            d_in,
            d_out,
        );
        assert_near(&what("y"), &host(y), &expected_y, tol);
        let expected_dx = product(
            &|i, l| g[i * d_out + l],
            &|l, j| w[j * d_out + l],
            rows,
            d_out,
            d_in,
        );
        let dx = host(x_t.grad(&grads).expect("x takes part in the loss"));
        assert_near(&what("dx = dy W^T"), &dx, &expected_dx, tol);
        let expected_dw = product(
            &|i, l| x[l * d_in + i],
            &|l, j| g[l * d_out + j],
            d_in,
            rows,
            d_out,
        );
        let dw = host(w_t.grad(&grads).expect("W takes part in the loss"));
        assert_near(&what("dW = x^T dy"), &dw, &expected_dw, tol);
    }
}

fn check_all<B: FlashAttentionBackend>(device: &B::Device, dtype: DType, tol: f64) {
    check_swiglu::<B>(device, dtype, tol);
    check_rms_norm::<B>(device, dtype, tol);
    check_rotary::<B>(device, dtype, tol);
}

#[test]
fn fused_kernels_on_wgpu_match_f64() {
    check_all::<WgpuF32>(&cubecl::wgpu::WgpuDevice::Cpu, DType::F32, 1e-5);
}

#[test]
fn tensor_operations_on_ndarray_match_f64() {
    check_all::<Cpu>(&Default::default(), DType::F32, 1e-5);
}

#[test]
fn linear_products_and_gradients_on_wgpu_match_f64() {
    let device = cubecl::wgpu::WgpuDevice::Cpu;
    check_linear::<WgpuF32>(&device, DType::F32, 1e-5, LinearCases::Standard);
}

#[test]
fn linear_products_and_gradients_on_fused_wgpu_match_f64() {
    let device = cubecl::wgpu::WgpuDevice::Cpu;
    check_linear::<FusedWgpuF32>(&device, DType::F32, 1e-5, LinearCases::Standard);
}

#[test]
fn linear_products_and_gradients_on_ndarray_match_f64() {
    check_linear::<Cpu>(
        &Default::default(),
        DType::F32,
        1e-5,
        LinearCases::Exhaustive,
    );
}

/// Every row count from 1 to 64 at every width: about ten minutes on Mesa's software Vulkan
/// with a cold autotune cache (each new shape class tunes Burn's matmul), so not in CI.
#[test]
#[ignore = "the exhaustive sweep on wgpu (minutes on a CPU): run with --ignored"]
fn linear_products_and_gradients_on_wgpu_match_f64_at_every_row_count() {
    let device = cubecl::wgpu::WgpuDevice::Cpu;
    check_linear::<WgpuF32>(&device, DType::F32, 1e-5, LinearCases::Exhaustive);
    check_linear::<FusedWgpuF32>(&device, DType::F32, 1e-5, LinearCases::Exhaustive);
}

/// cuBLAS where it takes the operands (CUDA `CubeBackend`), at the row counts around each tile
/// (the exhaustive sweep autotunes Burn's matmul for every shape class and ran past 7 minutes on
/// an H200).
#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn linear_products_and_gradients_on_cuda_f32_match_f64() {
    let device = burn_cuda::CudaDevice::new(0);
    check_linear::<CudaF32>(&device, DType::F32, 1e-5, LinearCases::Standard);
}

/// As above, in bf16.
#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn linear_products_and_gradients_on_cuda_bf16_match_f64() {
    let device = burn_cuda::CudaDevice::new(0);
    check_linear::<CudaBf16>(&device, DType::BF16, 2.0 / 128.0, LinearCases::Standard);
}

/// Burn's matmul under `Fusion` on CUDA (which may take f32 through TF32 tensor cores), at the
/// row counts around each tile. It autotunes every shape class (about five minutes on an H200 for
/// each half of the standard cases), so the cases are split over two tests per dtype that the
/// GPU runner runs in parallel.
#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn linear_products_and_gradients_on_fused_cuda_f32_match_f64_at_tile_rows() {
    let device = burn_cuda::CudaDevice::new(0);
    check_linear::<Fusion<CudaF32>>(&device, DType::F32, 2e-3, LinearCases::TileRows);
}

/// The other half of the fused CUDA f32 cases.
#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn linear_products_and_gradients_on_fused_cuda_f32_match_f64_at_other_widths() {
    let device = burn_cuda::CudaDevice::new(0);
    check_linear::<Fusion<CudaF32>>(&device, DType::F32, 2e-3, LinearCases::OtherWidths);
}

/// The fused CUDA cases in bf16, first half.
#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn linear_products_and_gradients_on_fused_cuda_bf16_match_f64_at_tile_rows() {
    let device = burn_cuda::CudaDevice::new(0);
    check_linear::<Fusion<CudaBf16>>(&device, DType::BF16, 2.0 / 128.0, LinearCases::TileRows);
}

/// The fused CUDA cases in bf16, second half.
#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn linear_products_and_gradients_on_fused_cuda_bf16_match_f64_at_other_widths() {
    let device = burn_cuda::CudaDevice::new(0);
    let which = LinearCases::OtherWidths;
    check_linear::<Fusion<CudaBf16>>(&device, DType::BF16, 2.0 / 128.0, which);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn fused_kernels_on_cuda_match_f64_in_every_dtype() {
    let device = burn_cuda::CudaDevice::new(0);
    check_all::<CudaF32>(&device, DType::F32, 1e-5);
    check_all::<CudaBf16>(&device, DType::BF16, 2.0 / 128.0);
    check_all::<CudaBf16>(&device, DType::F16, 2.0 / 1024.0);
}
