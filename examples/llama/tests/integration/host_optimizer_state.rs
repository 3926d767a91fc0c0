//! The sharded optimizer's state in host memory, streamed through the device in chunks
//! (`--optimizer-state host`): on ndarray (ordinary host memory) 3 steps give bitwise the losses,
//! gradient norms, weights and shard files of the same steps with the state on the device, on 1,
//! 2 and 3 ranks, at both ZeRO stages, with clipping active and inactive and chunks that do not
//! divide the shards; a run resumes with its state moved from the device to the host and back,
//! bitwise as the uninterrupted run; the optimizer alone on two linear layers, on ndarray and wgpu,
//! streams its state bitwise like the device-resident one. The gradients summed in buckets that
//! divide no share give bitwise the steps and shard files of one bucket per share, on 1, 2 and 3
//! ranks, at both stages, with the state on the device and in host memory, clipping active; the
//! optimizer alone sums in buckets bitwise on ndarray and wgpu. On CUDA (pinned memory, a copy
//! stream) the same for a bf16 model on one GPU.

use crate::common::exclusive_wgpu;
use std::path::Path;
use std::time::Duration;

use crate::checkpoints::{padded, seeded};
use crate::common::modules::{float_params, ParamValues};
use crate::common::temp_dir::TempDir;
use crate::common::within::within;
use crate::optimizer::values;
use crate::train::{dataset, on_ranks, zero_options};
use burn::module::Param;
use burn::nn::{Initializer, Linear, LinearConfig};
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_distflash::AttentionContext;
use distflash_llama::data::TokenDataset;
use distflash_llama::optimizer::{
    bucket_elements, AdamWSettings, FusedAdamW, ShardFile, ShardHeader, ShardTensor, ShardedAdamW,
    StatePlacement, ZeroStage,
};
use distflash_llama::train::{TrainBackend, TrainOptions, Trainer};
use distflash_llama::Llama;

const STEPS: u64 = 3;

/// 2048 elements of state and a few bytes: chunks that divide none of the shards (90496
/// elements on one rank, 45248 on two, 30166 on three).
const CHUNK_BYTES: u64 = 12 * 2048 + 5;

/// One rank's run: the bits of each step's loss and gradient norm, the final weights, and the
/// header and the three vectors' bits of the rank's shard file of a checkpoint saved after the
/// steps (the file's bytes are not compared: its metadata's order differs from write to write).
type Run = (Vec<[u64; 2]>, Vec<ParamValues>, ShardContent);

/// A shard file's header and its vectors' bits.
type ShardContent = (ShardHeader, Vec<Vec<u32>>);

/// The header and vectors of the shard file at `path`.
fn shard_content(path: &Path) -> ShardContent {
    let file = ShardFile::open(path).unwrap();
    let n = file.header().shard_len();
    let bits = |t| {
        file.values(t, 0..n)
            .iter()
            .map(|v: &f32| v.to_bits())
            .collect()
    };
    (*file.header(), ShardTensor::ALL.map(bits).to_vec())
}

/// `steps` steps of `trainer`, then a checkpoint in `dir`: the rank's [`Run`].
fn run<B: TrainBackend>(
    trainer: &mut Trainer<B>,
    data: &TokenDataset,
    steps: u64,
    dir: &Path,
) -> Run {
    let mut stats = Vec::new();
    for _ in 0..steps {
        let o = &trainer.options;
        let (x, y) = (data.batch(trainer.step, o.seed, o.batch, o.seq_len)).unwrap();
        let s = trainer.train_step(&x, &y).unwrap();
        stats.push([s.loss.to_bits(), s.grad_norm.to_bits()]);
    }
    trainer.save(dir).unwrap();
    let (rank, world) = trainer.rank();
    let shard = shard_content(&dir.join(format!("optimizer-rank{rank}-of-{world}.safetensors")));
    (stats, float_params(&trainer.model), shard)
}

/// `options` with the state at `placement` in chunks of [`CHUNK_BYTES`].
fn placed(options: TrainOptions, placement: StatePlacement) -> TrainOptions {
    options
        .with_optimizer_state(placement)
        .with_state_chunk_bytes(CHUNK_BYTES)
}

/// Every rank's [`Run`] of `world` ranks at `zero` with clipping at `clip` and the state at
/// `placement`, checkpointed under `dir`.
fn runs(
    world: usize,
    zero: ZeroStage,
    clip: f64,
    placement: StatePlacement,
    dir: &Path,
) -> Vec<Run> {
    let options = placed(zero_options(STEPS, zero).with_grad_clip(clip), placement);
    runs_of(world, options, dir)
}

/// Every rank's [`Run`] of `world` ranks trained with `options`, checkpointed under `dir`.
fn runs_of(world: usize, options: TrainOptions, dir: &Path) -> Vec<Run> {
    let data = dataset();
    on_ranks(seeded(&padded(), 7, world), |context, model| {
        let mut trainer = Trainer::new(model, context, options.clone());
        run(&mut trainer, &data, STEPS, dir)
    })
}

/// Asserts that two placements' runs are bitwise the same (but for the file paths).
fn assert_same_runs(gpu: &[Run], host: &[Run], what: &str) {
    assert_eq!(gpu.len(), host.len());
    for (rank, (g, h)) in gpu.iter().zip(host).enumerate() {
        assert_eq!(
            g.0, h.0,
            "{what}, rank {rank}: losses or gradient norms differ"
        );
        assert!(g.1 == h.1, "{what}, rank {rank}: the weights differ");
        assert!(g.2 == h.2, "{what}, rank {rank}: the shard files differ");
    }
}

#[test]
fn host_state_steps_bitwise_like_device_state_with_the_same_shard_files() {
    within(Duration::from_secs(900), || {
        let cases = [
            (1, ZeroStage::OptimizerStates, 0.05),
            (1, ZeroStage::Gradients, 0.0),
            (2, ZeroStage::Gradients, 0.05),
            (3, ZeroStage::OptimizerStates, 0.05),
            (3, ZeroStage::Gradients, 0.0),
        ];
        for (world, zero, clip) in cases {
            let what = format!("{world} rank(s), stage {zero}, clip {clip}");
            let tmp = TempDir::new("host-state");
            let [gpu, host] = [StatePlacement::Gpu, StatePlacement::Host].map(|placement| {
                runs(
                    world,
                    zero,
                    clip,
                    placement,
                    &tmp.path().join(placement.to_string()),
                )
            });
            assert_same_runs(&gpu, &host, &what);
            let norms: Vec<f64> = gpu[0].0.iter().map(|s| f64::from_bits(s[1])).collect();
            if clip > 0.0 {
                assert!(
                    norms.iter().any(|&n| n > clip),
                    "{what}: clipping never acted: {norms:?}"
                );
            }
        }
    });
}

/// Buckets of 4 x 3 x 2048 bytes and a few: 6144 elements of each share on one rank, 3072 on
/// two, 2048 on three, dividing none of the shares (90496, 45248, 30166).
const BUCKET_BYTES: u64 = 4 * 3 * 2048 + 5;

#[test]
fn gradient_sums_in_buckets_step_bitwise_like_one_bucket_a_share() {
    within(Duration::from_secs(900), || {
        let cases = [
            (1, ZeroStage::OptimizerStates, StatePlacement::Gpu),
            (2, ZeroStage::Gradients, StatePlacement::Gpu),
            (2, ZeroStage::OptimizerStates, StatePlacement::Host),
            (3, ZeroStage::OptimizerStates, StatePlacement::Gpu),
            (3, ZeroStage::Gradients, StatePlacement::Host),
        ];
        for (world, zero, placement) in cases {
            let share = 90496usize.div_ceil(world);
            let k = bucket_elements(BUCKET_BYTES, world);
            assert!(k < share && share % k != 0, "{k} of {share}");
            let what = format!("{world} rank(s), stage {zero}, state on the {placement}");
            let tmp = TempDir::new("grad-buckets");
            let [whole, buckets] = [1 << 30, BUCKET_BYTES].map(|bytes| {
                let options = placed(zero_options(STEPS, zero).with_grad_clip(0.05), placement)
                    .with_grad_bucket_bytes(bytes);
                runs_of(world, options, &tmp.path().join(bytes.to_string()))
            });
            assert_same_runs(&whole, &buckets, &what);
            let norms: Vec<f64> = whole[0].0.iter().map(|s| f64::from_bits(s[1])).collect();
            assert!(
                norms.iter().any(|&n| n > 0.05),
                "{what}: clipping never acted: {norms:?}"
            );
        }
    });
}

#[test]
fn a_run_resumes_with_its_state_moved_between_the_device_and_the_host() {
    within(Duration::from_secs(600), || {
        let data = dataset();
        let (world, zero) = (2, ZeroStage::Gradients);
        let tmp = TempDir::new("host-state-resume");
        let straight = runs(
            world,
            zero,
            0.05,
            StatePlacement::Gpu,
            &tmp.path().join("straight"),
        );
        for (from, to) in [
            (StatePlacement::Gpu, StatePlacement::Host),
            (StatePlacement::Host, StatePlacement::Gpu),
        ] {
            let what = format!("saved with the state on the {from}, resumed on the {to}");
            let dir = tmp.path().join(format!("{from}-{to}"));
            let options = placed(zero_options(STEPS, zero).with_grad_clip(0.05), from);
            on_ranks(seeded(&padded(), 7, world), |context, model| {
                let mut trainer = Trainer::new(model, context, options.clone());
                run(&mut trainer, &data, STEPS - 1, &dir);
            });
            let resumed = on_ranks(seeded(&padded(), 99, world), |context, model| {
                let trainer = Trainer::new(model, context, zero_options(1, ZeroStage::Replicated));
                let placement = Some((to, CHUNK_BYTES));
                let mut trainer = trainer.resume_with_state_at(&dir, placement).unwrap();
                assert_eq!(trainer.options.optimizer_state, to, "{what}");
                run(&mut trainer, &data, 1, &dir)
            });
            for (rank, (want, got)) in straight.iter().zip(&resumed).enumerate() {
                assert_eq!(
                    want.0[2], got.0[0],
                    "{what}, rank {rank}: the last step differs"
                );
                assert!(want.1 == got.1, "{what}, rank {rank}: the weights differ");
                assert!(
                    want.2 == got.2,
                    "{what}, rank {rank}: the shard files differ"
                );
            }
        }
    });
}

/// Two linear layers of 5,000 parameters: five chunks of 1024 elements, the last one short.
type Layers<B> = (burn::nn::Linear<B>, burn::nn::Linear<B>);

/// The AdamW settings of the optimizer-alone checks.
const SETTINGS: AdamWSettings = AdamWSettings {
    beta_1: 0.9,
    beta_2: 0.95,
    epsilon: 1e-8,
    weight_decay: 0.1,
};

/// A linear layer `d_in -> d_out` with weights and bias from [`values`] seeded with `seed`
/// (not the backend's random generator, which tests running at the same time share).
fn linear<B: Backend>(d_in: usize, d_out: usize, seed: u64, device: &B::Device) -> Linear<B> {
    let mut layer = LinearConfig::new(d_in, d_out)
        .with_initializer(Initializer::Zeros)
        .init(device);
    let data = |len, seed| TensorData::new(values(len, seed, -0.125, 0.125), [len]);
    let weight = Tensor::<B, 1>::from_data(data(d_in * d_out, seed), device);
    layer.weight = Param::from_tensor(weight.reshape([d_in, d_out]));
    let bias = Tensor::<B, 1>::from_data(data(d_out, seed + 1), device);
    layer.bias = Some(Param::from_tensor(bias));
    layer
}

/// `sum(W ⊙ C) + sum(b ⊙ c)` for `layer`'s weight `W` and bias `b`, with coefficients `C` and `c`
/// from [`values`] seeded with `seed`: a loss linear in the parameters, whose gradients are the
/// coefficients exactly, whatever the parameters' values.
fn linear_in_parameters<B: Backend>(
    layer: &Linear<B>,
    seed: u64,
    device: &B::Device,
) -> Tensor<B, 1> {
    let weight = layer.weight.val();
    let [d_in, d_out] = weight.dims();
    let coefficients = |len, seed| TensorData::new(values(len, seed, -2.0, 2.0), [len]);
    let c_weight = Tensor::<B, 1>::from_data(coefficients(d_in * d_out, seed), device);
    let c_bias = Tensor::<B, 1>::from_data(coefficients(d_out, seed + 1), device);
    let bias = layer.bias.as_ref().expect("the layers have biases").val();
    (weight * c_weight.reshape([d_in, d_out])).sum() + (bias * c_bias).sum()
}

/// The layers and the bits of each step's gradient norm after `steps` steps of `optimize`
/// (model and gradients in, the updated model and the norm out) from layers of fixed values, on
/// a loss linear in the parameters with other coefficients at each step
/// ([`linear_in_parameters`]): every optimizer takes bitwise the same gradients at every step,
/// whatever its weights, so two optimizers' weights differ by their own arithmetic alone. (Were
/// the gradients a product of the weights, the last bits in which two optimizers' first steps
/// differ would come back through the backend's matrix products, which on CUDA may run on TF32
/// tensor cores: errors of 1e-3 of a gradient, which AdamW's division by the gradient's own
/// scale turns into 1e-3 of a step, the kernels chosen by autotuning from run to run.)
fn layer_steps<B: TrainBackend>(
    device: &B::Device,
    steps: usize,
    mut optimize: impl FnMut(Layers<B>, GradientsParams) -> (Layers<B>, f64),
) -> (Layers<B>, Vec<u64>) {
    let mut model: Layers<B> = (linear(64, 48, 5, device), linear(48, 40, 7, device));
    let mut norms = Vec::new();
    for step in 0..steps as u64 {
        let loss = linear_in_parameters(&model.0, 100 + 4 * step, device)
            + linear_in_parameters(&model.1, 102 + 4 * step, device);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let (next, norm) = optimize(model, grads);
        (model, norms) = (next, [norms, vec![norm.to_bits()]].concat());
    }
    (model, norms)
}

/// The master weights and the weights' bits after `steps` steps of [`ShardedAdamW`] (stage 1, one
/// device, clipping at `clip`) in [`layer_steps`], the state at `placement`, the gradients laid
/// end to end in buckets of `bucket_bytes`.
fn sharded_steps<B: TrainBackend>(
    device: &B::Device,
    (placement, bucket_bytes, clip): (StatePlacement, u64, f64),
    steps: usize,
) -> (Vec<u32>, Vec<ParamValues>, Vec<u64>) {
    let optim = ShardedAdamW::<B>::new(ZeroStage::OptimizerStates, SETTINGS, None).unwrap();
    let optim = optim.with_state_placement(placement, 12 * 1024);
    let mut optim = optim.with_grad_bucket_bytes(bucket_bytes);
    let (model, norms) = layer_steps::<B>(device, steps, |model, grads| {
        optim.step(1e-2, clip, model, grads).unwrap()
    });
    let master = optim
        .master_weights()
        .unwrap()
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    let master = master.iter().map(|v| v.to_bits()).collect();
    (master, float_params(&model), norms)
}

/// [`ShardedAdamW`] on one device (no clipping, the state on the device and in host memory)
/// and the replicated [`FusedAdamW`] with the same settings take [`layer_steps`] to the same
/// f32 weights within 1e-5 of each weight (at least 1e-3): 3 steps at learning rate 1e-2, the
/// same gradients, Burn's AdamW first, then the fused update, so the two differ in the last bits
/// of the first step's weights, which the next steps carry without growth. A wrong update is off
/// by a good part of a step (1e-2), or by the weight decay (1e-3 of a weight).
pub(crate) fn check_sharded_like_replicated<B: TrainBackend>(device: &B::Device) {
    let s = SETTINGS;
    let fused = FusedAdamW::new(s.beta_1, s.beta_2, s.epsilon, s.weight_decay);
    let mut replicated = fused.into_optimizer::<B, Layers<B>>();
    let (model, _) = layer_steps::<B>(device, 3, |model, grads| {
        (replicated.step(1e-2, model, grads), 0.0)
    });
    let want = float_params(&model);
    for placement in [StatePlacement::Gpu, StatePlacement::Host] {
        let (_, got, _) = sharded_steps::<B>(device, (placement, 1 << 30, 0.0), 3);
        for ((shape, got), (_, want)) in got.iter().zip(&want) {
            let relative = |(g, w): (&f32, &f32)| (g - w).abs() / w.abs().max(1e-3);
            let (at, worst) = (got.iter().zip(want).map(relative).enumerate())
                .fold((0, 0.0f32), |a, b| if b.1 > a.1 { b } else { a });
            assert!(
                worst <= 1e-5,
                "state on the {placement}, {shape:?}: sharded differs from replicated by \
                 {worst:.2e} (element {at}: {} against {})",
                got[at],
                want[at]
            );
        }
    }
}

/// [`sharded_steps`] with the state on the device and in host memory, and on the device with
/// buckets of 1024 elements (5080 parameters: the last bucket short), give the same bits.
pub(crate) fn check_sharded_steps<B: TrainBackend>(device: &B::Device) {
    let [gpu, host] = [StatePlacement::Gpu, StatePlacement::Host]
        .map(|placement| sharded_steps::<B>(device, (placement, 1 << 30, 0.5), 3));
    let buckets = sharded_steps::<B>(device, (StatePlacement::Gpu, 4 * 1024, 0.5), 3);
    assert_eq!(gpu.2, buckets.2, "gradient norms, in buckets");
    assert!(gpu.1 == buckets.1, "weights, in buckets");
    assert!(gpu.0 == buckets.0, "master weights, in buckets");
    assert!(
        gpu.2.iter().any(|&n| f64::from_bits(n) > 0.5),
        "clipping acts"
    );
    assert_eq!(gpu.2, host.2, "gradient norms");
    assert!(gpu.1 == host.1, "weights");
    assert!(gpu.0 == host.0, "master weights");
}

#[test]
fn the_sharded_optimizer_streams_its_state_and_sums_in_buckets_bitwise_on_ndarray_and_wgpu() {
    let _wgpu = exclusive_wgpu();
    within(Duration::from_secs(300), || {
        check_sharded_steps::<crate::train::Cpu>(&crate::train::DEVICE);
        type Wgpu = burn::backend::Autodiff<
            burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>,
        >;
        check_sharded_steps::<Wgpu>(&cubecl::wgpu::WgpuDevice::Cpu);
    });
}

#[test]
fn the_sharded_optimizer_steps_like_the_replicated_one_on_ndarray_and_wgpu() {
    let _wgpu = exclusive_wgpu();
    within(Duration::from_secs(300), || {
        check_sharded_like_replicated::<crate::train::Cpu>(&crate::train::DEVICE);
        type Wgpu = burn::backend::Autodiff<
            burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>,
        >;
        check_sharded_like_replicated::<Wgpu>(&cubecl::wgpu::WgpuDevice::Cpu);
    });
}

/// [`runs`] on one CUDA GPU for a bf16 model of the small shape, stage 1, clipping at 0.05, the
/// state at `placement`, buckets of `bucket_bytes`.
fn cuda_runs(placement: StatePlacement, bucket_bytes: u64, dir: &Path) -> Vec<Run> {
    type Cuda = burn::backend::Autodiff<
        burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, half::bf16, i32, u8>,
    >;
    let device = cubecl::cuda::CudaDevice::new(0);
    let model: Llama<Cuda> = padded().try_init_seeded::<Cuda>(&device, 7).unwrap();
    let options = zero_options(STEPS, ZeroStage::OptimizerStates).with_grad_clip(0.05);
    let options = placed(options, placement).with_grad_bucket_bytes(bucket_bytes);
    let mut trainer = Trainer::new(model, AttentionContext::Local, options);
    let run = run(&mut trainer, &dataset(), STEPS, dir);
    <Cuda as Backend>::sync(&device).unwrap();
    vec![run]
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_host_state_steps_bitwise_like_device_state() {
    let tmp = TempDir::new("cuda-host-state");
    let [gpu, host] = [StatePlacement::Gpu, StatePlacement::Host]
        .map(|placement| cuda_runs(placement, 1 << 30, &tmp.path().join(placement.to_string())));
    assert_same_runs(
        &gpu,
        &host,
        "CUDA, bf16 weights, one GPU, stage 1, clip 0.05",
    );
    println!("CUDA: 3 steps bitwise the same, norms {:?}", gpu[0].0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_gradient_buckets_step_bitwise_like_one_bucket() {
    let tmp = TempDir::new("cuda-grad-buckets");
    let [whole, buckets] = [1 << 30, BUCKET_BYTES].map(|bytes| {
        cuda_runs(
            StatePlacement::Gpu,
            bytes,
            &tmp.path().join(bytes.to_string()),
        )
    });
    let what = "CUDA, bf16 gradients cast bucket by bucket, one GPU, stage 1, clip 0.05";
    assert_same_runs(&whole, &buckets, what);
}
