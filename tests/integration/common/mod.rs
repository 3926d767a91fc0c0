//! Helpers shared by the integration tests: the Burn-level checks in the submodules, and the
//! deterministic test data and tolerance rule of `distflash-oracle` (shared with the kernels
//! crate's suite) under their usual names.
#![allow(dead_code)]

pub mod block_case;
pub mod burn_case;
pub mod collective_case;
pub mod distributed_case;
pub mod host_values;
pub mod matrix;
pub mod modules;
#[cfg(feature = "nccl")]
pub mod nccl_case;
pub mod repeated_case;
pub mod schedules;
pub mod within;

pub use distflash_oracle::{assert_close, naive_rounding, Rng};
