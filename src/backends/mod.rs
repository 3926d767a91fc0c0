//! [`crate::FlashAttentionBackend`] for each supported Burn backend.

mod autodiff;
pub mod cube;
mod fusion;
mod ndarray;
