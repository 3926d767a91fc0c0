//! Launching the tensor-core kernels with `exp2` as one `ex2.approx.ftz.f32`, as
//! FlashAttention-2 compiles it (`--use_fast_math`).
//!
//! cubecl 0.10 prints `exp2` under fast math as `__powf(float(2.0), x)`, and cubecl-cuda gives
//! NVRTC no flush-to-zero option, so every exponential becomes `ex2.approx.f32` with its denormal
//! fix-up: a compare and two predicated multiplies around the `MUFU.EX2` (192 of the forward
//! loop's 1136 instructions per tile). CubeCL has no inline assembly and no compiler option for
//! it, so on CUDA the kernels are launched through an `EditedTask` that compiles the kernel
//! exactly as CubeCL does and then calls a one-instruction `ex2.approx.ftz.f32` helper in place
//! of each `__powf(float(2.0), x)` of the generated source ([`with_fast_exp2`]).
//!
//! Flushing changes only arguments and results below `2^-126`: a probability that small weighs
//! nothing against a row sum of at least 1, and a rescale factor that small was a rounding of 0.
//! Other runtimes, and a source CubeCL prints differently, compile unchanged (correct, slower);
//! a unit test pins the printed form so an upgrade that changes it fails loudly.
//!
//! The arguments are registered by `LaunchArguments` the way CubeCL's `KernelLauncher`
//! registers arrays and scalars (whose bindings it does not hand out), in the kernel's parameter
//! order.

use cubecl::prelude::*;
use cubecl::server::{Binding, KernelArguments};
use cubecl::{Compiler, CubeTask, InfoBuilder, ScalarArgType};

use crate::attention_params::{AttentionParams, AttentionParamsCompilationArg};
use crate::edited_task::{Edit, EditedTask};
use crate::tensor::DeviceTensor;

/// How CubeCL 0.10 prints `exp2` (`f32::powf(2.0, x)`) under fast math, up to the argument.
const PRINTED_EXP2: &str = "__powf(float(2.0), ";

/// The helper called in its place, up to the argument.
const HELPER_CALL: &str = "distflash_ex2_ftz(";

/// One `ex2.approx.ftz.f32`: `2^x`, arguments and results below `2^-126` flushed to 0.
const HELPER: &str = "__device__ __forceinline__ float distflash_ex2_ftz(float x) {\n    \
    float y;\n    asm(\"ex2.approx.ftz.f32 %0, %1;\" : \"=f\"(y) : \"f\"(x));\n    return y;\n}\n\n";

/// What the kernels' entry points are declared with in CubeCL's CUDA source: the helper goes
/// right before the first.
const ENTRY_POINT: &str = "extern \"C\" __global__";

/// `source` (CUDA C++ as CubeCL prints it) with every `exp2` computed by one
/// `ex2.approx.ftz.f32`, and how many were replaced. A source with no `exp2`, or with no entry
/// point to put the helper before, comes back unchanged with a count of 0.
pub fn with_fast_exp2(source: &str) -> (String, usize) {
    let count = source.matches(PRINTED_EXP2).count();
    let Some(entry) = source.find(ENTRY_POINT) else {
        return (source.to_string(), 0);
    };
    if count == 0 {
        return (source.to_string(), 0);
    }
    let (head, body) = source.split_at(entry);
    let rewritten = format!("{head}{HELPER}{}", body.replace(PRINTED_EXP2, HELPER_CALL));
    (rewritten, count)
}

/// The edit that applies [`with_fast_exp2`] to a compiled kernel's source.
struct FastExp2;

impl<C: Compiler> Edit<C> for FastExp2 {
    fn id(&self) -> u64 {
        0
    }

    fn apply(&self, compiled: &mut CompiledKernel<C>) {
        compiled.source = with_fast_exp2(&compiled.source).0;
    }
}

/// A kernel's buffers and scalars, registered in its parameter order as CubeCL's
/// `KernelLauncher` registers them (one buffer binding and its length metadata per array; the
/// scalars packed by type).
pub(crate) struct LaunchArguments {
    buffers: Vec<Binding>,
    info: InfoBuilder,
    address_type: AddressType,
}

impl LaunchArguments {
    /// No arguments yet, for a kernel indexed with `address_type`.
    pub(crate) fn new(address_type: AddressType) -> Self {
        Self {
            buffers: Vec::new(),
            info: InfoBuilder::default(),
            address_type,
        }
    }

    /// Registers `tensor` as the next array parameter (elements unvectorised) and returns what
    /// the kernel's definition takes for it.
    pub(crate) fn array(&mut self, tensor: &DeviceTensor) -> ArrayCompilationArg {
        let binding = tensor.handle.clone().binding();
        let elem_size = tensor.elem.size() as u64;
        self.info.metadata.register_array(
            binding.size_in_used() / elem_size,
            tensor.len() as u64,
            self.address_type,
        );
        self.buffers.push(binding);
        ArrayCompilationArg { inplace: None }
    }

    /// Registers a document table as the next array parameter (`u32` entries).
    pub(crate) fn table(&mut self, table: &crate::mask::DocumentTable) -> ArrayCompilationArg {
        let binding = table.handle.clone().binding();
        self.info.metadata.register_array(
            binding.size_in_used() / 4,
            table.len as u64,
            self.address_type,
        );
        self.buffers.push(binding);
        ArrayCompilationArg { inplace: None }
    }

    /// Registers `value` as the next scalar parameter (the kernel's definition takes `()` for
    /// it: scalars are compiled by type alone). Scalars are kept apart from the arrays, so only
    /// their order among themselves matters.
    fn scalar<T: ScalarArgType>(&mut self, value: T) {
        self.info.scalars.push(value);
    }

    /// Registers `params` as the next parameter: its scalars in field order, nested fields in
    /// place, as CubeCL's launcher registers an [`AttentionParams`]; returns what the kernel's
    /// definition takes for it.
    pub(crate) fn params(&mut self, params: &AttentionParams) -> AttentionParamsCompilationArg {
        let b = &params.bounds;
        self.scalar(params.scale);
        self.scalar(params.q_len);
        self.scalar(params.kv_len);
        self.scalar(params.heads);
        self.scalar(params.group_size);
        self.scalar(b.shift);
        self.scalar(b.before);
        self.scalar(b.after);
        self.scalar(b.q_pos0);
        self.scalar(b.kv_pos0);
        self.scalar(b.doc_stride);
        self.scalar(b.doc_count);
        AttentionParams::compilation_arg(params.head_dim, params.mask_kind)
    }

    fn finish(mut self) -> KernelArguments {
        let mut arguments = KernelArguments::new();
        arguments.info = self.info.finish(self.address_type);
        arguments.buffers = self.buffers;
        arguments
    }
}

/// Launches `kernel` over `count` cubes with `arguments`, unchecked; on CUDA with the
/// [`FastExp2`] edit.
///
/// # Safety
/// As CubeCL's `launch_unchecked`: the kernel must stay in bounds and terminate, and
/// `arguments` must hold the kernel's parameters in order with the types its definition
/// declares.
pub(crate) unsafe fn launch_unchecked<R: Runtime, K: CubeKernel>(
    client: &ComputeClient<R>,
    count: CubeCount,
    kernel: K,
    arguments: LaunchArguments,
) {
    let task: Box<dyn CubeTask<R::Compiler>> = if R::name(client) == "cuda" {
        Box::new(EditedTask::<R::Compiler, K, _>::new(kernel, FastExp2))
    } else {
        Box::new(KernelTask::<R::Compiler, K>::new(kernel))
    };
    // SAFETY: the caller upholds the kernel's contract.
    unsafe { client.launch_unchecked(task, count, arguments.finish()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOURCE: &str = "#include <cuda_runtime.h>\nstruct info_st { int a; };\n\
        extern \"C\" __global__ void k(float* o) {\n\
        const float a = __powf(float(2.0), o[0]);\n\
        const float b = __powf(float(2.0), a - o[1]);\n\
        const float c = __powf(o[2], 3.0);\n o[0] = a + b + c;\n}\n";

    #[test]
    fn every_exp2_calls_the_helper_declared_before_the_kernel() {
        let (source, count) = with_fast_exp2(SOURCE);
        assert_eq!(count, 2);
        assert!(!source.contains(PRINTED_EXP2));
        assert!(source.contains("const float a = distflash_ex2_ftz(o[0]);"));
        assert!(source.contains("const float b = distflash_ex2_ftz(a - o[1]);"));
        assert!(source.contains("const float c = __powf(o[2], 3.0);"));
        let helper = source.find("float distflash_ex2_ftz(float x)").unwrap();
        assert!(helper > source.find("struct info_st").unwrap());
        assert!(helper < source.find(ENTRY_POINT).unwrap());
        assert!(source.contains("ex2.approx.ftz.f32"));
    }

    #[test]
    fn a_source_without_exp2_or_entry_point_is_unchanged() {
        let plain = SOURCE.replace("__powf(float(2.0), ", "exp2f(");
        assert_eq!(with_fast_exp2(&plain), (plain.clone(), 0));
        let no_entry = SOURCE.replace(ENTRY_POINT, "__device__");
        assert_eq!(with_fast_exp2(&no_entry), (no_entry.clone(), 0));
    }
}
