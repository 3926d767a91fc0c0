//! What a device allows one launch, read from the client's properties, so that every limit is
//! checked on the host before anything is launched.

use cubecl::prelude::*;

use crate::kernel_error::KernelError;
use crate::tensor::ElemType;

/// The limits of one device that the kernels' launch choices depend on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceLimits {
    /// Bytes of shared memory one cube may use (32 KiB on Mesa's lavapipe, up to 227 KiB on an
    /// H100 with CUDA's opt-in).
    pub max_shared_memory: usize,
    /// Largest grid along x, y and z (65535 on Vulkan and along y/z on CUDA).
    pub max_cube_count: (u32, u32, u32),
    /// Most units (threads) in one cube.
    pub max_units_per_cube: u32,
    /// Largest cube extent along x (the kernels' cubes are one-dimensional).
    pub max_cube_dim_x: u32,
    /// Whether the device runs kernels on f16 data.
    pub f16: bool,
    /// Whether the device stores `mma` fragments of f16 and bf16 to shared memory with
    /// `stmatrix` (CUDA sm_90 and later); the tensor-core backward stores them value by value
    /// without it.
    pub stmatrix: bool,
    /// Whether the device runs kernels on bf16 data.
    pub bf16: bool,
}

impl DeviceLimits {
    /// The limits `client`'s device reports.
    pub fn of<R: Runtime>(client: &ComputeClient<R>) -> Self {
        let properties = client.properties();
        let hardware = &properties.hardware;
        Self {
            max_shared_memory: hardware.max_shared_memory_size,
            max_cube_count: hardware.max_cube_count,
            max_units_per_cube: hardware.max_units_per_cube,
            max_cube_dim_x: hardware.max_cube_dim.0,
            f16: properties.supports_type(half::f16::as_type_native_unchecked()),
            bf16: properties.supports_type(half::bf16::as_type_native_unchecked()),
            stmatrix: [
                half::f16::as_type_native_unchecked(),
                half::bf16::as_type_native_unchecked(),
            ]
            .iter()
            .all(|ty| {
                properties
                    .features
                    .matmul
                    .stmatrix
                    .contains(&ty.storage_type())
            }) && !scalar_fragment_stores::forced(),
        }
    }

    /// Errors unless the device runs kernels on `elem` data (f32 always).
    pub fn expect_elem(&self, elem: ElemType) -> Result<(), KernelError> {
        let supported = match elem {
            ElemType::F32 => true,
            ElemType::F16 => self.f16,
            ElemType::BF16 => self.bf16,
        };
        if supported {
            Ok(())
        } else {
            Err(KernelError::DType {
                what: format!("this device does not run kernels on {elem:?} data"),
            })
        }
    }

    /// Errors unless a cube of `units` units fits.
    pub fn expect_units(&self, kernel: &str, units: usize) -> Result<(), KernelError> {
        let max = self.max_units_per_cube.min(self.max_cube_dim_x) as usize;
        if units <= max {
            Ok(())
        } else {
            Err(KernelError::DeviceLimit {
                what: format!("{kernel} needs cubes of {units} units; the device allows {max}"),
            })
        }
    }

    /// Errors unless `bytes` of shared memory per cube fit.
    pub fn expect_shared(&self, kernel: &str, bytes: usize) -> Result<(), KernelError> {
        if bytes <= self.max_shared_memory {
            Ok(())
        } else {
            Err(KernelError::DeviceLimit {
                what: format!(
                    "{kernel} needs {bytes} bytes of shared memory per cube; the device allows {}",
                    self.max_shared_memory
                ),
            })
        }
    }
}

/// A switch for tests that run the tensor-core backward on an `stmatrix` device with the
/// value-by-value stores of older devices, to check both against each other.
#[doc(hidden)]
pub mod scalar_fragment_stores {
    use std::cell::Cell;

    thread_local! {
        static FORCED: Cell<bool> = const { Cell::new(false) };
    }

    /// Whether launches on this thread store fragments value by value.
    pub fn forced() -> bool {
        FORCED.with(Cell::get)
    }

    /// Makes launches on this thread store fragments value by value (`true`) or as the device
    /// allows (`false`).
    pub fn force(on: bool) {
        FORCED.with(|f| f.set(on));
    }
}
