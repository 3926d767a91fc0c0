//! Test support for the workspace's crates, not published: the f64 attention oracle the kernels
//! and the Burn op are checked against, deterministic test data and the tolerance rule; a
//! wall-clock limit, scratch directories and one test at a time on wgpu; with feature `burn`,
//! tensors to and from f64, module visitors, and the checks of the Burn op and the collectives
//! that the plugin's two test binaries share; with feature `cuda-source`, the CUDA source of the
//! tensor-core kernels.
//!
//! Every crate uses it only as a dev-dependency, so none of it ships. Through the dev-dependency
//! cycles the integration tests link the same `distflash-kernels` and `burn-distflash` as this
//! crate, whereas a crate's unit tests in `src/` would see a second copy of its types: they use
//! only the std-only parts ([`TempDir`], [`within`]).

#![warn(missing_docs)]

mod attention;
mod convert;
mod exclusive_wgpu;
mod rng;
mod rounding;
pub mod temp_dir;
mod tolerance;
pub mod within;

#[cfg(feature = "burn")]
pub mod burn_case;
#[cfg(feature = "burn")]
pub mod collective_case;
#[cfg(feature = "cuda-source")]
pub mod cuda_source;
#[cfg(feature = "burn")]
pub mod host_values;
#[cfg(feature = "burn")]
pub mod modules;

pub use attention::{backward, forward, ReferenceForward, ReferenceGrads};
pub use convert::{to_f32, to_f64};
pub use exclusive_wgpu::exclusive_wgpu;
pub use rng::Rng;
pub use rounding::{exact, naive_rounding, rounding_of, Rounding};
pub use temp_dir::TempDir;
pub use tolerance::{assert_close, max_abs_diff};
pub use within::within;
