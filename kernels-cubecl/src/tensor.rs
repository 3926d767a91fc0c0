//! A contiguous device buffer with its shape and element type: what the launch functions take.

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::kernel_error::KernelError;

/// Element types the kernels read and write for q, k, v, O and their gradients. Statistics and
/// accumulators are always f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ElemType {
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// Single precision.
    F32,
}

impl ElemType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            ElemType::F16 | ElemType::BF16 => 2,
            ElemType::F32 => 4,
        }
    }
}

/// A row-major contiguous tensor living on a CubeCL device.
#[derive(Clone, Debug)]
pub struct DeviceTensor {
    /// The device memory.
    pub handle: Handle,
    /// Row-major shape.
    pub shape: Vec<usize>,
    /// Element type of the buffer.
    pub elem: ElemType,
}

impl DeviceTensor {
    /// Allocates an uninitialised tensor.
    pub fn empty<R: Runtime>(client: &ComputeClient<R>, shape: Vec<usize>, elem: ElemType) -> Self {
        let len: usize = shape.iter().product();
        Self {
            handle: client.empty(len * elem.size()),
            shape,
            elem,
        }
    }

    /// Uploads host f32 data (converted to `elem`).
    pub fn from_f32<R: Runtime>(
        client: &ComputeClient<R>,
        data: &[f32],
        shape: Vec<usize>,
        elem: ElemType,
    ) -> Self {
        assert_eq!(data.len(), shape.iter().product::<usize>(), "data/shape");
        let bytes: Vec<u8> = match elem {
            ElemType::F32 => data.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ElemType::F16 => data
                .iter()
                .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
                .collect(),
            ElemType::BF16 => data
                .iter()
                .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                .collect(),
        };
        Self {
            handle: client.create_from_slice(&bytes),
            shape,
            elem,
        }
    }

    /// Reads the tensor back to the host as f32 (blocking).
    pub fn to_f32<R: Runtime>(&self, client: &ComputeClient<R>) -> Vec<f32> {
        let bytes = client
            .read_one(self.handle.clone())
            .expect("reading a device tensor back");
        let n = self.len();
        match self.elem {
            ElemType::F32 => bytes[..n * 4]
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            ElemType::F16 => bytes[..n * 2]
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            ElemType::BF16 => bytes[..n * 2]
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the tensor has no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Kernel argument viewing the buffer as a flat array.
    pub(crate) fn array_arg<R: Runtime>(&self) -> ArrayArg<R> {
        // SAFETY: the handle was allocated for `len()` elements of `elem` (all constructors).
        unsafe { ArrayArg::from_raw_parts(self.handle.clone(), self.len()) }
    }

    /// Errors unless the element type is `elem`.
    pub(crate) fn expect_elem(&self, name: &str, elem: ElemType) -> Result<(), KernelError> {
        if self.elem == elem {
            Ok(())
        } else {
            Err(KernelError::DType {
                what: format!("`{name}` is {:?}, expected {elem:?}", self.elem),
            })
        }
    }
}

/// Runs `$body` with the type alias `$E` bound to the Rust type of an [`ElemType`].
macro_rules! with_elem_type {
    ($elem:expr, $E:ident => $body:expr) => {
        match $elem {
            ElemType::F16 => {
                type $E = half::f16;
                $body
            }
            ElemType::BF16 => {
                type $E = half::bf16;
                $body
            }
            ElemType::F32 => {
                type $E = f32;
                $body
            }
        }
    };
}
pub(crate) use with_elem_type;
