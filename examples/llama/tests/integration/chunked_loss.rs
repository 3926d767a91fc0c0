//! The output projection and loss over row chunks against the whole-sequence path (the logits
//! made whole, then the cross-entropy): the same loss and the same gradients of the hidden
//! states and of the projection weight, untied (`[d_model, vocab]`) and tied (the embedding table
//! `[vocab, d_model]`), for chunk sizes that divide the rows, that do not, of one row, and larger
//! than all rows; vocabularies that take every vector width; on ndarray (Burn's operations) and
//! wgpu (the fused kernels), and on CUDA in f32 and bf16 with `--ignored`. Then whole models: a
//! tiny Llama's loss and every weight's gradient, tied and untied, and one trainer step whose
//! chunk options change nothing but memory.

use crate::common::exclusive_wgpu;
use crate::common::host_values::host;
use crate::loss::{spread_targets, values};
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_autodiff::Autodiff;
use burn_distflash::layers::{project, CheckpointPlacement, RowChunks};
use burn_distflash::{AttentionContext, FlashAttentionBackend};
use distflash_llama::loss::{CrossEntropyBackend, HeadLayout};
use distflash_llama::train::{TrainOptions, Trainer};
use distflash_llama::{Llama, LlamaConfig};

type Cpu = Autodiff<burn::backend::NdArray<f32>>;
type WgpuF32 = Autodiff<burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>>;
type CudaF32 = Autodiff<burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>>;
type CudaBf16 = Autodiff<burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, half::bf16, i32, u8>>;

/// `(rows, d_model, vocab)`: vocabularies taking vectors of 1, 2, 4 and 8 elements.
const SHAPES: [(usize, usize, usize); 4] = [(13, 16, 257), (5, 8, 30), (40, 24, 1000), (9, 8, 64)];

/// Row counts per chunk: one row, sizes that do and do not divide the rows, all rows, more.
fn chunk_sizes(rows: usize) -> Vec<usize> {
    let mut sizes = vec![1, 2, 3, 7, rows - 1, rows, rows + 50];
    sizes.retain(|&s| s > 0);
    sizes.dedup();
    sizes
}

/// Largest absolute difference relative to the largest magnitude of `expected`.
fn relative(got: &[f64], expected: &[f64]) -> f64 {
    assert_eq!(got.len(), expected.len());
    let scale = expected.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
    let worst = got
        .iter()
        .zip(expected)
        .map(|(g, e)| (g - e).abs())
        .fold(0.0, f64::max);
    worst / scale
}

/// `(loss, dhidden, dweight)` on the host.
type LossGrads = (f64, Vec<f64>, Vec<f64>);

/// The loss and gradients of the whole-sequence path (`chunks` `None`) or the chunked one.
fn loss_and_grads<B: AutodiffBackend + CrossEntropyBackend + FlashAttentionBackend>(
    case: (usize, usize, usize),
    layout: HeadLayout,
    chunks: Option<RowChunks>,
    dtype: DType,
    device: &B::Device,
) -> LossGrads {
    let (rows, d_model, vocab) = case;
    let seed = (rows * 31 + vocab) as u64;
    let tensor = |data: Vec<f64>, shape: [usize; 2]| {
        Tensor::<B, 2>::from_data(TensorData::new(data, shape), device)
            .cast(dtype)
            .require_grad()
    };
    let hidden = tensor(values(rows * d_model, seed, 1.0), [rows, d_model]);
    let weight_shape = match layout {
        HeadLayout::Untied => [d_model, vocab],
        HeadLayout::Tied => [vocab, d_model],
    };
    let weight = tensor(values(d_model * vocab, seed + 1, 0.5), weight_shape);
    let targets = spread_targets(rows, vocab);
    let targets = Tensor::<B, 1, Int>::from_data(TensorData::new(targets, [rows]), device);
    let loss = match chunks {
        Some(chunks) => {
            B::projected_cross_entropy_sum(hidden.clone(), weight.clone(), layout, targets, &chunks)
        }
        None => {
            let projection = match layout {
                HeadLayout::Untied => weight.clone(),
                HeadLayout::Tied => weight.clone().transpose(),
            };
            let logits = project(hidden.clone().unsqueeze::<3>(), projection).squeeze_dim(0);
            B::cross_entropy_sum(logits, targets)
        }
    };
    // A loss gradient other than 1 checks that it reaches every chunk.
    let grads = (loss.clone() * 0.37).backward();
    let grad = |t: &Tensor<B, 2>| host(t.grad(&grads).expect("a gradient"));
    (host(loss)[0], grad(&hidden), grad(&weight))
}

/// Each of `shapes`, both layouts and each chunk size of `sizes` against the whole-sequence path,
/// to `tol` (relative to the largest magnitude).
fn check<B: AutodiffBackend + CrossEntropyBackend + FlashAttentionBackend>(
    device: &B::Device,
    dtype: DType,
    tol: f64,
    shapes: &[(usize, usize, usize)],
    sizes: fn(usize) -> Vec<usize>,
) {
    for &case in shapes {
        for layout in [HeadLayout::Untied, HeadLayout::Tied] {
            let (loss, dhidden, dweight) = loss_and_grads::<B>(case, layout, None, dtype, device);
            for size in sizes(case.0) {
                let chunks = Some(RowChunks::rows(size).unwrap());
                let got = loss_and_grads::<B>(case, layout, chunks, dtype, device);
                let what = format!("{dtype:?} {case:?} {layout:?}, chunks of {size} rows");
                let loss_err = (got.0 - loss).abs() / loss.abs();
                assert!(loss_err <= tol, "{what}: loss {} against {loss}", got.0);
                let err = relative(&got.1, &dhidden);
                assert!(
                    err <= tol,
                    "{what}: hidden states' gradient off by {err:.2e}"
                );
                let err = relative(&got.2, &dweight);
                assert!(err <= tol, "{what}: weight's gradient off by {err:.2e}");
            }
        }
    }
}

/// Fewer cases than [`chunk_sizes`], for wgpu: a size that does not divide the rows, and all
/// rows.
fn few_chunk_sizes(rows: usize) -> Vec<usize> {
    vec![3, rows]
}

#[test]
fn ndarray_chunked_loss_equals_the_whole_sequence_loss() {
    check::<Cpu>(&Default::default(), DType::F32, 1e-5, &SHAPES, chunk_sizes);
}

#[test]
fn wgpu_chunked_loss_equals_the_whole_sequence_loss() {
    let _wgpu = exclusive_wgpu();
    // One shape: each new product shape is autotuned on wgpu, slowly on a CPU (the fused
    // kernels' vector widths are `loss`'s tests).
    let shapes = [(13, 16, 30)];
    let device = cubecl::wgpu::WgpuDevice::Cpu;
    check::<WgpuF32>(&device, DType::F32, 1e-5, &shapes, few_chunk_sizes);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn cuda_chunked_loss_equals_the_whole_sequence_loss_in_f32_and_bf16() {
    let device = cubecl::cuda::CudaDevice::new(0);
    // f32: Burn's CUDA matmul, which takes the products cuBLAS does not (a transposed view, the
    // tied table), may pick TF32 tensor-core kernels (a 10-bit mantissa) for some shapes and not
    // for others, so a chunk of one row and the whole sequence round differently: 4.3e-4 was
    // seen on an H200 (13 rows, d_model 16, vocabulary 257, tied, chunks of one row).
    check::<CudaF32>(&device, DType::F32, 2e-3, &SHAPES, chunk_sizes);
    // bf16: each chunk's weight gradient is rounded to bf16 before the f32 sum.
    check::<CudaBf16>(&device, DType::BF16, 2.0 / 128.0, &SHAPES, chunk_sizes);
}

#[test]
fn a_budget_smaller_than_one_row_still_takes_one_row_at_a_time() {
    let tied = |chunks| {
        let device = Default::default();
        loss_and_grads::<Cpu>((6, 8, 30), HeadLayout::Tied, chunks, DType::F32, &device)
    };
    let whole = tied(None);
    let got = tied(Some(RowChunks::budget(1).unwrap()));
    assert!((got.0 - whole.0).abs() <= 1e-5 * whole.0.abs());
    assert!(relative(&got.2, &whole.2) <= 1e-5);
}

#[test]
fn wgpu_chunked_loss_of_an_out_of_range_target_is_nan_as_unchunked() {
    let _wgpu = exclusive_wgpu();
    // The crate has no ignored labels: every target counts, and the trainer refuses ids outside
    // the vocabulary before any work; the fused kernels make such a row's loss NaN, never a
    // silent number, chunked or not.
    let device = cubecl::wgpu::WgpuDevice::Cpu;
    let hidden = Tensor::<WgpuF32, 2>::from_floats([[1.0, 2.0], [0.5, -1.0], [0.0, 1.0]], &device);
    let weight =
        Tensor::<WgpuF32, 2>::from_floats([[1.0, 0.0, 2.0, 1.0], [0.0, 1.0, 0.0, 3.0]], &device);
    let targets = Tensor::<WgpuF32, 1, Int>::from_ints([1, 4, 2], &device);
    let chunks = RowChunks::rows(2).unwrap();
    let loss =
        WgpuF32::projected_cross_entropy_sum(hidden, weight, HeadLayout::Untied, targets, &chunks);
    let loss = host(loss)[0];
    assert!(
        loss.is_nan(),
        "a target past the vocabulary gives NaN, got {loss}"
    );
}

/// Every float parameter's gradient, in visiting order.
struct Grads<'a, B: AutodiffBackend> {
    grads: &'a B::Gradients,
    out: Vec<Vec<f64>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Grads<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let grad = param
            .val()
            .grad(self.grads)
            .expect("every weight gets a gradient");
        self.out.push(host(grad));
    }
}

/// A tiny Llama's loss and every weight's gradient: through [`Llama::loss`] with `chunks`, or
/// with `None` through the logits of [`Llama::forward`] and the whole-sequence cross-entropy.
fn model_step(tied: bool, chunks: Option<RowChunks>) -> (f64, Vec<Vec<f64>>) {
    let device = Default::default();
    let config = LlamaConfig::new(61, 64, 2, 4, 2, 48)
        .with_tie_embeddings(tied)
        .with_checkpoint(CheckpointPlacement::AttentionOutput);
    let mut model: Llama<Cpu> = config.try_init_seeded(&device, 5).unwrap();
    let (batch, seq) = (2, 11);
    let ids = |offset: usize| {
        let ids: Vec<i64> = (0..batch * seq)
            .map(|i| ((i * 17 + offset) % 61) as i64)
            .collect();
        Tensor::<Cpu, 2, Int>::from_data(TensorData::new(ids, [batch, seq]), &device)
    };
    let (tokens, targets) = (ids(3), ids(4));
    let context = AttentionContext::Local;
    let loss = match chunks {
        Some(chunks) => {
            model.loss_chunks = chunks;
            model.loss(tokens, targets, &context, batch * seq).unwrap()
        }
        None => {
            let logits = model.forward(tokens, &context).unwrap();
            let rows = batch * seq;
            Cpu::cross_entropy_sum(logits.reshape([rows, 61]), targets.reshape([rows]))
                .div_scalar(rows as f64)
        }
    };
    let grads = loss.backward();
    let mut collect = Grads::<Cpu> {
        grads: &grads,
        out: Vec::new(),
    };
    model.visit(&mut collect);
    (host(loss)[0], collect.out)
}

#[test]
fn a_models_chunked_loss_gives_the_same_loss_and_weight_gradients_tied_and_untied() {
    for tied in [true, false] {
        let (loss, grads) = model_step(tied, None);
        for size in [1, 5, 8, 22, 100] {
            let (got_loss, got_grads) = model_step(tied, Some(RowChunks::rows(size).unwrap()));
            let what = format!("tied {tied}, chunks of {size} rows");
            assert!(
                (got_loss - loss).abs() <= 1e-5 * loss.abs(),
                "{what}: loss {got_loss} against {loss}"
            );
            assert_eq!(got_grads.len(), grads.len());
            for (i, (got, expected)) in got_grads.iter().zip(&grads).enumerate() {
                let err = relative(got, expected);
                assert!(
                    err <= 1e-5,
                    "{what}: gradient of weight {i} off by {err:.2e}"
                );
            }
        }
    }
}

#[test]
fn trainer_chunk_options_change_no_step() {
    let device = Default::default();
    let config = LlamaConfig::new(61, 64, 2, 4, 2, 48).with_checkpoint(CheckpointPlacement::Layer);
    let (batch, seq) = (2, 12);
    let inputs: Vec<u32> = (0..batch * seq).map(|i| (i * 13 % 61) as u32).collect();
    let targets: Vec<u32> = (0..batch * seq).map(|i| (i * 7 % 61) as u32).collect();
    let run = |options: TrainOptions| {
        let model: Llama<Cpu> = config.try_init_seeded(&device, 9).unwrap();
        let mut trainer = Trainer::new(model, AttentionContext::Local, options);
        let first = trainer.train_step(&inputs, &targets).unwrap();
        let second = trainer.train_step(&inputs, &targets).unwrap();
        (first, second)
    };
    let options = TrainOptions::new(2, batch, seq);
    let (first, second) = run(options.clone());
    let chunked = options
        .with_loss_chunks(RowChunks::rows(5).unwrap())
        .with_ffn_chunks(RowChunks::rows(7).unwrap());
    let (got_first, got_second) = run(chunked);
    for (got, expected) in [(got_first, first), (got_second, second)] {
        assert!(
            (got.loss - expected.loss).abs() <= 1e-5 * expected.loss,
            "{got:?} {expected:?}"
        );
        let norm = (got.grad_norm - expected.grad_norm).abs() / expected.grad_norm;
        assert!(norm <= 1e-5, "{got:?} {expected:?}");
    }
}
