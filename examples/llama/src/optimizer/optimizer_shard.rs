//! [`OptimizerShard`]: one rank's share of a sharded optimizer's f32 state on the device as whole
//! vectors, the form in which it is handed out and restored (the optimizer itself keeps it in
//! chunks).

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;

use super::flat::FlatLayout;

/// One rank's share of a [`ShardedAdamW`](super::ShardedAdamW)'s state, in f32: elements
/// `rank * n .. (rank + 1) * n` of the model's [`FlatLayout`] (`n` its
/// [`shard_len`](FlatLayout::shard_len)).
#[derive(Clone)]
pub struct OptimizerShard<B: AutodiffBackend> {
    /// The layout of the model's parameters over the group.
    pub layout: FlatLayout,
    /// The f32 master weights, `[n]` (zeros where the share covers the padding).
    pub master: Tensor<B::InnerBackend, 1>,
    /// AdamW's first moment, `[n]`.
    pub moment_1: Tensor<B::InnerBackend, 1>,
    /// AdamW's second moment, `[n]`.
    pub moment_2: Tensor<B::InnerBackend, 1>,
    /// Optimizer steps taken.
    pub time: i32,
}
