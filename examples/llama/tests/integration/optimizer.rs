//! The optimizer's fused passes against f64: the AdamW update and the squared gradient norm, on
//! wgpu (f32; Mesa's software Vulkan in CI) and, with `--ignored` on the GPU machine, on CUDA in
//! f32, f16 and bf16; lengths that take every vector width; and the whole `FusedAdamW` over
//! three steps against Burn's `AdamW` (the first step is Burn's own, the next two fused). The
//! update writes over its parameter and moments when the call holds their only handles, bitwise
//! as into new tensors, and agrees with the portable update (Burn tensor operations) within f32
//! rounding; on CUDA also the sharded optimizer's steps (device and host state, buckets) and
//! their agreement with the replicated `FusedAdamW`.

use crate::common::exclusive_wgpu;
use crate::common::host_values::{host, upload};
use burn::optim::{AdamWConfig, AdamWState, SimpleOptimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use distflash_llama::optimizer::{AdamWStep, FusedAdamW};
use distflash_llama::TrainingKernels;

type WgpuF32 = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>;
type CudaBf16 = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, half::bf16, i32, u8>;
type CudaF32 = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;

/// Lengths that take vectors of 8 (or 4 for f32), 4, 2 and 1, and more than one cube.
const LENGTHS: [usize; 5] = [1, 7, 1030, 4098, 70_000];

/// Deterministic values in `[lo, hi)` (a 64-bit LCG's high bits).
pub(crate) fn values(len: usize, seed: u64, lo: f64, hi: f64) -> Vec<f64> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            lo + (hi - lo) * ((state >> 11) as f64 / (1u64 << 53) as f64)
        })
        .collect()
}

fn primitive<B: Backend>(t: Tensor<B, 1>) -> burn::tensor::ops::FloatTensor<B> {
    t.into_primitive().tensor()
}

fn wrap<B: Backend>(t: burn::tensor::ops::FloatTensor<B>) -> Tensor<B, 1> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// Largest error of `got` against `expected`, relative to `max(|expected|, floor)`.
fn worst(got: &[f64], expected: &[f64], floor: f64) -> f64 {
    assert_eq!(got.len(), expected.len());
    got.iter()
        .zip(expected)
        .map(|(g, e)| (g - e).abs() / e.abs().max(floor))
        .fold(0.0, f64::max)
}

/// Relative tolerance of one stored value of `dtype` (a few units in the last place).
fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 2.0 / 128.0,
        DType::F16 => 2.0 / 1024.0,
        _ => 1e-5,
    }
}

fn check_adamw<B: TrainingKernels>(device: &B::Device, dtype: DType) {
    let step = third_step();
    for (i, &len) in LENGTHS.iter().enumerate() {
        let seed = 10 * i as u64;
        let (p, p0) = upload::<B, 1>(values(len, seed, -1.0, 1.0), [len], dtype, device);
        let (g, g0) = upload::<B, 1>(values(len, seed + 1, -0.1, 0.1), [len], dtype, device);
        let (m, m0) = upload::<B, 1>(values(len, seed + 2, -0.05, 0.05), [len], dtype, device);
        let (v, v0) = upload::<B, 1>(values(len, seed + 3, 1e-6, 1e-2), [len], dtype, device);
        let (p1, m1, v1) = B::fused_adamw(
            primitive(p),
            primitive(g),
            (primitive(m), primitive(v)),
            &step,
        )
        .expect("the CubeCL backends fuse the update");
        let (mut pe, mut me, mut ve) = (vec![0.0; len], vec![0.0; len], vec![0.0; len]);
        let f = |x: f32| x as f64;
        for j in 0..len {
            me[j] = m0[j] * f(step.beta_1) + g0[j] * (1.0 - f(step.beta_1));
            ve[j] = v0[j] * f(step.beta_2) + g0[j] * g0[j] * (1.0 - f(step.beta_2));
            let update = (me[j] / f(step.bias_1)) / ((ve[j] / f(step.bias_2)).sqrt() + 1e-8);
            pe[j] = p0[j] * f(step.decay) - f(step.lr) * update;
        }
        let tol = tolerance(dtype);
        // f16 holds values below 2^-14 as subnormals, with a fixed absolute precision.
        let smallest = if dtype == DType::F16 { 1e-4 } else { 1e-6 };
        for (name, got, expected, floor) in [
            ("param", wrap::<B>(p1), &pe, 1e-3),
            ("moment_1", wrap::<B>(m1), &me, 1e-3),
            ("moment_2", wrap::<B>(v1), &ve, smallest),
        ] {
            let got = host(got);
            let err = worst(&got, expected, floor);
            assert!(
                err <= tol,
                "{dtype:?}, {len} elements: {name} differs from f64 by {err:.2e} (tolerance {tol:.1e})"
            );
        }
    }
}

fn check_squared_norm<B: TrainingKernels>(device: &B::Device, dtype: DType) {
    for (i, &len) in LENGTHS.iter().chain(&[1_000_003]).enumerate() {
        let (t, held) = upload::<B, 1>(values(len, 7 + i as u64, -2.0, 2.0), [len], dtype, device);
        let got = host(B::squared_norm(t.reshape([len, 1])))[0];
        let expected: f64 = held.iter().map(|x| x * x).sum();
        let err = (got - expected).abs() / expected;
        assert!(
            err <= 1e-5,
            "{dtype:?}, {len} elements: squared norm {got} against f64 {expected} ({err:.2e})"
        );
    }
}

/// The step constants of the update checks (step 3, lr 3e-4, weight decay 0.1).
fn third_step() -> AdamWStep {
    AdamWStep {
        beta_1: 0.9,
        beta_2: 0.95,
        bias_1: 1.0 - 0.9f32.powi(3),
        bias_2: 1.0 - 0.95f32.powi(3),
        epsilon: 1e-8,
        decay: 1.0 - 3e-4 * 0.1,
        lr: 3e-4,
    }
}

/// The id of the device buffer `t` is in (the memory handle's, without its location in the
/// pool), read after the device has finished its work.
fn buffer_id<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    t: &Tensor<CubeBackend<R, F, I, BT>, 1>,
) -> String {
    let memory = format!("{:?}", t.clone().into_primitive().tensor().handle.memory);
    memory
        .split("location")
        .next()
        .unwrap_or_default()
        .to_string()
}

/// `TrainingKernels::adamw_update` on a CubeCL backend, for every length of [`LENGTHS`] in
/// `dtype`: with the inputs held elsewhere too it writes three new tensors; with them held by
/// the call alone it writes over the parameter and both moments (the same buffers come back),
/// bitwise the same numbers; and the portable update (Burn tensor operations, on ndarray) agrees
/// within f32 rounding.
fn check_in_place_update<R, F, I, BT>(device: &R::Device, dtype: DType)
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    type Portable = burn::backend::NdArray<f32>;
    let step = third_step();
    for (i, &len) in LENGTHS.iter().enumerate() {
        let seed = 40 + 4 * i as u64;
        let ranges = [(-1.0, 1.0), (-0.1, 0.1), (-0.05, 0.05), (1e-6, 1e-2)];
        let data = ranges.map(|(lo, hi)| values(len, seed, lo, hi));
        let [p, g, m, v] = data
            .clone()
            .map(|d| upload::<CubeBackend<R, F, I, BT>, 1>(d, [len], dtype, device).0);
        let kept = [&p, &m, &v].map(|t| (*t).clone());
        let copied = CubeBackend::<R, F, I, BT>::adamw_update(
            p.clone(),
            g.clone(),
            (m.clone(), v.clone()),
            &step,
        );
        let ids = [&p, &m, &v].map(buffer_id);
        assert!(
            (0..3).all(|k| buffer_id(&copied[k]) != ids[k]),
            "{dtype:?}, {len} elements: the update wrote over inputs held elsewhere"
        );
        drop(kept);
        let in_place = CubeBackend::<R, F, I, BT>::adamw_update(p, g, (m, v), &step);
        let _ = CubeBackend::<R, F, I, BT>::sync(device);
        for (k, name) in ["param", "moment_1", "moment_2"].into_iter().enumerate() {
            let what = format!("{dtype:?}, {len} elements, {name}");
            assert_eq!(
                buffer_id(&in_place[k]),
                ids[k],
                "{what}: not written in place"
            );
            let bits = |t: &Tensor<CubeBackend<R, F, I, BT>, 1>| t.clone().into_data().bytes;
            assert!(
                bits(&in_place[k]) == bits(&copied[k]),
                "{what}: in place differs from out of place"
            );
        }
        // The portable passes on the same values (f32 on the host).
        let [p, g, m, v] = data.map(|d| {
            let cast = host(upload::<CubeBackend<R, F, I, BT>, 1>(d, [len], dtype, device).0);
            Tensor::<Portable, 1>::from_data(TensorData::new(cast, [len]), &Default::default())
                .cast(DType::F32)
        });
        let portable = Portable::adamw_update(p, g, (m, v), &step);
        for (k, (name, floor)) in [("param", 1e-3), ("moment_1", 1e-3), ("moment_2", 1e-6)]
            .into_iter()
            .enumerate()
        {
            let err = worst(
                &host(in_place[k].clone()),
                &host(portable[k].clone()),
                floor,
            );
            let tol = tolerance(dtype);
            assert!(
                err <= tol,
                "{dtype:?}, {len} elements, {name}: fused differs from portable by {err:.2e}"
            );
        }
    }
}

/// Three steps of `FusedAdamW` against Burn's `AdamW` with the same settings, on 2-D tensors.
fn check_against_burn<B: TrainingKernels>(device: &B::Device) {
    let fused = FusedAdamW::new(0.9, 0.95, 1e-8, 0.1);
    let burn = AdamWConfig::new()
        .with_beta_1(0.9)
        .with_beta_2(0.95)
        .with_epsilon(1e-8)
        .with_weight_decay(0.1)
        .build();
    let shape = [33, 65];
    let start = Tensor::<B, 1>::from_data(
        TensorData::new(values(33 * 65, 99, -1.0, 1.0), [33 * 65]),
        device,
    )
    .cast(DType::F32)
    .reshape(shape);
    let (mut a, mut b) = (start.clone(), start);
    let (mut state_a, mut state_b): (Option<AdamWState<B, 2>>, Option<AdamWState<B, 2>>) =
        (None, None);
    for step in 0..3u64 {
        let grad = Tensor::<B, 1>::from_data(
            TensorData::new(values(33 * 65, step, -0.5, 0.5), [33 * 65]),
            device,
        )
        .cast(DType::F32)
        .reshape(shape);
        let lr = 1e-2 / (1 + step) as f64;
        (a, state_a) = fused.step(lr, a, grad.clone(), state_a);
        (b, state_b) = burn.step(lr, b, grad, state_b);
        let err = worst(&host(a.clone()), &host(b.clone()), 1e-3);
        assert!(
            err <= 1e-5,
            "step {step}: FusedAdamW differs from AdamW by {err:.2e}"
        );
    }
    let (sa, sb) = (state_a.unwrap().momentum, state_b.unwrap().momentum);
    assert_eq!(sa.time, sb.time, "both count three steps");
    let err = worst(&host(sa.moment_2), &host(sb.moment_2), 1e-6);
    assert!(err <= 1e-5, "second moments differ by {err:.2e}");
}

#[test]
fn wgpu_fused_adamw_matches_f64() {
    let _wgpu = exclusive_wgpu();
    check_adamw::<WgpuF32>(&cubecl::wgpu::WgpuDevice::Cpu, DType::F32);
}

#[test]
fn wgpu_squared_norm_matches_f64() {
    let _wgpu = exclusive_wgpu();
    check_squared_norm::<WgpuF32>(&cubecl::wgpu::WgpuDevice::Cpu, DType::F32);
}

#[test]
fn wgpu_fused_adamw_steps_like_burn_adamw() {
    let _wgpu = exclusive_wgpu();
    check_against_burn::<WgpuF32>(&cubecl::wgpu::WgpuDevice::Cpu);
}

#[test]
fn wgpu_adamw_update_writes_in_place_bitwise_like_out_of_place() {
    let _wgpu = exclusive_wgpu();
    check_in_place_update::<cubecl::wgpu::WgpuRuntime, f32, i32, u32>(
        &cubecl::wgpu::WgpuDevice::Cpu,
        DType::F32,
    );
}

#[test]
fn ndarray_runs_burn_adamw_and_the_portable_norm() {
    type Cpu = burn::backend::NdArray<f32>;
    let device = Default::default();
    let t = Tensor::<Cpu, 1>::from_floats([1.0, 2.0, 3.0], &device);
    let moments = (primitive(t.clone()), primitive(t.clone()));
    let step = AdamWStep {
        beta_1: 0.9,
        beta_2: 0.95,
        bias_1: 0.1,
        bias_2: 0.05,
        epsilon: 1e-8,
        decay: 1.0,
        lr: 1e-3,
    };
    assert!(Cpu::fused_adamw(primitive(t.clone()), primitive(t.clone()), moments, &step).is_none());
    assert_eq!(host(Cpu::squared_norm(t)), vec![14.0]);
    check_against_burn::<Cpu>(&device);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn cuda_fused_adamw_matches_f64_in_every_dtype() {
    let device = cubecl::cuda::CudaDevice::new(0);
    check_adamw::<CudaF32>(&device, DType::F32);
    check_adamw::<CudaBf16>(&device, DType::BF16);
    check_adamw::<CudaBf16>(&device, DType::F16);
    check_squared_norm::<CudaF32>(&device, DType::F32);
    check_squared_norm::<CudaBf16>(&device, DType::BF16);
    check_squared_norm::<CudaBf16>(&device, DType::F16);
    check_against_burn::<CudaF32>(&device);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn cuda_sharded_fused_step_in_place_bitwise_and_like_replicated() {
    use crate::host_optimizer_state::{check_sharded_like_replicated, check_sharded_steps};
    type Train = burn::backend::Autodiff<CudaF32>;
    let device = cubecl::cuda::CudaDevice::new(0);
    check_in_place_update::<cubecl::cuda::CudaRuntime, f32, i32, u8>(&device, DType::F32);
    check_in_place_update::<cubecl::cuda::CudaRuntime, half::bf16, i32, u8>(&device, DType::BF16);
    check_sharded_steps::<Train>(&device);
    check_sharded_like_replicated::<Train>(&device);
}
