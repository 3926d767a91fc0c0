//! Conversions between the oracle's f64 data and the f32 the devices upload and download.

/// Converts to f32 for upload.
pub fn to_f32(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

/// Converts a download to f64.
pub fn to_f64(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}
