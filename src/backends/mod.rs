//! [`crate::FlashAttentionBackend`] for each supported Burn backend.

mod autodiff;
pub mod cube;
mod ndarray;
