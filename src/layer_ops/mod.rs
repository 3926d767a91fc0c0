//! The element-wise parts of a Llama block (SwiGLU, RMS norm, the rotary embedding), forward and
//! backward, as the [`LayerOpsBackend`](crate::LayerOpsBackend) operations the layers
//! call: Burn tensor operations on every backend (`tensor_ops`), one CubeCL pass each on
//! `CubeBackend` (`cube`, `kernels`, `norm_kernels`), where Burn's operations take 3 to 12 passes
//! (its sigmoid alone takes seven, in f32).

pub(crate) mod cube;
mod kernels;
mod norm_kernels;
pub(crate) mod tensor_ops;

use std::sync::OnceLock;

/// Whether `DISTFLASH_UNFUSED_LAYERS=1` asks for the tensor-operation versions on every backend
/// (for side-by-side measurements; read once per process).
pub(crate) fn unfused_layers_forced() -> bool {
    static FORCED: OnceLock<bool> = OnceLock::new();
    *FORCED.get_or_init(|| std::env::var("DISTFLASH_UNFUSED_LAYERS").is_ok_and(|v| v == "1"))
}
