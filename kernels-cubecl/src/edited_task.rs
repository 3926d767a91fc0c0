//! A CubeCL kernel compiled as CubeCL's own `KernelTask` compiles it, then edited before the
//! runtime hands its source to the device compiler: how the crate gives NVRTC what CubeCL 0.10
//! cannot print (the tensor-core kernels' flush-to-zero `exp2`, the Hopper kernels' hand-written
//! CUDA C++).

use cubecl::prelude::*;
use cubecl::{CompilationError, Compiler, CubeTask};

/// What an [`EditedTask`] does to the compiled kernel.
pub(crate) trait Edit<C: Compiler>: Send + Sync + 'static {
    /// Part of the edited kernel's id, beside the edit's type and the plain kernel's id: an edit
    /// whose result depends on its value (a source) returns a hash of it, so that CubeCL's caches
    /// of compiled kernels (in memory and on disk) never serve one edit's result for another.
    fn id(&self) -> u64;

    /// The kernel's name in CubeCL's logs and errors, where it is not the plain kernel's.
    fn name(&self) -> Option<&'static str> {
        None
    }

    /// Changes the compiled kernel (its source, its entry point).
    fn apply(&self, compiled: &mut CompiledKernel<C>);
}

/// The kernel `K` as CubeCL compiles it, with `E` applied to the result. Its id differs from the
/// plain kernel's, so neither compiled form stands in for the other.
pub(crate) struct EditedTask<C: Compiler, K: CubeKernel, E: Edit<C>> {
    task: KernelTask<C, K>,
    edit: E,
}

impl<C: Compiler, K: CubeKernel, E: Edit<C>> EditedTask<C, K, E> {
    /// `kernel`, to be compiled by CubeCL and then edited by `edit`.
    pub(crate) fn new(kernel: K, edit: E) -> Self {
        Self {
            task: KernelTask::new(kernel),
            edit,
        }
    }
}

impl<C: Compiler, K: CubeKernel, E: Edit<C>> KernelMetadata for EditedTask<C, K, E> {
    fn name(&self) -> &'static str {
        self.edit.name().unwrap_or_else(|| self.task.name())
    }

    fn id(&self) -> KernelId {
        let inner = self.task.id();
        KernelId::new::<Self>()
            .cube_dim(inner.cube_dim)
            .info((self.edit.id(), inner))
    }

    fn address_type(&self) -> StorageType {
        self.task.address_type()
    }
}

impl<C: Compiler, K: CubeKernel, E: Edit<C>> CubeTask<C> for EditedTask<C, K, E> {
    fn compile(
        &self,
        compiler: &mut C,
        compilation_options: &C::CompilationOptions,
        mode: ExecutionMode,
        address_type: StorageType,
    ) -> Result<CompiledKernel<C>, CompilationError> {
        let mut compiled = self
            .task
            .compile(compiler, compilation_options, mode, address_type)?;
        self.edit.apply(&mut compiled);
        Ok(compiled)
    }
}
