//! Writes the CUDA C++ that cubecl-cuda generates for each tensor-core kernel, with no GPU
//! (`distflash_test_support::cuda_source`: exactly what cubecl-cuda hands to NVRTC at first
//! launch, `exp2` rewritten as the launches rewrite it).
//!
//! `cargo run --release -p distflash-test-support --features cuda-source --example dump_cuda -- OUT_DIR [bf16|f16]`
//! writes `OUT_DIR/{forward,attention,forward_first,forward_last,dq,dkdv,fused,fused_whole}_{mask}_d{64,128}.cu`
//! for every mask shape (`full`, `causal`, `window`, `documents`, `window_documents`;
//! `attention`: the whole-attention forward; `fused`: the dK/dV kernel that also adds dQ with
//! atomics, `fused_whole` its whole-attention form), the portable kernels
//! `portable_{forward,dq,dkdv}_{mask}_d{64,128}.cu` (launched checked, 32-bit indices), and the
//! Hopper kernels, hand-written and handed to NVRTC as they are: the attention forward's
//! `hopper_attention_{mask}_d{64,128}_{bf16,f16}[_persistent].cu` (the default schedule, on a
//! grid of one cube per block or persistent),
//! `hopper_attention_causal_d128_bf16_{plain,overlap,pingpong}[_persistent].cu` (the other
//! schedules) and its steps'
//! `hopper_attention_{first_step,step,last_step}_causal_d{64,128}_bf16.cu`, the attention
//! backward's `hopper_backward[_step][_deterministic[_producer]]_{mask}_d{64,128}_{bf16,f16}.cu`
//! (`_producer`: the ordered dQ adds by a producer warp), its variant with a GQA group's query
//! heads split over cubes `hopper_backward_split_{mask}_d{64,128}_{bf16,f16}.cu`, and its row
//! kernels `hopper_backward_rows_d{64,128}_{bf16,f16}.cu`, and the matrix product's
//! `hopper_gemm_{bt,rm}_{bf16,f32}.cu` (B `[N, K]` or `[K, N]`; C's type). Read them with a
//! CUDA compiler's resource report (registers, spills) and the SASS of their loops.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use distflash_test_support::cuda_source::{hopper_sources, kernels, mask_kinds, portable_kernels};
use half::{bf16, f16};

/// The element type of the kernels written.
#[derive(Clone, Copy, ValueEnum)]
enum Elem {
    /// bfloat16
    Bf16,
    /// IEEE half
    F16,
}

/// The example's command line.
#[derive(Parser)]
#[command(about = "Writes the CUDA C++ CubeCL generates for each kernel, with no GPU")]
struct Args {
    /// The folder the .cu files go to
    #[arg(default_value = "kernels-cuda")]
    out: PathBuf,
    /// The element type of the attention kernels
    #[arg(value_enum, default_value_t = Elem::Bf16)]
    elem: Elem,
}

fn main() {
    let Args { out, elem } = Args::parse();
    std::fs::create_dir_all(&out).expect("the output folder can be created");
    for head_dim in distflash_kernels::tensor_core::HEAD_DIMS {
        for (mask_name, mask) in mask_kinds() {
            let sources: Vec<_> = match elem {
                Elem::Bf16 => kernels::<bf16>(head_dim, mask)
                    .into_iter()
                    .chain(portable_kernels::<bf16>(head_dim, mask))
                    .collect(),
                Elem::F16 => kernels::<f16>(head_dim, mask)
                    .into_iter()
                    .chain(portable_kernels::<f16>(head_dim, mask))
                    .collect(),
            };
            for (name, source) in sources {
                let path = out.join(format!("{name}_{mask_name}_d{head_dim}.cu"));
                std::fs::write(&path, source).expect("the source can be written");
                println!("{}", path.display());
            }
        }
    }
    for (name, source) in hopper_sources() {
        let path = out.join(format!("{name}.cu"));
        std::fs::write(&path, source).expect("the source can be written");
        println!("{}", path.display());
    }
}
