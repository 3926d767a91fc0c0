//! The CubeCL backends (CUDA, wgpu, any CubeCL runtime): the op runs this project's kernels.

use crate::Error;
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use distflash_kernels::{
    AttentionDims, DeviceTensor, ElemType, GradAccumulators, SoftmaxState, StepOptions, Variant,
};

use super::cube_accumulators::{exclusive, AccumulatorRows};
use crate::cube_support::contiguous;
use crate::extension::{
    AttentionBackend, CheckpointBackend, LayerOpsBackend, SequenceParallelBackend,
};
use crate::layer_ops;
use crate::options::FlashAttentionOptions;
use crate::step::{self, AttentionState, StepRows};

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

/// The kernels' options of a call: the crate boundary, where the one options value of the
/// plugin becomes the kernels' (which also pick the variant: `Auto`).
fn step_options(options: &FlashAttentionOptions) -> StepOptions {
    StepOptions {
        mask: options.mask.clone(),
        scale: options.scale,
        variant: Variant::Auto,
        deterministic: options.deterministic,
    }
}

/// The kernels' view of a state `(o, m, l)` that they write in place (from [`exclusive`]): its
/// own buffers, never copies ([`in_place`], which panics on a tensor that is not contiguous).
fn in_place_state<R: CubeRuntime>(
    o: &CubeTensor<R>,
    m: &CubeTensor<R>,
    l: &CubeTensor<R>,
) -> SoftmaxState {
    SoftmaxState {
        o: in_place(o),
        m: in_place(m),
        l: in_place(l),
    }
}

/// The kernels' view of a tensor they write in place (from [`exclusive`]): its own buffer.
///
/// # Panics
/// If the tensor is not contiguous (its view would be a copy that takes the writes).
fn in_place<R: CubeRuntime>(tensor: &CubeTensor<R>) -> DeviceTensor {
    assert!(
        tensor.is_contiguous(),
        "flash attention: a tensor written in place must be contiguous, got shape {:?} with \
         strides {:?}",
        tensor.shape(),
        tensor.meta.strides()
    );
    device_tensor(tensor.clone())
}

/// The kernels' view of a state `(o, m, l)` (contiguous copies where needed: read-only use).
fn state_view<R: CubeRuntime>(
    o: &CubeTensor<R>,
    m: &CubeTensor<R>,
    l: &CubeTensor<R>,
) -> SoftmaxState {
    SoftmaxState {
        o: device_tensor(o.clone()),
        m: device_tensor(m.clone()),
        l: device_tensor(l.clone()),
    }
}

/// A kernel-made f32 state `(o, m, l)` as the backend's tensors on `device`.
fn cube_state<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    client: &cubecl::prelude::ComputeClient<R>,
    device: &R::Device,
    state: SoftmaxState,
) -> AttentionState<CubeBackend<R, F, I, BT>> {
    let wrap = |t: DeviceTensor| {
        CubeTensor::new_contiguous(
            client.clone(),
            device.clone(),
            Shape::from(t.shape),
            t.handle,
            DType::F32,
        )
    };
    AttentionState {
        o: wrap(state.o),
        m: wrap(state.m),
        l: wrap(state.l),
    }
}

fn fail(what: &str, e: distflash_kernels::KernelError) -> ! {
    panic!("flash attention {what}: {e}")
}

/// The kernels' backward step of `[q, k, v]` with the query rows' `[dO, lse, delta]`, adding
/// into `grads`.
fn add_backward_step<R: CubeRuntime>(
    client: &cubecl::prelude::ComputeClient<R>,
    [q, k, v]: [DeviceTensor; 3],
    [grad_out, lse, delta]: [DeviceTensor; 3],
    grads: &GradAccumulators,
    options: &FlashAttentionOptions,
) {
    let options = step_options(options);
    distflash_kernels::backward_step(client, &q, &k, &v, &grad_out, &lse, &delta, grads, &options)
        .unwrap_or_else(|e| fail("backward step", e));
}

impl<R, F, I, BT> AttentionBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn lse_dtype(_input: DType) -> DType {
        DType::F32
    }

    fn check_attention_limits(
        dims: &AttentionDims,
        dtype: DType,
        device: &R::Device,
        options: &FlashAttentionOptions,
    ) -> Result<(), Error> {
        let elem = elem_type(dtype).ok_or_else(|| Error::DType {
            tensor: "q".into(),
            expected: "f16, bf16 or f32, the float types the kernels run".into(),
            got: format!("{dtype:?}"),
        })?;
        distflash_kernels::check_launch(&R::client(device), dims, elem, &step_options(options))?;
        Ok(())
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

    fn attention_state_empty(
        shape: [usize; 4],
        _input: DType,
        device: &R::Device,
    ) -> AttentionState<Self> {
        let client = R::client(device);
        let [b, h, s, d] = shape;
        let st =
            SoftmaxState::empty(&client, b, h, s, d).unwrap_or_else(|e| fail("empty state", e));
        cube_state(&client, device, st)
    }

    fn attention_forward_step(
        q: CubeTensor<R>,
        k: CubeTensor<R>,
        v: CubeTensor<R>,
        state: AttentionState<Self>,
        options: FlashAttentionOptions,
    ) -> AttentionState<Self> {
        let (o, m, l) = (exclusive(state.o), exclusive(state.m), exclusive(state.l));
        let client = q.client.clone();
        distflash_kernels::forward_step(
            &client,
            &device_tensor(q),
            &device_tensor(k),
            &device_tensor(v),
            &in_place_state(&o, &m, &l),
            &step_options(&options),
        )
        .unwrap_or_else(|e| fail("forward step", e));
        AttentionState { o, m, l }
    }

    fn attention_forward_first_step(
        q: CubeTensor<R>,
        k: CubeTensor<R>,
        v: CubeTensor<R>,
        options: FlashAttentionOptions,
    ) -> AttentionState<Self> {
        let (client, device) = (q.client.clone(), q.device.clone());
        let state = distflash_kernels::forward_first_step(
            &client,
            &device_tensor(q),
            &device_tensor(k),
            &device_tensor(v),
            &step_options(&options),
        )
        .unwrap_or_else(|e| fail("first forward step", e));
        cube_state(&client, &device, state)
    }

    fn attention_merge(a: AttentionState<Self>, b: AttentionState<Self>) -> AttentionState<Self> {
        let (o, m, l) = (exclusive(a.o), exclusive(a.m), exclusive(a.l));
        let client = o.client.clone();
        distflash_kernels::merge(
            &client,
            &in_place_state(&o, &m, &l),
            &state_view(&b.o, &b.m, &b.l),
        )
        .unwrap_or_else(|e| fail("merge", e));
        AttentionState { o, m, l }
    }

    fn attention_finalize(
        state: AttentionState<Self>,
        output: DType,
    ) -> (CubeTensor<R>, CubeTensor<R>) {
        let like = state.o.clone();
        let elem = elem_type(output).unwrap_or_else(|| {
            panic!("flash attention supports f16, bf16 and f32 outputs, got {output:?}")
        });
        let (out, lse) = distflash_kernels::finalize(
            &like.client,
            &state_view(&state.o, &state.m, &state.l),
            elem,
        )
        .unwrap_or_else(|e| fail("finalize", e));
        (cube_tensor(&like, out), cube_tensor(&like, lse))
    }

    fn attention_delta(out: CubeTensor<R>, grad_out: CubeTensor<R>) -> CubeTensor<R> {
        let like = out.clone();
        let delta = distflash_kernels::backward_delta(
            &like.client,
            &device_tensor(out),
            &device_tensor(grad_out),
        )
        .unwrap_or_else(|e| fail("delta", e));
        cube_tensor(&like, delta)
    }

    fn attention_backward_step(
        q: CubeTensor<R>,
        k: CubeTensor<R>,
        v: CubeTensor<R>,
        grad_out: CubeTensor<R>,
        lse: CubeTensor<R>,
        delta: CubeTensor<R>,
        options: FlashAttentionOptions,
    ) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
        let like = q.clone();
        let client = like.client.clone();
        let (q, k, v) = (device_tensor(q), device_tensor(k), device_tensor(v));
        let dims = AttentionDims::from_qkv(&q.shape, &k.shape, &v.shape)
            .unwrap_or_else(|e| fail("backward step", e));
        let grads =
            GradAccumulators::zeros(&client, &dims).unwrap_or_else(|e| fail("backward step", e));
        let rows = [grad_out, lse, delta].map(device_tensor);
        add_backward_step(&client, [q, k, v], rows, &grads, &options);
        (
            cube_tensor(&like, grads.dq),
            cube_tensor(&like, grads.dk),
            cube_tensor(&like, grads.dv),
        )
    }

    /// Each chunk contiguous ([`contiguous`]: a copy of its rows unless `batch x heads` is 1),
    /// so the kernels read it as it is.
    fn attention_chunks(t: CubeTensor<R>, chunks: usize) -> Vec<CubeTensor<R>> {
        if chunks == 1 {
            return vec![t];
        }
        (step::chunk_slices::<Self>(t, chunks).into_iter())
            .map(contiguous)
            .collect()
    }

    /// The kernels add into the accumulators themselves ([`AccumulatorRows`]): no gradient of
    /// the pair's size is made beside them when the step covers all their rows.
    fn attention_backward_step_add(
        q: CubeTensor<R>,
        k: CubeTensor<R>,
        v: CubeTensor<R>,
        grad_out: CubeTensor<R>,
        lse: CubeTensor<R>,
        delta: CubeTensor<R>,
        (dq, dk, dv): (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>),
        rows: &StepRows,
        options: FlashAttentionOptions,
    ) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
        let client = q.client.clone();
        let targets = [(dq, &rows.query), (dk, &rows.kv), (dv, &rows.kv)]
            .map(|(accumulator, rows)| AccumulatorRows::new::<Self>(accumulator, rows));
        let grads = GradAccumulators {
            dq: in_place(targets[0].target()),
            dk: in_place(targets[1].target()),
            dv: in_place(targets[2].target()),
        };
        let (inputs, rows) = ([q, k, v], [grad_out, lse, delta]);
        let (inputs, rows) = (inputs.map(device_tensor), rows.map(device_tensor));
        add_backward_step(&client, inputs, rows, &grads, &options);
        // The kernels' handles go before the rows are written back, which is then in place.
        drop(grads);
        let [dq, dk, dv] = targets.map(AccumulatorRows::finish::<Self>);
        (dq, dk, dv)
    }
}

impl<R, F, I, BT> SequenceParallelBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    computes_itself!();
}

/// The layers' element-wise operations as one CubeCL pass each (`layer_ops::cube`), the tensor
/// operations where a pass does not apply; the product is the trait's (cuBLAS on CUDA).
impl<R, F, I, BT> LayerOpsBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn swiglu(gate: CubeTensor<R>, up: CubeTensor<R>) -> CubeTensor<R> {
        match layer_ops::cube::swiglu(gate.clone(), up.clone()) {
            Some(hidden) => hidden,
            None => layer_ops::tensor_ops::swiglu::<Self>(gate, up),
        }
    }

    fn swiglu_backward(
        gate: CubeTensor<R>,
        up: CubeTensor<R>,
        dhidden: CubeTensor<R>,
    ) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
        match layer_ops::cube::swiglu_backward(gate.clone(), up.clone(), dhidden.clone()) {
            Some([hidden, dgate, dup]) => (hidden, dgate, dup),
            None => layer_ops::tensor_ops::swiglu_backward::<Self>(gate, up, dhidden),
        }
    }

    fn rms_norm(x: CubeTensor<R>, weight: CubeTensor<R>, eps: f64) -> CubeTensor<R> {
        match layer_ops::cube::rms_norm(x.clone(), weight.clone(), eps) {
            Some(out) => out,
            None => layer_ops::tensor_ops::rms_norm::<Self>(x, weight, eps),
        }
    }

    fn rms_norm_backward(
        x: CubeTensor<R>,
        weight: CubeTensor<R>,
        grad: CubeTensor<R>,
        eps: f64,
    ) -> (CubeTensor<R>, CubeTensor<R>) {
        match layer_ops::cube::rms_norm_backward(x.clone(), weight.clone(), grad.clone(), eps) {
            Some([dx, dweight]) => (dx, dweight),
            None => layer_ops::tensor_ops::rms_norm_backward::<Self>(x, weight, grad, eps),
        }
    }

    fn rotary(
        x: CubeTensor<R>,
        cos: CubeTensor<R>,
        sin: CubeTensor<R>,
        transpose: bool,
    ) -> CubeTensor<R> {
        match layer_ops::cube::rotary(x.clone(), cos.clone(), sin.clone(), transpose) {
            Some(out) => out,
            None => layer_ops::tensor_ops::rotary::<Self>(x, cos, sin, transpose),
        }
    }
}

/// No autodiff: a checkpointed segment just runs (the trait's default).
impl<R, F, I, BT> CheckpointBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
}
