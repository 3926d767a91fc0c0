//! The CUDA source CubeCL generates for the tensor-core kernels, checked without a GPU: every
//! kernel's `exp2` reaches NVRTC as the one-instruction flush-to-zero helper of
//! `tensor_core::fast_exp2`. A CubeCL upgrade that prints `exp2` differently fails here instead
//! of silently bringing back the denormal fix-up around every exponential. The hand-written
//! Hopper kernels get the shared memory they ask for through their CubeCL shell.

use distflash_test_support::cuda_source;
use half::{bf16, f16};

fn check<E: cubecl::prelude::Float>(elem: &str) {
    for head_dim in distflash_kernels::tensor_core::HEAD_DIMS {
        for (mask_name, mask) in cuda_source::mask_kinds() {
            for (name, source) in cuda_source::kernels::<E>(head_dim, mask) {
                let at = format!("{name} ({elem}, head dim {head_dim}, mask {mask_name})");
                assert!(
                    !source.contains("__powf("),
                    "{at}: an exp2 is still printed as __powf"
                );
                assert!(
                    source.contains("distflash_ex2_ftz(") && source.contains("ex2.approx.ftz.f32"),
                    "{at}: no exp2 goes through the flush-to-zero helper"
                );
            }
        }
    }
}

#[test]
fn every_tensor_core_kernel_computes_exp2_with_flush_to_zero_bf16() {
    check::<bf16>("bf16");
}

#[test]
fn every_tensor_core_kernel_computes_exp2_with_flush_to_zero_f16() {
    check::<f16>("f16");
}

#[test]
fn the_hopper_shell_gives_hand_written_kernels_the_shared_memory_they_ask_for() {
    // cubecl-cuda launches a hand-written kernel with the dynamic shared memory of its shell's
    // compiled form (`hopper::source_task`): at least what the source uses.
    let forward = distflash_kernels::hopper::forward_shared_bytes(128);
    let persistent = distflash_kernels::hopper::forward_shared_bytes_for(128, true);
    let backward = distflash_kernels::hopper::backward_shared_bytes(128);
    // The deterministic backward with the producer's ordered dQ adds (its dQ buffers).
    let producer_adds = distflash_kernels::hopper::backward_shared_bytes_for(128, true);
    for bytes in [
        4,
        1000,
        distflash_kernels::hopper::SHARED_BYTES,
        forward,
        persistent,
        backward,
        producer_adds,
    ] {
        let given = cuda_source::hopper_shell_shared_bytes(bytes);
        assert!(
            given >= bytes && given < bytes + 64,
            "asked {bytes}, given {given}"
        );
    }
}

#[test]
fn every_hopper_source_has_no_include_and_its_entry_points() {
    for (name, source) in cuda_source::hopper_sources() {
        assert!(!source.contains("#include"), "{name}");
        // The backward's row kernels: one before the main kernel and one after, for a whole
        // attention and for a step, and the conversion after a split whole attention.
        let entry_points = if name.starts_with("hopper_backward_rows") {
            5
        } else {
            1
        };
        assert_eq!(
            source.matches("extern \"C\" __global__").count(),
            entry_points,
            "{name}"
        );
        let product = if name.starts_with("hopper_gemm") {
            "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16"
        } else {
            "wgmma.mma_async.sync.aligned.m64n128k16.f32."
        };
        assert!(source.contains(product), "{name}");
    }
}
