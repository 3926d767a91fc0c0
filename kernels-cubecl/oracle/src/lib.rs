//! Test support for `distflash-kernels` and `burn-distflash`, not published: the f64 attention
//! oracle the kernels and the Burn op are checked against, deterministic test data, and the
//! tolerance rule.
//!
//! Both crates use it only as a dev-dependency, so none of it ships with the kernels. The kernels
//! crate uses it from its integration tests only (`kernels-cubecl/tests/`): through the
//! dev-dependency cycle they link the same `distflash-kernels` as this crate, whereas the
//! kernels crate's unit tests would see a second copy of its types.

#![warn(missing_docs)]

mod attention;
mod convert;
mod rng;
mod rounding;
mod tolerance;

pub use attention::{backward, forward, ReferenceForward, ReferenceGrads};
pub use convert::{to_f32, to_f64};
pub use rng::Rng;
pub use rounding::{exact, naive_rounding, rounding_of, Rounding};
pub use tolerance::{assert_close, max_abs_diff};
