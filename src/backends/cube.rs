//! The CubeCL backends (CUDA, wgpu, any CubeCL runtime): the op runs this project's kernels.

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use distflash_kernels::{DeviceTensor, ElemType, StepOptions, Variant};

use crate::backend::FlashAttentionBackend;
use crate::options::FlashAttentionOptions;

/// The kernel element type of a Burn float dtype.
pub fn elem_type(dtype: DType) -> Option<ElemType> {
    match dtype {
        DType::F16 => Some(ElemType::F16),
        DType::BF16 => Some(ElemType::BF16),
        DType::F32 => Some(ElemType::F32),
        _ => None,
    }
}

fn dtype_of(elem: ElemType) -> DType {
    match elem {
        ElemType::F16 => DType::F16,
        ElemType::BF16 => DType::BF16,
        ElemType::F32 => DType::F32,
    }
}

/// A contiguous view of a cube tensor as the kernels take it.
fn device_tensor<R: CubeRuntime>(tensor: CubeTensor<R>) -> DeviceTensor {
    let tensor = into_contiguous(tensor);
    let elem = elem_type(tensor.dtype).unwrap_or_else(|| {
        panic!(
            "flash attention supports f16, bf16 and f32 tensors, got {:?}",
            tensor.dtype
        )
    });
    DeviceTensor {
        handle: tensor.handle.clone(),
        shape: tensor.shape().to_vec(),
        elem,
    }
}

/// Wraps a kernel output as a cube tensor on the device of `like`.
fn cube_tensor<R: CubeRuntime>(like: &CubeTensor<R>, tensor: DeviceTensor) -> CubeTensor<R> {
    CubeTensor::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        Shape::from(tensor.shape),
        tensor.handle,
        dtype_of(tensor.elem),
    )
}

fn step_options(options: &FlashAttentionOptions) -> StepOptions {
    StepOptions {
        mask: options.mask(),
        scale: options.scale.map(|s| s as f32),
        variant: Variant::Auto,
    }
}

impl<R, F, I, BT> FlashAttentionBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn lse_dtype(_input: DType) -> DType {
        DType::F32
    }

    fn flash_attention(
        q: CubeTensor<R>,
        k: CubeTensor<R>,
        v: CubeTensor<R>,
        options: FlashAttentionOptions,
    ) -> (CubeTensor<R>, CubeTensor<R>) {
        let like = q.clone();
        let (q, k, v) = (device_tensor(q), device_tensor(k), device_tensor(v));
        let (out, lse) =
            distflash_kernels::attention(&like.client, &q, &k, &v, &step_options(&options))
                .unwrap_or_else(|e| panic!("flash attention: {e}"));
        (cube_tensor(&like, out), cube_tensor(&like, lse))
    }

    fn flash_attention_backward(
        q: CubeTensor<R>,
        k: CubeTensor<R>,
        v: CubeTensor<R>,
        out: CubeTensor<R>,
        lse: CubeTensor<R>,
        grad_out: CubeTensor<R>,
        options: FlashAttentionOptions,
    ) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
        let like = q.clone();
        let client = like.client.clone();
        let (dq, dk, dv) = distflash_kernels::attention_backward(
            &client,
            &device_tensor(q),
            &device_tensor(k),
            &device_tensor(v),
            &device_tensor(out),
            &device_tensor(lse),
            &device_tensor(grad_out),
            &step_options(&options),
        )
        .unwrap_or_else(|e| panic!("flash attention backward: {e}"));
        (
            cube_tensor(&like, dq),
            cube_tensor(&like, dk),
            cube_tensor(&like, dv),
        )
    }
}
