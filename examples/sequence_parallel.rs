//! One long sequence split across a group of devices: each rank holds a contiguous shard of q, k
//! and v, runs `sequence_parallel_attention`, and backpropagates through it. Rank 0 prints how
//! far the gathered output is from one-device attention over the whole sequence.
//!
//! ```text
//! cargo run --release --example sequence_parallel                 # 4 ranks as threads, ndarray CPU
//! cargo run --release --example sequence_parallel -- --nccl 4     # 4 GPUs of this machine, NCCL
//! cargo run --release --example sequence_parallel -- --help       # the options
//! # one process per GPU, one or many hosts (torchrun-style environment):
//! RANK=.. WORLD_SIZE=.. LOCAL_RANK=.. MASTER_ADDR=.. MASTER_PORT=.. \
//!     cargo run --release --example sequence_parallel -- --env
//! ```

use burn::backend::{Autodiff, NdArray};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Distribution, ElementConversion, Tensor, TensorData};
use burn_distflash::collective::on_each_rank;
use burn_distflash::sequence_parallel::{
    sequence_parallel_attention, shard_sequence, SequenceParallelOptions,
};
use burn_distflash::{flash_attention, DeviceGroup, FlashAttentionBackend, FlashAttentionOptions};
use clap::{value_parser, Parser};

type Cuda = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;

const SHARD: usize = 256;
const HEADS: usize = 8;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 64;

/// The whole sequence's q, k, v, generated from one seed on the host, so every rank (thread or
/// process) holds the same data and can check its shard.
fn full_inputs(world: usize) -> [TensorData; 3] {
    let device = Default::default();
    NdArray::<f32>::seed(&device, 7);
    let seq = world * SHARD;
    let make = |heads| {
        Tensor::<NdArray<f32>, 4>::random([1, heads, seq, HEAD_DIM], Distribution::Default, &device)
            .into_data()
    };
    [make(HEADS), make(KV_HEADS), make(KV_HEADS)]
}

/// One rank's training step on its shard; returns the max difference of its output rows from
/// one-device attention over the whole sequence.
fn rank_step<B>(group: DeviceGroup<B::Inner>, device: B::Device, inputs: [TensorData; 3]) -> f32
where
    B: FlashAttentionBackend + AutodiffBackend,
{
    let (rank, world) = (group.rank(), group.world_size());
    let [q, k, v] = inputs.map(|data| Tensor::<B, 4>::from_data(data, &device));
    let options = SequenceParallelOptions::causal();
    // The schedule decides which positions this rank holds (zigzag at even world sizes).
    let layout = options.layout(world, SHARD);
    let rows = layout
        .ranges(world, rank, SHARD)
        .unwrap_or_else(|e| panic!("{e}"));
    let cut = |t: Tensor<B, 4>| {
        shard_sequence(t, 2, layout, world, rank).unwrap_or_else(|e| panic!("{e}"))
    };
    let shard = |t: &Tensor<B, 4>| cut(t.clone()).require_grad();
    let (qs, ks, vs) = (shard(&q), shard(&k), shard(&v));
    let out = sequence_parallel_attention(qs.clone(), ks.clone(), vs.clone(), &group, &options)
        .unwrap_or_else(|e| panic!("{e}"));
    let grads = out.clone().sum().backward();
    let (dq, dk) = (qs.grad(&grads).unwrap(), ks.grad(&grads).unwrap());
    let reference = flash_attention(q, k, v, FlashAttentionOptions::causal()).unwrap();
    let expected = cut(reference);
    let scalar = |t: Tensor<B::InnerBackend, 1>| t.into_scalar().elem::<f32>();
    let error = scalar((out.inner() - expected.inner()).abs().max());
    println!(
        "rank {rank}/{world} ({layout:?}): output rows {rows:?}, max |O - O_ref| = {error:.2e}, |dq| = {:.3}, |dk| = {:.3}",
        scalar(dq.abs().mean()),
        scalar(dk.abs().mean())
    );
    error
}

fn run_threads<B>(groups: Vec<DeviceGroup<B::Inner>>, devices: Vec<B::Device>)
where
    B: FlashAttentionBackend + AutodiffBackend,
{
    let inputs = full_inputs(groups.len());
    let per_rank = groups.into_iter().zip(devices).collect();
    let worst = on_each_rank(per_rank, |_, (group, device)| {
        rank_step::<B>(group, device, inputs.clone())
    })
    .into_iter()
    .fold(0.0f32, f32::max);
    println!("worst max error over ranks: {worst:.2e}");
}

/// The example's command line: threads on the CPU by default.
#[derive(Parser)]
#[command(about = "One sequence split across ranks, checked against one-device attention")]
struct Args {
    /// The ranks are this many GPUs of this machine, over NCCL (default with no number: 2)
    #[arg(long, value_name = "GPUS", num_args = 0..=1, default_missing_value = "2",
          value_parser = value_parser!(u64).range(1..))]
    nccl: Option<u64>,
    /// This process is one rank of a group of processes, one GPU each, described torchrun-style
    /// by RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT
    #[arg(long, conflicts_with = "nccl")]
    env: bool,
}

fn main() {
    let args = Args::parse();
    if let Some(world) = args.nccl {
        let devices: Vec<_> = (0..world as usize)
            .map(cubecl::cuda::CudaDevice::new)
            .collect();
        let groups = DeviceGroup::<Cuda>::nccl(&devices).unwrap_or_else(|e| panic!("{e}"));
        run_threads::<Autodiff<Cuda>>(groups, devices);
    } else if args.env {
        let group = DeviceGroup::<Cuda>::nccl_from_env().unwrap_or_else(|e| panic!("{e}"));
        let device = group.device().clone();
        let inputs = full_inputs(group.world_size());
        rank_step::<Autodiff<Cuda>>(group, device, inputs);
    } else {
        let world = 4;
        let devices = vec![Default::default(); world];
        let groups = DeviceGroup::<NdArray>::in_process(devices.clone());
        run_threads::<Autodiff<NdArray>>(groups, devices);
    }
}
