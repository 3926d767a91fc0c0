//! Test tensors from f64 values and back, in any float type: what a tensor holds after rounding
//! is what the reference must start from.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};

/// A tensor of `dtype` holding `data`; returns it and the values it holds (after rounding).
pub fn upload<B: Backend, const D: usize>(
    data: Vec<f64>,
    shape: [usize; D],
    dtype: DType,
    device: &B::Device,
) -> (Tensor<B, D>, Vec<f64>) {
    let t = Tensor::<B, D>::from_data(TensorData::new(data, shape), device)
        .cast(DType::F32)
        .cast(dtype);
    let held = host(t.clone());
    (t, held)
}

/// A tensor's values on the host, as f64 (read through f32, exact for every float type).
pub fn host<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f64> {
    t.cast(DType::F32)
        .into_data()
        .convert::<f64>()
        .to_vec::<f64>()
        .expect("f64 data")
}
