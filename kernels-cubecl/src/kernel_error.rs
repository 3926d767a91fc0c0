//! Errors returned by the host-side launch functions: input refused before anything is
//! launched, or a launch the runtime reported as failed.

use core::fmt;

use cubecl::prelude::*;
use distflash_schedule::ScheduleError;

/// Why a kernel call was refused, or failed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KernelError {
    /// A tensor does not have the rank the operation expects.
    Rank {
        /// Which argument (`"q"`, `"k"`, ...).
        name: &'static str,
        /// The rank that is required.
        expected: usize,
        /// The shape that was given.
        got: Vec<usize>,
    },
    /// Two tensors disagree on a dimension that must match.
    ShapeMismatch {
        /// What was compared, in words.
        what: String,
        /// The shape that was required.
        expected: Vec<usize>,
        /// The shape that was given.
        got: Vec<usize>,
    },
    /// The number of query heads is not a multiple of the number of key/value heads.
    HeadGrouping {
        /// Query heads.
        q_heads: usize,
        /// Key/value heads.
        kv_heads: usize,
    },
    /// The head dimension is not one the kernels are compiled for.
    UnsupportedHeadDim {
        /// The head dimension that was given.
        got: usize,
    },
    /// Tensors that must share an element type do not, or the type is not supported.
    DType {
        /// What was wrong, in words.
        what: String,
    },
    /// A dimension is zero or too large for 32-bit indexing.
    BadLength {
        /// What was wrong, in words.
        what: String,
    },
    /// An option (the score scale) has a value the kernels cannot use.
    BadOption {
        /// What was wrong, in words.
        what: String,
    },
    /// A mask cannot be applied (document boundaries that do not increase, do not end at the
    /// sequence length, or do not cover the call's positions).
    BadMask {
        /// What was wrong, in words.
        what: String,
    },
    /// The kernel variant the options ask for does not cover this call (a head dim, element
    /// type, mask or entry point it is not built for); `Variant::Auto` runs such calls on
    /// another variant.
    Unsupported {
        /// What is not covered and what is, in words.
        what: String,
    },
    /// The call needs more than the device allows one launch (grid size, shared memory, units
    /// per cube); refused before anything was launched.
    DeviceLimit {
        /// What was needed and what the device allows, in words.
        what: String,
    },
    /// The runtime reported that a launch failed: the outputs of the call are not valid.
    Launch {
        /// What the runtime reported.
        what: String,
    },
}

/// Head dimensions the kernels accept.
pub const SUPPORTED_HEAD_DIMS: [usize; 6] = [16, 32, 64, 96, 128, 256];

impl fmt::Display for KernelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KernelError::Rank {
                name,
                expected,
                got,
            } => write!(
                f,
                "`{name}` must have {expected} dimensions, got shape {got:?}"
            ),
            KernelError::ShapeMismatch {
                what,
                expected,
                got,
            } => write!(f, "shape mismatch for {what}: expected {expected:?}, got {got:?}"),
            KernelError::HeadGrouping { q_heads, kv_heads } => write!(
                f,
                "query heads ({q_heads}) must be a non-zero multiple of key/value heads ({kv_heads})"
            ),
            KernelError::UnsupportedHeadDim { got } => write!(
                f,
                "head dimension {got} is not supported; supported head dimensions are {SUPPORTED_HEAD_DIMS:?}"
            ),
            KernelError::DType { what } => write!(f, "dtype error: {what}"),
            KernelError::BadLength { what } => write!(f, "bad length: {what}"),
            KernelError::BadOption { what } => write!(f, "bad option: {what}"),
            KernelError::BadMask { what } => write!(f, "bad mask: {what}"),
            KernelError::Unsupported { what } => write!(f, "unsupported: {what}"),
            KernelError::DeviceLimit { what } => write!(f, "device limit: {what}"),
            KernelError::Launch { what } => write!(f, "kernel launch failed: {what}"),
        }
    }
}

impl std::error::Error for KernelError {}

/// A mask type's refusal ([`ScheduleError::BadMask`]: bad document boundaries or window, a mask
/// that does not fit the call) as [`KernelError::BadMask`], the same words; a layout's, which no
/// kernel call raises, as [`KernelError::BadOption`].
impl From<ScheduleError> for KernelError {
    fn from(e: ScheduleError) -> Self {
        match e {
            ScheduleError::BadMask { what } => KernelError::BadMask { what },
            layout @ ScheduleError::Layout { .. } => KernelError::BadOption {
                what: layout.to_string(),
            },
        }
    }
}

/// Flushes the calling thread's stream of `client` and turns a launch failure the runtime
/// recorded there (compilation, resources, driver) into [`KernelError::Launch`]. CubeCL does not
/// return errors from `launch`; it records them on the stream, where they stay silent until a
/// flush or sync asks. Every public function calls this once after its launches (a flush on CUDA
/// waits for the previous flush's fence, so calling it per launch would serialise the host).
pub(crate) fn launch_result<R: Runtime>(
    client: &ComputeClient<R>,
    call: &str,
) -> Result<(), KernelError> {
    client.flush().map_err(|e| KernelError::Launch {
        what: format!("{call}: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{DeviceTensor, ElemType};

    /// Asks for 4 MiB of shared memory per cube, more than any device allows.
    #[cube(launch)]
    fn too_much_shared(out: &mut Array<f32>) {
        let mut tile = SharedMemory::<f32>::new(1usize << 20);
        tile[UNIT_POS as usize] = 1.0;
        sync_cube();
        out[UNIT_POS as usize] = tile[UNIT_POS as usize];
    }

    /// A launch the runtime refuses is reported once, as a `Launch` error; the stream is usable
    /// afterwards.
    fn failed_launch_is_an_error<R: Runtime>(client: &ComputeClient<R>) {
        let out = DeviceTensor::from_f32(client, &[0.0; 32], vec![32], ElemType::F32);
        too_much_shared::launch::<R>(
            client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(32),
            out.array_arg(),
        );
        let err = launch_result(client, "too_much_shared").unwrap_err();
        let message = err.to_string();
        assert!(matches!(err, KernelError::Launch { .. }), "{message}");
        assert!(
            message.contains("too_much_shared") && message.contains("shared memory"),
            "{message}"
        );
        launch_result(client, "nothing").unwrap();
    }

    #[test]
    fn wgpu_failed_launch_is_an_error() {
        failed_launch_is_an_error(&cubecl::wgpu::WgpuRuntime::client(
            &cubecl::wgpu::WgpuDevice::Cpu,
        ));
    }

    #[test]
    #[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
    fn cuda_failed_launch_is_an_error() {
        failed_launch_is_an_error(&cubecl::cuda::CudaRuntime::client(
            &cubecl::cuda::CudaDevice::new(0),
        ));
    }
}
