//! The learning-rate schedule: linear warm-up, then cosine decay to a floor.

use core::f64::consts::PI;

/// Learning rate at `step` (0-based) of `total` steps: rises linearly to `peak` over `warmup`
/// steps, then follows a cosine down to `peak * min_ratio` at the last step.
pub fn learning_rate(step: u64, total: u64, warmup: u64, peak: f64, min_ratio: f64) -> f64 {
    if step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    let decay_steps = total.saturating_sub(warmup).max(1);
    let progress = ((step - warmup) as f64 / decay_steps as f64).min(1.0);
    let floor = peak * min_ratio;
    floor + (peak - floor) * 0.5 * (1.0 + (PI * progress).cos())
}

#[cfg(test)]
mod tests {
    use super::learning_rate;

    #[test]
    fn warms_up_linearly_then_decays_to_the_floor() {
        assert!((learning_rate(0, 100, 10, 1.0, 0.1) - 0.1).abs() < 1e-12);
        assert!((learning_rate(9, 100, 10, 1.0, 0.1) - 1.0).abs() < 1e-12);
        assert!((learning_rate(10, 100, 10, 1.0, 0.1) - 1.0).abs() < 1e-12);
        assert!((learning_rate(55, 100, 10, 1.0, 0.1) - 0.55).abs() < 1e-12);
        assert!((learning_rate(100, 100, 10, 1.0, 0.1) - 0.1).abs() < 1e-12);
        assert!((learning_rate(500, 100, 10, 1.0, 0.1) - 0.1).abs() < 1e-12);
    }
}
