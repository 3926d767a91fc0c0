//! [`gradients_of`]: a loss's backward pass whose failure is an error, not a crash.
//!
//! Burn's backward pass cannot return an error, so the plugin's attention node panics when the
//! sequence-parallel backward fails (a peer that died or went silent mid-exchange: the group's
//! collective error). The trainer turns that panic into [`Error::Backward`], so a run on a group
//! ends with the error and its exit code instead of a crash.

use std::panic::{catch_unwind, AssertUnwindSafe};

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;

use crate::Error;

/// The gradients of `loss`, or [`Error::Backward`] with what the failed pass said.
pub(super) fn gradients_of<B: AutodiffBackend>(loss: &Tensor<B, 1>) -> Result<B::Gradients, Error> {
    guarded(|| loss.backward())
}

/// `pass`'s result, or [`Error::Backward`] carrying its panic's message.
fn guarded<T>(pass: impl FnOnce() -> T) -> Result<T, Error> {
    catch_unwind(AssertUnwindSafe(pass)).map_err(|panic| {
        let message = (panic.downcast_ref::<String>().cloned())
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "the backward pass panicked".into());
        Error::Backward { message }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::TensorData;

    type Cpu = Autodiff<NdArray<f32>>;

    #[test]
    fn a_backward_pass_that_works_gives_its_gradients() {
        let x = Tensor::<Cpu, 1>::from_data(TensorData::from([1.0f32, 2.0]), &Default::default())
            .require_grad();
        let grads = gradients_of(&x.clone().powi_scalar(2).sum()).expect("gradients");
        let dx: Vec<f32> = x.grad(&grads).unwrap().to_data().to_vec().unwrap();
        assert_eq!(dx, [2.0, 4.0]);
    }

    #[test]
    fn a_pass_that_panics_is_an_error_with_the_panic_message() {
        let formatted = guarded(|| -> u8 { panic!("attention backward: {}", "rank 1 is gone") });
        let text = formatted.unwrap_err().to_string();
        assert!(
            text.contains("attention backward: rank 1 is gone"),
            "{text}"
        );
        let literal = guarded(|| -> u8 { panic!("a literal message") });
        assert!(literal
            .unwrap_err()
            .to_string()
            .contains("a literal message"));
    }
}
