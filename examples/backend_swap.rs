//! The same model code on different Burn backends: a causal self-attention block (q/k/v/output
//! projections, GQA with 4 query heads over 2 key/value heads) trained for a few steps with this
//! project's attention op. Only the backend type changes.
//!
//! `cargo run --release --example backend_swap -- [ndarray|wgpu|wgpu-fusion|cuda]` (default
//! `ndarray`; `-- --help` lists them). `wgpu` runs on Mesa's software Vulkan where there is no GPU; `cuda` needs an
//! NVIDIA GPU.

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, Tensor};
use burn_distflash::layers::project;
use burn_distflash::{flash_attention, FlashAttentionBackend, FlashAttentionOptions};
use clap::{Parser, ValueEnum};

const MODEL: usize = 256;
const HEAD_DIM: usize = 64;
const Q_HEADS: usize = 4;
const KV_HEADS: usize = 2;

/// Weights of one attention block.
struct AttentionBlock<B: AutodiffBackend> {
    wq: Tensor<B, 2>,
    wk: Tensor<B, 2>,
    wv: Tensor<B, 2>,
    wo: Tensor<B, 2>,
}

impl<B: AutodiffBackend + FlashAttentionBackend> AttentionBlock<B> {
    fn new(device: &B::Device) -> Self {
        let init = |rows, cols| {
            Tensor::<B, 2>::random([rows, cols], Distribution::Normal(0.0, 0.05), device)
                .require_grad()
        };
        Self {
            wq: init(MODEL, Q_HEADS * HEAD_DIM),
            wk: init(MODEL, KV_HEADS * HEAD_DIM),
            wv: init(MODEL, KV_HEADS * HEAD_DIM),
            wo: init(Q_HEADS * HEAD_DIM, MODEL),
        }
    }

    /// `x` is `[batch, seq, MODEL]`.
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [batch, seq, _] = x.dims();
        // `project` rather than Burn's autodiff matmul: its gradient products never hand Burn's
        // matmul a transposed view (wrong on wgpu in Burn 0.21 for some shapes).
        let heads = |w: &Tensor<B, 2>, n: usize| {
            project(x.clone(), w.clone())
                .reshape([batch, seq, n, HEAD_DIM])
                .swap_dims(1, 2)
        };
        let (q, k, v) = (
            heads(&self.wq, Q_HEADS),
            heads(&self.wk, KV_HEADS),
            heads(&self.wv, KV_HEADS),
        );
        let out = flash_attention(q, k, v, FlashAttentionOptions::causal()).expect("valid shapes");
        project(
            out.swap_dims(1, 2)
                .reshape([batch, seq, Q_HEADS * HEAD_DIM]),
            self.wo.clone(),
        )
    }

    /// One SGD step on `loss = mean((block(x) - x)^2)`; returns the loss.
    fn step(self, x: Tensor<B, 3>, lr: f64) -> (Self, f32) {
        let loss = (self.forward(x.clone()) - x).powi_scalar(2).mean();
        let value = loss.clone().into_scalar().elem::<f32>();
        let grads = loss.backward();
        let update = |w: Tensor<B, 2>| {
            let g = w.grad(&grads).expect("gradient");
            Tensor::from_inner(w.inner() - g.mul_scalar(lr)).require_grad()
        };
        let next = Self {
            wq: update(self.wq),
            wk: update(self.wk),
            wv: update(self.wv),
            wo: update(self.wo),
        };
        (next, value)
    }
}

fn train<B: AutodiffBackend + FlashAttentionBackend>(name: &str, device: B::Device) {
    let x = Tensor::<B, 3>::random([2, 128, MODEL], Distribution::Normal(0.0, 1.0), &device);
    let mut block = AttentionBlock::<B>::new(&device);
    let start = std::time::Instant::now();
    for step in 0..5 {
        let (next, loss) = block.step(x.clone(), 0.5);
        block = next;
        println!("{name}: step {step} loss {loss:.5}");
    }
    println!("{name}: 5 steps in {:.2?}", start.elapsed());
}

use burn::tensor::ElementConversion;

/// The backends the block can train on.
#[derive(Clone, Copy, ValueEnum)]
enum BackendName {
    /// The CPU (Burn's ndarray)
    Ndarray,
    /// wgpu (Mesa's software Vulkan where there is no GPU)
    Wgpu,
    /// wgpu under Burn's fusion
    WgpuFusion,
    /// CUDA (an NVIDIA GPU)
    Cuda,
}

/// The example's command line.
#[derive(Parser)]
#[command(about = "The same attention block trained on the backend named")]
struct Args {
    /// The backend
    #[arg(value_enum, default_value_t = BackendName::Ndarray)]
    backend: BackendName,
}

fn main() {
    type Wgpu = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>;
    match Args::parse().backend {
        BackendName::Ndarray => train::<burn::backend::Autodiff<burn::backend::NdArray<f32>>>(
            "ndarray",
            Default::default(),
        ),
        BackendName::Wgpu => {
            train::<burn::backend::Autodiff<Wgpu>>("wgpu", cubecl::wgpu::WgpuDevice::Cpu)
        }
        BackendName::WgpuFusion => train::<burn::backend::Autodiff<burn_fusion::Fusion<Wgpu>>>(
            "wgpu-fusion",
            cubecl::wgpu::WgpuDevice::Cpu,
        ),
        BackendName::Cuda => {
            train::<burn::backend::Autodiff<burn_cuda::Cuda<f32, i32>>>("cuda", Default::default())
        }
    }
}
