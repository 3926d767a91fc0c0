//! The CUDA C++ that cubecl-cuda generates for each attention kernel (tensor-core and portable),
//! with no GPU: the kernels are expanded into a `KernelBuilder` configured like an H200 (sm_90)
//! and compiled by CubeCL's CUDA compiler, the tensor-core ones with `exp2` rewritten as their
//! launches rewrite it (`tensor_core::fast_exp2`): exactly what cubecl-cuda hands to NVRTC at
//! first launch; and the Hopper kernels' hand-written variants (the attention forward and the
//! matrix product), handed to NVRTC as they are. The kernels' tests check them; the `dump_cuda`
//! example writes them to files.

use cubecl::ir::features::{Plane, Tma, TypeUsage};
use cubecl::ir::{
    BarrierLevel, DeviceProperties, ElemType as IrElem, FloatKind, HardwareProperties,
    MemoryDeviceProperties, OpaqueType, SemanticType, VectorSize,
};
use cubecl::prelude::*;
use cubecl_common::profile::TimingMethod;
use cubecl_cpp::cuda::arch::CudaArchitecture;
use cubecl_cpp::cuda::mma::CudaWmmaCompiler;
use cubecl_cpp::shared::{register_mma_features, CompilationOptions, CppSupportedFeatures};
use cubecl_cpp::DialectWmmaCompiler;
use cubecl_cuda::CudaCompiler;
use cubecl_runtime::compiler::Compiler;
use distflash_kernels::hopper::source_task::shell;
use distflash_kernels::hopper::{
    self, BackwardVariant, ForwardEnds, ForwardSchedule, ForwardVariant, GemmLayout,
};
use distflash_kernels::portable;
use distflash_kernels::tensor_core::{backward, dkdv, fast_exp2, forward, KERNEL_ADDRESS};
use distflash_kernels::{AttentionParams, ElemType, MaskKind};
use half::{bf16, f16};

/// What an H200 reports to cubecl-cuda 0.10, as far as code generation depends on it.
fn h200_properties() -> DeviceProperties {
    let arch = CudaArchitecture { version: 90 };
    let hardware = HardwareProperties {
        load_width: 128,
        plane_size_min: 32,
        plane_size_max: 32,
        max_bindings: 1024,
        max_shared_memory_size: 232_448,
        max_cube_count: (i32::MAX as u32, 65_535, 65_535),
        max_units_per_cube: 1024,
        max_cube_dim: (1024, 1024, 64),
        num_streaming_multiprocessors: Some(132),
        num_cpu_cores: None,
        num_tensor_cores: Some(4),
        min_tensor_cores_dim: Some(8),
        max_vector_size: VectorSize::MAX,
    };
    let memory = MemoryDeviceProperties {
        max_page_size: 1 << 36,
        alignment: 512,
    };
    let mut p = DeviceProperties::new(Default::default(), memory, hardware, TimingMethod::System);
    cubecl_cpp::register_supported_types(&mut p);
    p.register_semantic_type(SemanticType::Pipeline);
    p.register_semantic_type(SemanticType::TensorMap);
    p.register_type_usage(OpaqueType::Barrier(BarrierLevel::Unit), TypeUsage::Buffer);
    p.register_type_usage(OpaqueType::Barrier(BarrierLevel::Cube), TypeUsage::Buffer);
    p.features.plane.insert(Plane::Sync);
    p.features.plane.insert(Plane::Ops);
    p.features.plane.insert(Plane::NonUniformControlFlow);
    for kind in [FloatKind::F16, FloatKind::BF16] {
        p.features
            .matmul
            .ldmatrix
            .insert(IrElem::Float(kind).into());
        p.features
            .matmul
            .stmatrix
            .insert(IrElem::Float(kind).into());
    }
    p.features.copy_async = true;
    p.features.tma.insert(Tma::Base);
    p.features.cube_cluster = true;
    p.features.memory_reinterpret = true;
    p.features.alignment = true;
    register_mma_features(CudaWmmaCompiler::supported_mma_combinations(&arch), &mut p);
    p
}

/// One kernel as CubeCL's CUDA compiler represents it for `mode`, indexed with `address` (the
/// width its `#[cube]` attribute declares).
fn compile_representation(
    name: &str,
    units: u32,
    address: AddressType,
    mode: ExecutionMode,
    expand: impl FnOnce(&mut KernelBuilder),
) -> <CudaCompiler as Compiler>::Representation {
    let properties = h200_properties();
    let mut builder = KernelBuilder::default();
    builder.runtime_properties(<cubecl_cuda::CudaRuntime as Runtime>::target_properties());
    builder.device_properties(&properties);
    builder
        .scope
        .register_type::<bf16>(bf16::as_type_native_unchecked().storage_type());
    builder
        .scope
        .register_type::<f16>(f16::as_type_native_unchecked().storage_type());
    address.register(&mut builder.scope);
    expand(&mut builder);
    let settings = KernelSettings::default()
        .cube_dim(CubeDim::new_1d(units))
        .kernel_name(name);
    let definition = builder.build(settings);
    let options = CompilationOptions {
        warp_size: 32,
        supports_features: CppSupportedFeatures {
            grid_constants: true,
            clusters: true,
            fast_math: true,
            fast_tanh: true,
            elect_sync: true,
        },
    };
    CudaCompiler::default()
        .compile(definition, &options, mode, address.unsigned_type())
        .expect("the kernel compiles")
}

/// The CUDA source of one kernel as CubeCL prints it for `mode` (a plain `launch` is checked).
fn compile_in(
    name: &str,
    units: u32,
    address: AddressType,
    mode: ExecutionMode,
    expand: impl FnOnce(&mut KernelBuilder),
) -> String {
    compile_representation(name, units, address, mode, expand).to_string()
}

/// The CUDA source of one tensor-core kernel as its launches hand it to NVRTC (unchecked, with
/// `exp2` rewritten, see `tensor_core::fast_exp2`).
fn compile(
    name: &str,
    units: u32,
    address: AddressType,
    expand: impl FnOnce(&mut KernelBuilder),
) -> String {
    let source = compile_in(name, units, address, ExecutionMode::Unchecked, expand);
    fast_exp2::with_fast_exp2(&source).0
}

/// Dynamic shared memory, in bytes, that cubecl-cuda gives a hand-written Hopper kernel asking
/// for `bytes`: what the compiled form of `hopper::source_task::shell` declares.
pub fn hopper_shell_shared_bytes(bytes: usize) -> usize {
    let units = distflash_kernels::hopper::UNITS as u32;
    compile_representation(
        "shell",
        units,
        AddressType::U32,
        ExecutionMode::Unchecked,
        |b| {
            let out = output::<u32>(b);
            shell::expand(&mut b.scope, out, bytes.div_ceil(4));
        },
    )
    .shared_memory_size()
}

/// The CUDA sources of the Hopper kernels' variants, by name: the attention forward's (each head
/// dim, type and mask with the default schedule and on the persistent grid, the other schedules
/// for bf16, head dim 128, causal, and the steps for bf16, each head dim and mask), the attention backward's (each head
/// dim, type and mask: whole, step, deterministic, and with a GQA group's heads split over cubes;
/// and its row kernels per head dim and type), then the matrix product's.
pub fn hopper_sources() -> Vec<(String, String)> {
    let mut sources = Vec::new();
    // The slices' order is not part of the source.
    let plain = ForwardSchedule {
        intra_overlap: false,
        pingpong: false,
        ..ForwardSchedule::default()
    };
    let persistent = ForwardSchedule {
        persistent: true,
        ..ForwardSchedule::default()
    };
    let overlap = ForwardSchedule {
        intra_overlap: true,
        ..plain
    };
    let pingpong = ForwardSchedule {
        pingpong: true,
        ..plain
    };
    let on_persistent = |schedule| ForwardSchedule {
        persistent: true,
        ..schedule
    };
    let schedules = [
        ("", ForwardSchedule::default()),
        ("_persistent", persistent),
        ("_plain", plain),
        ("_overlap", overlap),
        ("_pingpong", pingpong),
        ("_plain_persistent", on_persistent(plain)),
        ("_overlap_persistent", on_persistent(overlap)),
        ("_pingpong_persistent", on_persistent(pingpong)),
    ];
    for (schedule_name, schedule) in schedules {
        for head_dim in hopper::HEAD_DIMS {
            for (elem_name, elem) in [("bf16", ElemType::BF16), ("f16", ElemType::F16)] {
                for (mask_name, mask) in mask_kinds() {
                    let every = schedule == ForwardSchedule::default() || schedule == persistent;
                    let causal = mask_name == "causal";
                    if !every && (head_dim, elem, causal) != (128, ElemType::BF16, true) {
                        continue;
                    }
                    let name = format!(
                        "hopper_attention_{mask_name}_d{head_dim}_{elem_name}{schedule_name}"
                    );
                    let variant = ForwardVariant {
                        head_dim,
                        elem,
                        mask,
                        schedule,
                        ends: ForwardEnds::Whole,
                    };
                    sources.push((name, hopper::forward_source(&variant)));
                }
            }
        }
    }
    // The steps of the stat-carrying contract, in the default schedule.
    for head_dim in hopper::HEAD_DIMS {
        for (ends_name, ends) in [
            ("first_step", ForwardEnds::FirstStep),
            ("step", ForwardEnds::Step),
            ("last_step", ForwardEnds::LastStep),
        ] {
            for (mask_name, mask) in mask_kinds() {
                let variant = ForwardVariant {
                    head_dim,
                    elem: ElemType::BF16,
                    mask,
                    schedule: ForwardSchedule::default(),
                    ends,
                };
                let name = format!("hopper_attention_{ends_name}_{mask_name}_d{head_dim}_bf16");
                sources.push((name, hopper::forward_source(&variant)));
            }
        }
    }
    for head_dim in hopper::HEAD_DIMS {
        for (elem_name, elem) in [("bf16", ElemType::BF16), ("f16", ElemType::F16)] {
            // A whole attention's unmasked backward, which the variants below change.
            let plain = BackwardVariant {
                head_dim,
                elem,
                mask: MaskKind::default(),
                accumulate: false,
                deterministic: false,
                split: false,
                producer_adds: false,
            };
            for (mask_name, mask) in mask_kinds() {
                for (step_name, accumulate) in [("", false), ("_step", true)] {
                    for (order_name, deterministic, producer_adds) in [
                        ("", false, false),
                        ("_deterministic", true, false),
                        ("_deterministic_producer", true, true),
                    ] {
                        let variant = BackwardVariant {
                            mask,
                            accumulate,
                            deterministic,
                            producer_adds,
                            ..plain
                        };
                        let name = format!(
                            "hopper_backward{step_name}{order_name}_{mask_name}_d{head_dim}_{elem_name}"
                        );
                        sources.push((name, hopper::backward_source(&variant)));
                    }
                }
                // A GQA group's heads split over cubes, dK and dV added with atomics (one
                // source for a whole attention and a step; the number of parts is a scalar).
                let split = BackwardVariant {
                    mask,
                    split: true,
                    ..plain
                };
                let name = format!("hopper_backward_split_{mask_name}_d{head_dim}_{elem_name}");
                sources.push((name, hopper::backward_source(&split)));
            }
            let name = format!("hopper_backward_rows_d{head_dim}_{elem_name}");
            sources.push((name, hopper::backward_rows_source(&plain)));
        }
    }
    for (layout_name, layout) in [
        ("bt", GemmLayout::BTransposed),
        ("rm", GemmLayout::BRowMajor),
    ] {
        for (out_name, out) in [("bf16", ElemType::BF16), ("f32", ElemType::F32)] {
            let name = format!("hopper_gemm_{layout_name}_{out_name}");
            sources.push((name, hopper::gemm_source(layout, out)));
        }
    }
    sources
}

fn input<E: CubePrimitive>(b: &mut KernelBuilder) -> <Array<E> as CubeType>::ExpandType {
    <Array<E> as LaunchArg>::expand(&ArrayCompilationArg { inplace: None }, b)
}

fn output<E: CubePrimitive>(b: &mut KernelBuilder) -> <Array<E> as CubeType>::ExpandType {
    <Array<E> as LaunchArg>::expand_output(&ArrayCompilationArg { inplace: None }, b)
}

fn scalar<E: LaunchArg<CompilationArg = ()>>(b: &mut KernelBuilder) -> <E as CubeType>::ExpandType {
    <E as LaunchArg>::expand(&(), b)
}

fn attention_params(
    b: &mut KernelBuilder,
    head_dim: usize,
    mask: MaskKind,
) -> <AttentionParams as CubeType>::ExpandType {
    <AttentionParams as LaunchArg>::expand(&AttentionParams::compilation_arg(head_dim, mask), b)
}

/// CUDA sources of the kernels for element type `E`: the forward step, the whole-attention
/// forward, the first and last forward steps, dQ, dK/dV (deterministic) and the fused dK/dV kernel that also adds dQ, as a step
/// and for a whole attention.
pub fn kernels<E: Float>(head_dim: usize, mask: MaskKind) -> [(&'static str, String); 8] {
    let units = forward::UNITS as u32;
    let forward = |reads_state: bool, finishes: bool| {
        compile("forward_step_mma", units, KERNEL_ADDRESS, |b| {
            let (q, k, v) = (input::<E>(b), input::<E>(b), input::<E>(b));
            let (o, m, l) = (output::<f32>(b), output::<f32>(b), output::<f32>(b));
            let (out, lse) = (output::<E>(b), output::<f32>(b));
            let docs = input::<u32>(b);
            let params = attention_params(b, head_dim, mask);
            forward::forward_step_mma::expand::<E>(
                &mut b.scope,
                q,
                k,
                v,
                o,
                m,
                l,
                out,
                lse,
                docs,
                params,
                reads_state,
                finishes,
            );
        })
    };
    let dq = compile("backward_dq_mma", units, KERNEL_ADDRESS, |b| {
        let (q, k, v, grad_out) = (input::<E>(b), input::<E>(b), input::<E>(b), input::<E>(b));
        let (lse, delta) = (input::<f32>(b), input::<f32>(b));
        let dq = output::<f32>(b);
        let docs = input::<u32>(b);
        let params = attention_params(b, head_dim, mask);
        backward::backward_dq_mma::expand::<E>(
            &mut b.scope,
            q,
            k,
            v,
            grad_out,
            lse,
            delta,
            dq,
            docs,
            params,
        );
    });
    let dkdv = |fuse_dq: bool, one_shot: bool| {
        compile(
            "backward_dkdv_mma",
            dkdv::DKDV_UNITS as u32,
            KERNEL_ADDRESS,
            |b| {
                let (q, k, v, grad_out) =
                    (input::<E>(b), input::<E>(b), input::<E>(b), input::<E>(b));
                let (lse, delta) = (input::<f32>(b), input::<f32>(b));
                let (dk, dv) = (output::<f32>(b), output::<f32>(b));
                let dq = output::<Atomic<f32>>(b);
                let (dk_out, dv_out) = (output::<E>(b), output::<E>(b));
                let docs = input::<u32>(b);
                let params = attention_params(b, head_dim, mask);
                dkdv::backward_dkdv_mma::expand::<E>(
                    &mut b.scope,
                    q,
                    k,
                    v,
                    grad_out,
                    lse,
                    delta,
                    dk,
                    dv,
                    dq,
                    dk_out,
                    dv_out,
                    docs,
                    params,
                    fuse_dq,
                    one_shot,
                    true,
                );
            },
        )
    };
    [
        ("forward", forward(true, false)),
        ("attention", forward(false, true)),
        ("forward_first", forward(false, false)),
        ("forward_last", forward(true, true)),
        ("dq", dq),
        ("dkdv", dkdv(false, false)),
        ("fused", dkdv(true, false)),
        ("fused_whole", dkdv(true, true)),
    ]
}

/// CUDA sources of the portable kernels for element type `E` (launched checked, 32-bit indices,
/// backward tiles of 16 rows): the forward step, dQ and dK/dV.
pub fn portable_kernels<E: Float>(head_dim: usize, mask: MaskKind) -> [(&'static str, String); 3] {
    let units = portable::ROWS_PER_CUBE as u32;
    let tile_rows = portable::BACKWARD_TILE_ROWS[0];
    let checked = |name, expand: &dyn Fn(&mut KernelBuilder)| {
        compile_in(
            name,
            units,
            AddressType::U32,
            ExecutionMode::Checked,
            expand,
        )
    };
    let forward = checked("forward_step_portable", &|b| {
        let (q, k, v) = (input::<E>(b), input::<E>(b), input::<E>(b));
        let (o, m, l) = (output::<f32>(b), output::<f32>(b), output::<f32>(b));
        let docs = input::<u32>(b);
        let params = attention_params(b, head_dim, mask);
        let (begin, end) = (scalar::<u32>(b), scalar::<u32>(b));
        portable::forward::forward_step_portable::expand::<E>(
            &mut b.scope,
            q,
            k,
            v,
            o,
            m,
            l,
            docs,
            params,
            begin,
            end,
        );
    });
    let dq = checked("backward_dq_portable", &|b| {
        let (q, k, v, grad_out) = (input::<E>(b), input::<E>(b), input::<E>(b), input::<E>(b));
        let (lse, delta) = (input::<f32>(b), input::<f32>(b));
        let dq = output::<f32>(b);
        let docs = input::<u32>(b);
        let params = attention_params(b, head_dim, mask);
        let (begin, end) = (scalar::<u32>(b), scalar::<u32>(b));
        portable::backward::backward_dq_portable::expand::<E>(
            &mut b.scope,
            q,
            k,
            v,
            grad_out,
            lse,
            delta,
            dq,
            docs,
            params,
            begin,
            end,
            tile_rows,
        );
    });
    let dkdv = checked("backward_dkdv_portable", &|b| {
        let (q, k, v, grad_out) = (input::<E>(b), input::<E>(b), input::<E>(b), input::<E>(b));
        let (lse, delta) = (input::<f32>(b), input::<f32>(b));
        let (dk, dv) = (output::<f32>(b), output::<f32>(b));
        let docs = input::<u32>(b);
        let params = attention_params(b, head_dim, mask);
        let (begin, end) = (scalar::<u32>(b), scalar::<u32>(b));
        portable::backward::backward_dkdv_portable::expand::<E>(
            &mut b.scope,
            q,
            k,
            v,
            grad_out,
            lse,
            delta,
            dk,
            dv,
            docs,
            params,
            begin,
            end,
            tile_rows,
        );
    });
    [
        ("portable_forward", forward),
        ("portable_dq", dq),
        ("portable_dkdv", dkdv),
    ]
}

/// The compile-time mask shapes the kernels are built for, by name: no mask, causal, a causal
/// sliding window, causal documents, and all three.
pub fn mask_kinds() -> [(&'static str, MaskKind); 5] {
    let kind = |upper, lower, documents| MaskKind {
        upper,
        lower,
        documents,
    };
    [
        ("full", kind(false, false, false)),
        ("causal", kind(true, false, false)),
        ("window", kind(true, true, false)),
        ("documents", kind(true, false, true)),
        ("window_documents", kind(true, true, true)),
    ]
}
