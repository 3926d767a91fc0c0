//! Helpers of the integration tests: the cases only this binary runs in the submodules, and,
//! under their usual names, what it shares with the other test binaries from
//! `distflash-test-support` (the Burn op's and the collectives' checks, tensors to and from f64,
//! module visitors, the wall-clock limit, the test data and the tolerance rule).
#![allow(dead_code)]

pub mod block_case;
pub mod distributed_case;
pub mod matrix;
#[cfg(feature = "nccl")]
pub mod nccl_case;
pub mod repeated_case;
pub mod schedules;
pub mod wgpu_pools;

pub use distflash_test_support::{
    assert_close, burn_case, collective_case, host_values, modules, within, Rng,
};
