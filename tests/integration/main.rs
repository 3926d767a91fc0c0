//! The plugin's integration tests, in one executable (each test executable links Burn, wgpu and
//! CubeCL, so one binary builds much faster than one per file): the op against the f64
//! reference, schedules and layouts, the distributed passes, modules, checkpointing, masks, the
//! transports and the layer operations, and the README's module snippet (compiled here). The f16
//! wgpu tests are in `half_precision.rs`.
//!
//! The `#[ignore]`d tests need a CUDA GPU (some, several GPUs with NCCL). Burn 0.21 fixes one
//! default float type per device and process, and the CUDA tests use f32, f16 and bf16 on the same
//! device, so run them one process per test: `.ci/gpu-tests` does. The NCCL and CUDA-checkpoint
//! modules need the `nccl` feature, the CUDA offload module `pinned-offload` (both on by
//! default).

mod common;

mod accumulating_step_memory;
mod attention_module;
mod blocks_repeated;
mod burn_op;
mod checkpoint;
#[cfg(feature = "nccl")]
mod checkpoint_cuda;
mod checkpoint_offload;
#[cfg(feature = "pinned-offload")]
mod checkpoint_offload_cuda;
mod checkpoint_pairs;
mod distributed;
mod distributed_cube;
mod distributed_masks;
#[cfg(feature = "nccl")]
mod distributed_nccl;
#[cfg(feature = "nccl")]
mod distributed_nccl_bf16;
mod distributed_parts;
mod distributed_repeated;
mod feed_forward_chunks;
mod layer_ops;
mod layout;
mod local_transport;
mod masks;
#[cfg(feature = "nccl")]
mod nccl_faults;
#[cfg(feature = "nccl")]
mod nccl_transport;
mod readme_snippets;
mod replicate;
mod schedule;
mod schedule_masks;
mod zigzag_backward_memory;
