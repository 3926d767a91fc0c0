//! Launching hand-written CUDA C++ through CubeCL's CUDA runtime.
//!
//! A [`CudaSource`] is launched as a `CubeTask` whose compilation returns its source and entry
//! point: the runtime compiles it with its NVRTC (for `sm_90a` on Hopper, which `wgmma` and `setmaxnreg`
//! need), keeps the module like any other kernel's, and launches it on the calling thread's
//! CubeCL stream with CubeCL's buffers, so it is ordered with every other kernel and its buffers
//! are kept alive and synchronised across streams by CubeCL, as theirs are.
//!
//! CubeCL reads two more things from a compiled kernel: the cube's size and its shared memory
//! (the launch's dynamic shared memory), the latter from the kernel's representation in its own
//! compiler's IR. The task therefore compiles [`shell`], a CubeCL kernel that does nothing but
//! declare as much shared memory as the hand-written source uses, and hands CubeCL the shell's
//! compiled form with the hand-written source and entry point in place of the shell's (an
//! `EditedTask`).
//!
//! The kernel's parameters arrive in CubeCL's order ([`SourceArguments`]): each tensor map by
//! value (`const __grid_constant__` 128-byte `CUtensorMap`, encoded by CubeCL from a
//! [`TensorMapMeta`]), then each tensor map's buffer, then the plain buffers, then the `u32`
//! scalars as one struct by value (16 bytes for four). Beside the launch: a per-process cache of
//! each source's built variants ([`KernelCache`]) and the buffers' alignment check the copy
//! engine needs.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use cubecl::prelude::*;
use cubecl::server::{Binding, KernelArguments, TensorMapBinding, TensorMapMeta};
use cubecl::zspace::metadata::Metadata;
use cubecl::zspace::{Shape, Strides};
use cubecl::{Compiler, InfoBuilder};

use crate::edited_task::{Edit, EditedTask};
use crate::kernel_error::KernelError;
use crate::tensor::DeviceTensor;

/// The PTX building blocks (`ptx.cuh`: mbarriers, bulk tensor copies, matrix descriptors,
/// warpgroup MMA fences) that every hand-written kernel's source starts with, after its switches.
pub const PTX_PRELUDE: &str = include_str!("ptx.cuh");

/// What the attention kernels share on top of [`PTX_PRELUDE`] (`attention.cuh`: the 16-bit
/// operand type, descriptors of swizzled 64-column tiles, `wgmma` with A in registers, register
/// fences, `exp2`, packing, named barriers, fragment stores), prepended after it.
pub const ATTENTION_PRELUDE: &str = include_str!("attention.cuh");

/// Declares `shared_words` words of shared memory, so that its compiled form carries the shared
/// memory a hand-written kernel needs. Compiled, never launched.
#[cube(launch_unchecked)]
pub fn shell(out: &mut Array<u32>, #[comptime] shared_words: usize) {
    let mut shared = SharedMemory::<u32>::new(shared_words);
    shared[UNIT_POS as usize] = UNIT_POS;
    sync_cube();
    out[UNIT_POS as usize] = shared[UNIT_POS as usize];
}

/// A hand-written CUDA kernel: its source, entry point, cube size and shared memory. Cheap to
/// clone (the source is shared), with its fingerprint computed once.
#[derive(Debug, Clone)]
pub struct CudaSource {
    /// The `extern "C" __global__` function to launch.
    pub entry_point: &'static str,
    /// The whole translation unit, with no `#include` (NVRTC's include paths differ by machine).
    source: Arc<str>,
    /// See [`CudaSource::fingerprint`].
    fingerprint: u64,
    /// Threads per cube (one-dimensional).
    pub units: u32,
    /// Bytes of dynamic shared memory per cube.
    pub shared_bytes: usize,
}

impl CudaSource {
    /// The kernel `entry_point` of `source`, launched with cubes of `units` threads and
    /// `shared_bytes` of dynamic shared memory.
    pub fn new(entry_point: &'static str, source: String, units: u32, shared_bytes: usize) -> Self {
        // The entry point too: one source may hold several kernels.
        let fingerprint = source
            .bytes()
            .chain([0])
            .chain(entry_point.bytes())
            .fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
                (hash ^ byte as u64).wrapping_mul(0x0000_0100_0000_01b3)
            });
        Self {
            entry_point,
            source: source.into(),
            fingerprint,
            units,
            shared_bytes,
        }
    }

    /// The source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// A 64-bit FNV-1a hash of the source and the entry point: part of the kernel's id, so that
    /// CubeCL's compiled kernel cache (in memory and on disk) never serves an earlier version of
    /// the source, nor another kernel of it.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
}

/// The kernels of one hand-written source file, built and fingerprinted once per process and
/// variant `K`, then shared (each clone shares its source).
pub(crate) struct KernelCache<K> {
    kernels: OnceLock<Mutex<HashMap<K, CudaSource>>>,
}

impl<K: Eq + Hash> KernelCache<K> {
    /// An empty cache, for a `static`.
    pub(crate) const fn new() -> Self {
        Self {
            kernels: OnceLock::new(),
        }
    }

    /// The kernel of `variant`: `build`'s on the first call for it, the same one later.
    pub(crate) fn get(&self, variant: K, build: impl FnOnce() -> CudaSource) -> CudaSource {
        let mut kernels = self
            .kernels
            .get_or_init(Mutex::default)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        kernels.entry(variant).or_insert_with(build).clone()
    }
}

/// Errors unless every one of the named `buffers` starts on a 16-byte boundary, as the bulk
/// (tensor) copy engine and the kernels' vector accesses need (a view into the middle of a
/// buffer may not); `kernel` names the caller in the message.
pub(crate) fn check_alignment(
    kernel: &str,
    buffers: &[(&str, &DeviceTensor)],
) -> Result<(), KernelError> {
    for (name, tensor) in buffers {
        let offset = tensor.handle.offset_start.unwrap_or(0);
        if offset % 16 != 0 {
            return Err(KernelError::Unsupported {
                what: format!(
                    "{kernel} reads and writes through the bulk tensor copy engine, whose buffers \
                     start on 16-byte boundaries; `{name}` starts {} bytes past one",
                    offset % 16
                ),
            });
        }
    }
    Ok(())
}

/// The parameters of `entry_point` in `source` as declared, for the tests that check them
/// against what the host registers.
#[cfg(test)]
pub(crate) fn parameters<'a>(source: &'a str, entry_point: &str) -> Vec<&'a str> {
    source
        .split(&format!("{entry_point}("))
        .nth(1)
        .and_then(|rest| rest.split(')').next())
        .expect("the source defines the entry point")
        .split(',')
        .map(str::trim)
        .collect()
}

/// The parameters of `entry_point` in `source` as the preprocessor leaves them: each declared
/// one kept unless an `#if CONDITION` line before it (closed by `#endif`) has a condition that
/// `holds` says is false, for the tests of kernels whose parameters depend on their switches.
#[cfg(test)]
pub(crate) fn preprocessed_parameters(
    source: &str,
    entry_point: &str,
    holds: impl Fn(&str) -> bool,
) -> Vec<String> {
    let mut kept = Vec::new();
    let mut keep = true;
    for parameter in parameters(source, entry_point) {
        let mut declaration = String::new();
        for line in parameter.lines().map(str::trim) {
            if let Some(condition) = line.strip_prefix("#if ") {
                keep = holds(condition);
            } else if line == "#endif" {
                keep = true;
            } else {
                assert!(!line.starts_with('#'), "unexpected directive `{line}`");
                declaration.push_str(line);
            }
        }
        if keep && !declaration.is_empty() {
            kept.push(declaration);
        }
    }
    kept
}

/// Asserts that the device source `file` (`source`) defines each of `defines` to its value, so
/// that the host's constants and the kernel's cannot drift apart.
#[cfg(test)]
pub(crate) fn assert_defines(file: &str, source: &str, defines: &[(&str, usize)]) {
    for (name, value) in defines {
        let line = format!("#define {name} {value}\n");
        assert!(source.contains(&line), "{file} lacks `{}`", line.trim());
    }
}

/// The hand-written kernel in place of its shell's compiled source.
impl<C: Compiler> Edit<C> for CudaSource {
    fn id(&self) -> u64 {
        self.fingerprint()
    }

    fn name(&self) -> Option<&'static str> {
        Some(self.entry_point)
    }

    fn apply(&self, compiled: &mut CompiledKernel<C>) {
        compiled.source = self.source.to_string();
        compiled.entrypoint_name = self.entry_point.to_string();
        compiled.debug_name = Some(self.entry_point);
    }
}

/// A hand-written kernel's arguments, registered as CubeCL's launcher registers them, in the
/// order the kernel's parameters list them (see the module's comment).
pub(crate) struct SourceArguments {
    tensor_maps: Vec<TensorMapBinding>,
    buffers: Vec<Binding>,
    info: InfoBuilder,
}

/// How a tensor map cuts a row-major tensor into boxes.
pub(crate) struct TiledMap<'a> {
    /// The tensor's shape as the map sees it, outermost first: the tensor's own shape, or a view
    /// of its contiguous elements (`[B * H, S, D]` of a `[B, H, S, D]` tensor), whose sizes
    /// multiply to the tensor's length.
    pub view: &'a [usize],
    /// The box's extent along each axis of the view, outermost first (at most 256 each; with
    /// the 128-byte swizzle a box row is at most 128 bytes).
    pub box_shape: &'a [usize],
    /// Shared-memory swizzle of the boxes.
    pub swizzle: TensorMapSwizzle,
}

impl SourceArguments {
    pub(crate) fn new() -> Self {
        Self {
            tensor_maps: Vec::new(),
            buffers: Vec::new(),
            info: InfoBuilder::default(),
        }
    }

    /// Registers a tensor map over `tensor` (row-major, seen as `map.view`) as the next tensor
    /// map parameter; CubeCL encodes it at launch from the buffer's address. Elements of a box
    /// outside the view read as zeros and are not written.
    pub(crate) fn tiled_map(&mut self, tensor: &DeviceTensor, map: TiledMap) {
        debug_assert_eq!(map.view.iter().product::<usize>(), tensor.len());
        debug_assert_eq!(map.view.len(), map.box_shape.len());
        let mut strides = vec![1; map.view.len()];
        for axis in (0..map.view.len().saturating_sub(1)).rev() {
            strides[axis] = strides[axis + 1] * map.view[axis + 1];
        }
        let storage_ty = match tensor.elem {
            crate::tensor::ElemType::F16 => half::f16::as_type_native_unchecked(),
            crate::tensor::ElemType::BF16 => half::bf16::as_type_native_unchecked(),
            crate::tensor::ElemType::F32 => f32::as_type_native_unchecked(),
        }
        .storage_type();
        let meta = TensorMapMeta {
            format: TensorMapFormat::Tiled(TiledArgs {
                tile_size: Shape::from(map.box_shape.to_vec()),
            }),
            metadata: Metadata::new(Shape::from(map.view.to_vec()), Strides::from(strides)),
            elem_stride: Strides::from(vec![1; map.view.len()]),
            interleave: TensorMapInterleave::None,
            swizzle: map.swizzle,
            prefetch: TensorMapPrefetch::B256,
            oob_fill: OobFill::Zero,
            storage_ty,
        };
        self.tensor_maps.push(TensorMapBinding {
            binding: tensor.handle.clone().binding(),
            map: meta,
        });
    }

    /// Registers `tensor`'s buffer as the next plain buffer parameter.
    pub(crate) fn buffer(&mut self, tensor: &DeviceTensor) {
        self.buffers.push(tensor.handle.clone().binding());
    }

    /// Registers `table`'s buffer as the next plain buffer parameter.
    pub(crate) fn table(&mut self, table: &crate::mask::DocumentTable) {
        self.buffers.push(table.handle.clone().binding());
    }

    /// Registers `handle` (a buffer the caller made for this launch) as the next plain buffer
    /// parameter.
    pub(crate) fn handle(&mut self, handle: cubecl::server::Handle) {
        self.buffers.push(handle.binding());
    }

    /// Registers the next `u32` scalar (the kernel's struct of scalars lists them in order).
    pub(crate) fn scalar(&mut self, value: u32) {
        self.info.scalars.push(value);
    }

    fn finish(mut self) -> KernelArguments {
        let mut arguments = KernelArguments::new();
        arguments.info = self.info.finish(AddressType::U32);
        arguments.buffers = self.buffers;
        arguments.tensor_maps = self.tensor_maps;
        arguments
    }
}

/// Launches `kernel` over `count` cubes with `arguments`.
///
/// # Safety
/// The client's runtime must be CUDA (the source is CUDA C++), `arguments` must match the
/// kernel's parameters in order and type, and the kernel must stay in bounds and terminate for
/// them.
pub(crate) unsafe fn launch<R: Runtime>(
    client: &ComputeClient<R>,
    kernel: CudaSource,
    count: CubeCount,
    arguments: SourceArguments,
) {
    let settings = KernelSettings::default().cube_dim(CubeDim::new_1d(kernel.units));
    let shell = shell::Shell::<R>::new(
        settings,
        client.clone(),
        ArrayCompilationArg { inplace: None },
        kernel.shared_bytes.div_ceil(4),
    );
    let task = EditedTask::<R::Compiler, _, _>::new(shell, kernel);
    // SAFETY: the caller vouches for the runtime, the arguments and the kernel.
    unsafe { client.launch_unchecked(Box::new(task), count, arguments.finish()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(text: &str) -> CudaSource {
        CudaSource::new("k", text.into(), 128, 1024)
    }

    #[test]
    fn the_fingerprint_follows_the_source() {
        let a = source("extern \"C\" __global__ void k() {}");
        let b = source("extern \"C\" __global__ void k() { }");
        assert_eq!(a.fingerprint(), a.clone().fingerprint());
        assert_eq!(a.fingerprint(), source(a.source()).fingerprint());
        assert_ne!(a.fingerprint(), b.fingerprint());
        // Another kernel of the same source.
        let other = CudaSource::new("l", a.source().into(), 128, 1024);
        assert_ne!(a.fingerprint(), other.fingerprint());
    }

    #[test]
    fn a_cache_builds_each_variant_once() {
        static CACHE: KernelCache<u8> = KernelCache::new();
        let first = CACHE.get(1, || source("one"));
        let again = CACHE.get(1, || panic!("built twice"));
        let other = CACHE.get(2, || source("two"));
        assert_eq!(first.source().as_ptr(), again.source().as_ptr());
        assert_eq!(other.source(), "two");
    }

    #[test]
    fn scalars_are_packed_as_the_kernel_reads_them() {
        let mut arguments = SourceArguments::new();
        for value in [7u32, 8, 9, 0] {
            arguments.scalar(value);
        }
        let info = arguments.finish().info;
        // Four u32 in two little-endian u64 words: the kernel's 16-byte struct, by value.
        assert_eq!(info.data, vec![7 | (8 << 32), 9]);
        assert_eq!(info.dynamic_metadata_offset, info.data.len());
    }
}
