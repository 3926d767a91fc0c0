//! The Hopper matrix product (`hopper::gemm`, `wgmma` and TMA) against an f64 host product of
//! the same bf16 operands: both layouts of B, bf16 and f32 outputs, one tile, several stages per
//! tile, more tiles than multiprocessors (the persistent walk) and a last group of tile rows
//! shorter than the others; and its refusals. The products run on an H100/H200 only; elsewhere
//! the product must refuse the device.

use cubecl::prelude::*;
use distflash_kernels::hopper::{self, GemmLayout};
use distflash_kernels::{DeviceTensor, ElemType, KernelError};
use distflash_test_support::{to_f32, Rng};

/// Largest number of multiply-adds the host spends on one case's reference: beyond it, every
/// `stride`-th output (an odd stride, prime to the tile sizes, so every tile is visited) is checked.
const HOST_BUDGET: usize = 24_000_000;

/// One product on the device against f64 on the host; returns the worst error relative to the
/// element's allowance.
fn check_case<R: Runtime>(
    client: &ComputeClient<R>,
    [m, n, k]: [usize; 3],
    layout: GemmLayout,
    out: ElemType,
    seed: u64,
) -> f64 {
    let mut rng = Rng::new(seed);
    let a = rng.tensor(m * k, 1.0, ElemType::BF16);
    let b = rng.tensor(n * k, 1.0, ElemType::BF16);
    let b_shape = match layout {
        GemmLayout::BTransposed => vec![n, k],
        GemmLayout::BRowMajor => vec![k, n],
    };
    let b_at = |p: usize, j: usize| match layout {
        GemmLayout::BTransposed => b[j * k + p],
        GemmLayout::BRowMajor => b[p * n + j],
    };
    let a_dev = DeviceTensor::from_f32(client, &to_f32(&a), vec![m, k], ElemType::BF16);
    let b_dev = DeviceTensor::from_f32(client, &to_f32(&b), b_shape, ElemType::BF16);
    // Poisoned, so an output the kernel never writes fails.
    let c_dev = DeviceTensor::from_f32(client, &vec![f32::NAN; m * n], vec![m, n], out);
    hopper::gemm(client, &a_dev, &b_dev, &c_dev, layout).expect("the product runs");
    let c = c_dev.to_f32(client);

    let at = format!("{m} x {n} x {k} {layout:?} -> {out:?}");
    assert!(c.iter().all(|x| x.is_finite()), "{at}: unwritten outputs");
    let stride = (m * n * k).div_ceil(HOST_BUDGET) | 1;
    let mut worst = 0.0f64;
    for index in (0..m * n).step_by(stride) {
        let (i, j) = (index / n, index % n);
        let (mut exact, mut magnitude) = (0.0f64, 0.0f64);
        for p in 0..k {
            let term = a[i * k + p] * b_at(p, j);
            exact += term;
            magnitude += term.abs();
        }
        // f32 accumulation over k terms, plus the output's rounding.
        let rounding = match out {
            ElemType::BF16 => exact.abs() * 2f64.powi(-8),
            _ => 0.0,
        };
        let allowed = 1e-4 * magnitude + rounding + 1e-6;
        let error = (c[index] as f64 - exact).abs() / allowed;
        assert!(
            error <= 1.0,
            "{at}: c[{i}, {j}] = {} but the f64 product is {exact} (allowed error {allowed:.2e})",
            c[index]
        );
        worst = worst.max(error);
    }
    worst
}

/// Every layout and output type on shapes that reach each part of the kernel's schedule.
pub fn products_match_the_f64_reference<R: Runtime>(client: &ComputeClient<R>) {
    let shapes = [
        // One tile, one stage.
        [128, 256, 64],
        // Nine stages per tile: the ring of four stages wraps within a tile.
        [256, 512, 576],
        // 144 tiles over at most 132 cubes, three stages each: cubes walk on to a second tile
        // with the ring mid-way.
        [1536, 3072, 192],
        // 18 tile rows: a last group of 2 rows after one of 16.
        [2304, 512, 128],
    ];
    let mut seed = 1;
    for shape in shapes {
        for layout in [GemmLayout::BTransposed, GemmLayout::BRowMajor] {
            for out in [ElemType::BF16, ElemType::F32] {
                seed += 1;
                let worst = check_case(client, shape, layout, out, seed);
                println!("{shape:?} {layout:?} -> {out:?}: worst error {worst:.3} of allowed");
            }
        }
    }
}

/// Shapes off the tile, other element types and mismatched shapes are refused before anything
/// runs, naming what was wrong.
pub fn bad_input_is_refused<R: Runtime>(client: &ComputeClient<R>) {
    let tensor = |shape: [usize; 2], elem| DeviceTensor::empty(client, shape.to_vec(), elem);
    let (bf16, f16) = (ElemType::BF16, ElemType::F16);
    let cases = [
        ([100, 64], bf16, [256, 64], [100, 256], "m = 100"),
        (
            [128, 64],
            f16,
            [256, 64],
            [128, 256],
            "takes bf16 a and b, got F16",
        ),
        (
            [128, 64],
            bf16,
            [64, 256],
            [128, 256],
            "b of a product with a of shape [128, 64]",
        ),
        (
            [128, 64],
            bf16,
            [256, 64],
            [256, 128],
            "expected [128, 256], got [256, 128]",
        ),
    ];
    for (a, a_elem, b, c, what) in cases {
        let (a, b, c) = (tensor(a, a_elem), tensor(b, bf16), tensor(c, bf16));
        let err = hopper::gemm(client, &a, &b, &c, GemmLayout::BTransposed).unwrap_err();
        assert!(err.to_string().contains(what), "{what}: {err}");
    }
}

#[test]
#[ignore = "needs an H100/H200 (CUDA compute capability 9.0): run with --ignored there"]
fn cuda_hopper_gemm_matches_f64_reference_and_refuses_bad_input() {
    let client = cubecl::cuda::CudaRuntime::client(&cubecl::cuda::CudaDevice::new(0));
    assert!(
        hopper::available(&client),
        "not a compute capability 9.0 GPU"
    );
    bad_input_is_refused(&client);
    products_match_the_f64_reference(&client);
}

#[test]
fn hopper_gemm_refuses_a_device_without_wgmma() {
    let client = cubecl::wgpu::WgpuRuntime::client(&cubecl::wgpu::WgpuDevice::Cpu);
    assert!(!hopper::available(&client));
    let tensor = |shape: Vec<usize>| DeviceTensor::empty(&client, shape, ElemType::BF16);
    let err = hopper::gemm(
        &client,
        &tensor(vec![128, 64]),
        &tensor(vec![256, 64]),
        &tensor(vec![128, 256]),
        GemmLayout::BTransposed,
    )
    .unwrap_err();
    assert!(
        matches!(err, KernelError::DeviceLimit { .. }) && err.to_string().contains("9.0"),
        "{err}"
    );
}
