//! [`TrainOptions::check`]: the optimisation settings a step can run with, refused with an
//! [`Error::Invalid`] naming the field before any work (never a silent empty batch, a NaN
//! learning rate or weights that flip sign).

use super::TrainOptions;
use crate::Error;

impl TrainOptions {
    /// Checks every setting: `batch` and `seq_len` at least 1; `lr`, `weight_decay` and
    /// `grad_clip` finite and not negative (`grad_clip` 0 turns clipping off); `lr *
    /// weight_decay` below 1 (AdamW shrinks the weights by that fraction each step);
    /// `min_lr_ratio` in `[0, 1]`; `beta_1` and `beta_2` in `[0, 1)`. A trainer checks its
    /// options at every step and evaluation.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] naming the first setting out of range, what is allowed and its value.
    pub fn check(&self) -> Result<(), Error> {
        let at_least_one = |name: &str, value: usize| match value {
            0 => Err(Error::invalid(
                format!("the training option `{name}`"),
                "at least 1",
                value,
            )),
            _ => Ok(()),
        };
        at_least_one("batch", self.batch)?;
        at_least_one("seq_len", self.seq_len)?;
        let in_range = |name: &str, value: f64, ok: bool, allowed: &str| match ok {
            true => Ok(()),
            false => Err(Error::invalid(
                format!("the training option `{name}`"),
                allowed,
                value,
            )),
        };
        let non_negative = |v: f64| v.is_finite() && v >= 0.0;
        let finite = "a finite number >= 0";
        in_range("lr", self.lr, non_negative(self.lr), finite)?;
        in_range(
            "weight_decay",
            self.weight_decay,
            non_negative(self.weight_decay),
            finite,
        )?;
        in_range(
            "grad_clip",
            self.grad_clip,
            non_negative(self.grad_clip),
            finite,
        )?;
        let shrink = self.lr * self.weight_decay;
        in_range(
            "lr * weight_decay",
            shrink,
            shrink < 1.0,
            "below 1 (AdamW shrinks the weights by this fraction each step)",
        )?;
        let ratio = self.min_lr_ratio;
        in_range(
            "min_lr_ratio",
            ratio,
            (0.0..=1.0).contains(&ratio),
            "in [0, 1]",
        )?;
        let beta = |v: f64| (0.0..1.0).contains(&v);
        in_range("beta_1", self.beta_1, beta(self.beta_1), "in [0, 1)")?;
        in_range("beta_2", self.beta_2, beta(self.beta_2), "in [0, 1)")
    }
}
