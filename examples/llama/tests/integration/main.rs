//! The Llama example's integration tests, in one executable (each test executable links Burn,
//! wgpu and CubeCL): the command line, generation, the loss and the optimizer's kernels against
//! f64, packing and windows, the tokenizer, training on one device and on in-process groups,
//! with checkpoints offloaded to host memory too and with two layers per checkpoint, the sharded
//! optimizer's checkpoints, and the Hugging Face weights. The `#[ignore]`d tests need a CUDA
//! GPU; run them one process per test (`.ci/gpu-tests`), as Burn 0.21 fixes one default float
//! type per device and process.

mod common;

mod checkpoints;
mod chunked_loss;
mod command_line;
mod device_faults;
mod generate;
mod host_optimizer_state;
mod layers_per_checkpoint;
mod loss;
mod memory_plan;
mod offload;
mod one_process_per_gpu;
mod optimizer;
mod packing;
mod tokenizer;
mod train;
mod weights;
