//! Comparing results with the oracle: the largest difference and the tolerance rule.

use distflash_kernels::ElemType;

/// Largest absolute difference between two equally long slices; `inf` where one side is
/// non-finite and the other is not (so a NaN poisons the comparison instead of hiding).
pub fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "compared slices differ in length");
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            if x == y {
                0.0
            } else if x.is_finite() && y.is_finite() {
                (x - y).abs()
            } else {
                f64::INFINITY
            }
        })
        .fold(0.0, f64::max)
}

/// The tolerance rule: the kernel's error against the exact reference must be at most twice the
/// error of the naive computation in the kernel's precision, plus a small absolute slack scaled
/// by the magnitude of the reference. Panics naming `what` otherwise.
pub fn assert_close(what: &str, got: &[f64], exact: &[f64], naive: &[f64], elem: ElemType) {
    let naive_err = max_abs_diff(naive, exact);
    let err = max_abs_diff(got, exact);
    let magnitude = exact
        .iter()
        .filter(|x| x.is_finite())
        .fold(1.0f64, |a, x| a.max(x.abs()));
    let atol = match elem {
        ElemType::F32 => 1e-5,
        ElemType::F16 | ElemType::BF16 => 1e-3,
    } * magnitude;
    assert!(
        err <= 2.0 * naive_err + atol,
        "{what} ({elem:?}): max error {err:.3e} exceeds 2 x naive {naive_err:.3e} + atol {atol:.1e}"
    );
}
