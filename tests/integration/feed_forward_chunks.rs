//! The transformer block's feed-forward half over row chunks (`ffn_chunks`) against the whole
//! sequence at once: the same output and the same gradients (input and every weight) through two
//! blocks, at every checkpoint placement (a checkpoint's forward, recomputation and hand-written
//! backward run the chunks; without a checkpoint the graph runs the whole sequence), for chunk
//! sizes of one row, sizes that do and do not divide the `batch * seq` rows, and larger than all
//! rows; on ndarray and wgpu. Inference (no autodiff) runs the chunks too.

use crate::common::block_case::{assert_same_step, lift, random_blocks, small_config, step};
use crate::common::Rng;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use burn_distflash::layers::{CheckpointPlacement, RowChunks, TransformerBlockConfig};
use burn_distflash::{AttentionContext, FlashAttentionBackend};

type WgpuF32 = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>;

const PLACEMENTS: [CheckpointPlacement; 3] = [
    CheckpointPlacement::None,
    CheckpointPlacement::Layer,
    CheckpointPlacement::AttentionOutput,
];

/// f32: chunks only reorder the weight gradients' sums.
const TOLERANCE: f64 = 1e-5;

fn random<B: Backend>(rng: &mut Rng, dims: [usize; 3], device: &B::Device) -> Tensor<B, 3> {
    let n = dims.iter().product();
    let values: Vec<f32> = (0..n).map(|_| rng.uniform() as f32).collect();
    Tensor::from_data(TensorData::new(values, dims), device)
}

/// Two blocks' step at every placement with each of `sizes` rows per feed-forward chunk, against
/// the same blocks unchunked.
fn check<B: AutodiffBackend + FlashAttentionBackend>(device: &B::Device, sizes: &[usize]) {
    let mut rng = Rng::new(21);
    // 2 x 21 = 42 rows.
    let dims = [2, 21, 64];
    let (x, r) = (
        random::<B::InnerBackend>(&mut rng, dims, device),
        random::<B::InnerBackend>(&mut rng, dims, device),
    );
    let blocks = random_blocks::<B>(&small_config(), 3, device);
    let devices = [device.clone()];
    for placement in PLACEMENTS {
        let whole = lift(&blocks, placement, &devices).remove(0);
        let expected = step(&whole, x.clone(), r.clone(), &AttentionContext::Local);
        for &size in sizes {
            let mut chunked = lift(&blocks, placement, &devices).remove(0);
            for block in &mut chunked {
                block.ffn_chunks = RowChunks::rows(size).unwrap();
            }
            let got = step(&chunked, x.clone(), r.clone(), &AttentionContext::Local);
            let what = format!("{placement:?}, feed-forward chunks of {size} rows");
            assert_same_step(&what, &got, &expected, TOLERANCE);
        }
    }
}

#[test]
fn ndarray_feed_forward_chunks_give_the_whole_sequences_gradients() {
    type Cpu = burn::backend::Autodiff<burn::backend::NdArray<f32>>;
    check::<Cpu>(&Default::default(), &[1, 5, 7, 16, 41, 42, 100]);
}

#[test]
fn wgpu_feed_forward_chunks_give_the_whole_sequences_gradients() {
    type Wgpu = burn::backend::Autodiff<WgpuF32>;
    check::<Wgpu>(&cubecl::wgpu::WgpuDevice::Cpu, &[5, 16, 42]);
}

#[test]
fn feed_forward_chunks_come_from_the_block_config_and_default_to_a_memory_budget() {
    type Cpu = burn::backend::NdArray<f32>;
    let config = small_config();
    assert_eq!(
        config.ffn_chunks,
        TransformerBlockConfig::DEFAULT_FFN_CHUNKS
    );
    assert!(matches!(config.ffn_chunks, RowChunks::Budget(_)));
    let chunks = RowChunks::rows(3).unwrap();
    let block = config
        .with_ffn_chunks(chunks)
        .init::<Cpu>(&Default::default());
    assert_eq!(block.ffn_chunks, chunks);
}

#[test]
fn inference_over_feed_forward_chunks_gives_the_whole_sequences_output() {
    type Cpu = burn::backend::NdArray<f32>;
    let device = Default::default();
    let mut rng = Rng::new(5);
    let x = random::<Cpu>(&mut rng, [2, 21, 64], &device);
    let mut block = small_config().init::<Cpu>(&device);
    let whole = block.forward(x.clone(), &AttentionContext::Local);
    for size in [1, 5, 16] {
        block.ffn_chunks = RowChunks::rows(size).unwrap();
        let chunked = block.forward(x.clone(), &AttentionContext::Local);
        let (got, expected) = (
            chunked.into_data().to_vec::<f32>().unwrap(),
            whole.to_data().to_vec::<f32>().unwrap(),
        );
        let worst = got
            .iter()
            .zip(&expected)
            .map(|(g, e)| (g - e).abs())
            .fold(0.0f32, f32::max);
        assert!(
            worst <= 1e-5,
            "chunks of {size} rows: output off by {worst:e}"
        );
    }
}
