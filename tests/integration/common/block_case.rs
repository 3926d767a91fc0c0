//! Two stacked transformer blocks trained one step on random data: every gradient collected, on
//! one device or on each rank of a group, for any checkpoint placement.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use burn_distflash::layers::{
    replicate, BlockChain, CheckpointPlacement, ForwardCounter, Offload, TransformerBlock,
    TransformerBlockConfig,
};
use burn_distflash::sequence_parallel::Layout;
use burn_distflash::{
    AttentionContext, AttentionInput, DistFlashAttentionConfig, Documents, FlashAttentionBackend,
};

use super::Rng;

/// A block shape small enough for the CPU: GQA 4 query over 2 key/value heads of width 16.
pub fn small_config() -> TransformerBlockConfig {
    TransformerBlockConfig::new(
        DistFlashAttentionConfig::new(64, 4)
            .with_n_kv_heads(Some(2))
            .with_causal(true),
        96,
    )
}

/// A tensor of uniform noise (the test data).
pub fn random<B: burn::tensor::backend::Backend>(
    rng: &mut Rng,
    dims: [usize; 3],
    device: &B::Device,
) -> Tensor<B, 3> {
    let n = dims.iter().product();
    let values: Vec<f32> = (0..n).map(|_| rng.uniform() as f32).collect();
    Tensor::from_data(TensorData::new(values, dims), device)
}

/// Replaces every weight with uniform noise of amplitude `amp` (norm scales around 1), so no
/// weight is a constant that could hide a wrong gradient.
struct Randomize<'a>(&'a mut Rng);

impl<B: burn::tensor::backend::Backend> ModuleMapper<B> for Randomize<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let dims = tensor.dims();
        let n: usize = dims.iter().product();
        let values: Vec<f32> = if D == 1 {
            (0..n)
                .map(|_| 1.0 + 0.3 * self.0.uniform() as f32)
                .collect()
        } else {
            (0..n).map(|_| 0.15 * self.0.uniform() as f32).collect()
        };
        let fresh = Tensor::from_data(TensorData::new(values, dims), &tensor.device());
        Param::from_mapped_value(id, fresh.require_grad(), mapper)
    }
}

/// Two blocks with random weights (every weight requires gradients).
pub fn random_blocks<B>(
    config: &TransformerBlockConfig,
    seed: u64,
    device: &B::Device,
) -> Vec<TransformerBlock<B>>
where
    B: AutodiffBackend + FlashAttentionBackend,
{
    random_layers(config, seed, device, 2)
}

/// `count` blocks with random weights (every weight requires gradients).
pub fn random_layers<B>(
    config: &TransformerBlockConfig,
    seed: u64,
    device: &B::Device,
    count: usize,
) -> Vec<TransformerBlock<B>>
where
    B: AutodiffBackend + FlashAttentionBackend,
{
    let mut rng = Rng::new(seed);
    (0..count)
        .map(|_| config.init::<B>(device).map(&mut Randomize(&mut rng)))
        .collect()
}

/// One copy of `blocks` per device (see [`replicate`]), checkpointed at `placement`, each copy
/// counting its own attention forwards.
pub fn lift<B>(
    blocks: &[TransformerBlock<B>],
    placement: CheckpointPlacement,
    devices: &[B::Device],
) -> Vec<Vec<TransformerBlock<B>>>
where
    B: AutodiffBackend + FlashAttentionBackend,
{
    replicate(&blocks.to_vec(), devices)
        .into_iter()
        .map(|mut copy| {
            for block in &mut copy {
                block.checkpoint = placement;
                // Clones share a count.
                block.attention.counter = ForwardCounter::default();
            }
            copy
        })
        .collect()
}

/// `copies` (as [`lift`] returns them) with attention running over `groups` groups of heads.
pub fn in_head_groups<B: Backend>(
    mut copies: Vec<Vec<TransformerBlock<B>>>,
    groups: usize,
) -> Vec<Vec<TransformerBlock<B>>> {
    for block in copies.iter_mut().flatten() {
        block.attention_head_groups = groups;
    }
    copies
}

/// [`lift`], each copy's layer `l` of `n` offloading its checkpoint where `policy` says.
pub fn lift_offloading<B>(
    blocks: &[TransformerBlock<B>],
    placement: CheckpointPlacement,
    policy: Offload,
    devices: &[B::Device],
) -> Vec<Vec<TransformerBlock<B>>>
where
    B: AutodiffBackend + FlashAttentionBackend,
{
    let mut copies = lift(blocks, placement, devices);
    for copy in &mut copies {
        for (layer, block) in copy.iter_mut().enumerate() {
            block.offload = policy.offloads(layer, blocks.len());
        }
    }
    copies
}

/// Collects every float parameter's gradient, in module order.
struct Collect<'a, B: AutodiffBackend> {
    grads: &'a B::Gradients,
    out: Vec<Vec<f32>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Collect<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let val = param.val();
        let grad = val.grad(self.grads).unwrap_or_else(|| {
            panic!(
                "weight {} ({:?}, requires grad: {}) got no gradient",
                self.out.len(),
                val.dims(),
                val.is_require_grad()
            )
        });
        self.out
            .push(grad.into_data().convert::<f32>().to_vec().unwrap());
    }
}

/// One training step's results: the output, the input gradient, every weight gradient, and how
/// many times each block's attention forward ran.
pub struct StepResult {
    pub output: Vec<f32>,
    pub input_grad: Vec<f32>,
    pub weight_grads: Vec<Vec<f32>>,
    pub attention_forwards: Vec<usize>,
}

/// Runs `x -> blocks -> y`, `loss = sum(y * r)`, backward.
pub fn step<B: AutodiffBackend + FlashAttentionBackend>(
    blocks: &[TransformerBlock<B>],
    x: Tensor<B::InnerBackend, 3>,
    r: Tensor<B::InnerBackend, 3>,
    context: &AttentionContext<B>,
) -> StepResult {
    step_with_documents(blocks, x, r, context, None)
}

/// [`step`] over packed sequences: every block attends within `documents` when given.
pub fn step_with_documents<B: AutodiffBackend + FlashAttentionBackend>(
    blocks: &[TransformerBlock<B>],
    x: Tensor<B::InnerBackend, 3>,
    r: Tensor<B::InnerBackend, 3>,
    context: &AttentionContext<B>,
    documents: Option<&Documents>,
) -> StepResult {
    step_chained(blocks, 1, x, r, context, documents)
}

/// [`step_with_documents`] with `layers_per_checkpoint` layers per checkpoint
/// ([`BlockChain`]; 1: each block alone).
pub fn step_chained<B: AutodiffBackend + FlashAttentionBackend>(
    blocks: &[TransformerBlock<B>],
    layers_per_checkpoint: usize,
    x: Tensor<B::InnerBackend, 3>,
    r: Tensor<B::InnerBackend, 3>,
    context: &AttentionContext<B>,
    documents: Option<&Documents>,
) -> StepResult {
    for block in blocks {
        block.attention.counter.reset();
    }
    let x = Tensor::<B, 3>::from_inner(x).require_grad();
    let input = AttentionInput {
        x: x.clone(),
        documents: documents.cloned(),
    };
    let y = BlockChain::try_new(blocks, layers_per_checkpoint)
        .and_then(|chain| chain.try_forward(input, context))
        .unwrap_or_else(|e| panic!("{e}"));
    let output = y
        .clone()
        .inner()
        .into_data()
        .convert::<f32>()
        .to_vec()
        .unwrap();
    let grads = (y * Tensor::from_inner(r)).sum().backward();
    let mut collect = Collect::<B> {
        grads: &grads,
        out: Vec::new(),
    };
    for block in blocks {
        block.visit(&mut collect);
    }
    StepResult {
        output,
        input_grad: x
            .grad(&grads)
            .unwrap()
            .into_data()
            .convert::<f32>()
            .to_vec()
            .unwrap(),
        weight_grads: collect.out,
        attention_forwards: blocks.iter().map(|b| b.attention.counter.get()).collect(),
    }
}

/// Largest absolute difference relative to the largest magnitude of `expected`.
pub fn relative_error(got: &[f32], expected: &[f32]) -> f64 {
    assert_eq!(got.len(), expected.len(), "lengths differ");
    let scale = expected
        .iter()
        .fold(1e-6f64, |m, v| m.max((*v as f64).abs()));
    got.iter()
        .zip(expected)
        .map(|(a, b)| ((*a as f64) - (*b as f64)).abs())
        .fold(0.0, f64::max)
        / scale
}

/// Asserts two steps' outputs and gradients agree to `tol` (relative).
pub fn assert_same_step(what: &str, got: &StepResult, expected: &StepResult, tol: f64) {
    let err = relative_error(&got.output, &expected.output);
    assert!(err <= tol, "{what}: output differs by {err:e}");
    let err = relative_error(&got.input_grad, &expected.input_grad);
    assert!(err <= tol, "{what}: input gradient differs by {err:e}");
    assert_eq!(got.weight_grads.len(), expected.weight_grads.len());
    for (i, (g, e)) in got
        .weight_grads
        .iter()
        .zip(&expected.weight_grads)
        .enumerate()
    {
        let err = relative_error(g, e);
        assert!(
            err <= tol,
            "{what}: gradient of weight {i} differs by {err:e}"
        );
    }
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// The output, the input gradient, every weight gradient and the attention forward counts of
/// two steps, bit for bit.
pub fn assert_bitwise(what: &str, got: &StepResult, expected: &StepResult) {
    assert!(
        bits(&got.output) == bits(&expected.output),
        "{what}: output"
    );
    assert!(
        bits(&got.input_grad) == bits(&expected.input_grad),
        "{what}: input gradient"
    );
    assert_eq!(
        got.weight_grads.len(),
        expected.weight_grads.len(),
        "{what}"
    );
    for (i, (g, e)) in got
        .weight_grads
        .iter()
        .zip(&expected.weight_grads)
        .enumerate()
    {
        assert!(bits(g) == bits(e), "{what}: gradient of weight {i}");
    }
    assert_eq!(
        got.attention_forwards, expected.attention_forwards,
        "{what}"
    );
}

/// The ranks' outputs and input gradients put back in sequence order for `layout` (`batch` rows
/// each), their weight gradients summed: what one device computes for the whole sequence.
pub fn combine(ranks: &[StepResult], batch: usize, layout: Layout) -> StepResult {
    let world = ranks.len();
    let cat = |f: fn(&StepResult) -> &Vec<f32>| {
        let n = f(&ranks[0]).len() / batch;
        let piece = n / layout.chunks_per_rank();
        let mut out = Vec::new();
        for b in 0..batch {
            // The sequence's chunks in order, each from the rank holding it.
            for c in 0..layout.num_chunks(world) {
                let (rank, local) = (0..world)
                    .find_map(|r| {
                        let local = layout.chunks(world, r).iter().position(|&x| x == c)?;
                        Some((r, local))
                    })
                    .expect("every chunk has an owner");
                let start = b * n + local * piece;
                out.extend_from_slice(&f(&ranks[rank])[start..start + piece]);
            }
        }
        out
    };
    let weight_grads = (0..ranks[0].weight_grads.len())
        .map(|i| {
            let mut sum = ranks[0].weight_grads[i].clone();
            for rank in &ranks[1..] {
                for (s, g) in sum.iter_mut().zip(&rank.weight_grads[i]) {
                    *s += g;
                }
            }
            sum
        })
        .collect();
    StepResult {
        output: cat(|r| &r.output),
        input_grad: cat(|r| &r.input_grad),
        weight_grads,
        attention_forwards: ranks[0].attention_forwards.clone(),
    }
}
