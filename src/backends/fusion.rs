//! `Fusion<B>` (what `burn-cuda` and `burn-wgpu` give with their default features): the op is
//! registered as a custom operation of the fusion stream and runs the inner backend's op when the
//! stream executes.

use core::marker::PhantomData;

use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape};
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionBackend, FusionTensor};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};

use distflash_kernels::AttentionDims;

use crate::backend::FlashAttentionBackend;
use crate::options::{AttentionError, FlashAttentionOptions};

/// Forward: inputs q, k, v; outputs O, lse.
#[derive(Debug)]
struct ForwardOp<B> {
    desc: CustomOpIr,
    options: FlashAttentionOptions,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + FlashAttentionBackend> Operation<B::FusionRuntime> for ForwardOp<B> {
    fn execute(&self, handles: &mut HandleContainer<B::Handle>) {
        let ([q, k, v], [out, lse]) = self.desc.as_fixed::<3, 2>();
        let (o, l) = B::flash_attention(
            handles.get_float_tensor::<B>(q),
            handles.get_float_tensor::<B>(k),
            handles.get_float_tensor::<B>(v),
            self.options,
        );
        handles.register_float_tensor::<B>(&out.id, o);
        handles.register_float_tensor::<B>(&lse.id, l);
    }
}

/// Backward: inputs q, k, v, O, lse, dO; outputs dq, dk, dv.
#[derive(Debug)]
struct BackwardOp<B> {
    desc: CustomOpIr,
    options: FlashAttentionOptions,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + FlashAttentionBackend> Operation<B::FusionRuntime> for BackwardOp<B> {
    fn execute(&self, handles: &mut HandleContainer<B::Handle>) {
        let ([q, k, v, out, lse, grad_out], [dq, dk, dv]) = self.desc.as_fixed::<6, 3>();
        let get = |h: &mut HandleContainer<B::Handle>, t: &TensorIr| h.get_float_tensor::<B>(t);
        let (gq, gk, gv) = B::flash_attention_backward(
            get(handles, q),
            get(handles, k),
            get(handles, v),
            get(handles, out),
            get(handles, lse),
            get(handles, grad_out),
            self.options,
        );
        handles.register_float_tensor::<B>(&dq.id, gq);
        handles.register_float_tensor::<B>(&dk.id, gk);
        handles.register_float_tensor::<B>(&dv.id, gv);
    }
}

/// An output of `like`'s client with the given shape and type.
fn output_like<B: FusionBackend>(
    like: &FusionTensor<B::FusionRuntime>,
    shape: Shape,
    dtype: DType,
) -> TensorIr {
    TensorIr::uninit(like.client.create_empty_handle(), shape, dtype)
}

impl<B: FusionBackend + FlashAttentionBackend> FlashAttentionBackend for Fusion<B> {
    fn lse_dtype(input: DType) -> DType {
        B::lse_dtype(input)
    }

    fn check_attention_limits(
        dims: &AttentionDims,
        dtype: DType,
        device: &B::Device,
    ) -> Result<(), AttentionError> {
        B::check_attention_limits(dims, dtype, device)
    }

    fn flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let streams = OperationStreams::with_inputs([&q, &k, &v]);
        let client = q.client.clone();
        let dims = q.shape.dims::<4>();
        let out = output_like::<B>(&q, q.shape.clone(), q.dtype);
        let lse = output_like::<B>(
            &q,
            Shape::new([dims[0], dims[1], dims[2]]),
            B::lse_dtype(q.dtype),
        );
        let desc = CustomOpIr::new(
            "distflash_attention_forward",
            &[q.into_ir(), k.into_ir(), v.into_ir()],
            &[out, lse],
        );
        let op = ForwardOp::<B> {
            desc: desc.clone(),
            options,
            _backend: PhantomData,
        };
        let [out, lse]: [FusionTensor<B::FusionRuntime>; 2] = client
            .register(streams, OperationIr::Custom(desc), op)
            .try_into()
            .expect("two outputs");
        (out, lse)
    }

    fn flash_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad_out: FloatTensor<Self>,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let streams = OperationStreams::with_inputs([&q, &k, &v, &out, &lse, &grad_out]);
        let client = q.client.clone();
        let dq = output_like::<B>(&q, q.shape.clone(), q.dtype);
        let dk = output_like::<B>(&q, k.shape.clone(), k.dtype);
        let dv = output_like::<B>(&q, v.shape.clone(), v.dtype);
        let desc = CustomOpIr::new(
            "distflash_attention_backward",
            &[
                q.into_ir(),
                k.into_ir(),
                v.into_ir(),
                out.into_ir(),
                lse.into_ir(),
                grad_out.into_ir(),
            ],
            &[dq, dk, dv],
        );
        let op = BackwardOp::<B> {
            desc: desc.clone(),
            options,
            _backend: PhantomData,
        };
        let [dq, dk, dv]: [FusionTensor<B::FusionRuntime>; 3] = client
            .register(streams, OperationIr::Custom(desc), op)
            .try_into()
            .expect("three outputs");
        (dq, dk, dv)
    }
}
