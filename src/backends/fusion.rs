//! `Fusion<B>` (what `burn-cuda` and `burn-wgpu` give with their default features): the op and
//! the step operations of the sequence-parallel pass are registered as custom operations of the
//! fusion stream and run the inner backend's kernels when the stream executes (the trait's
//! tensor-op defaults would run the steps as Burn matmuls instead, TF32 for f32 on CUDA, with a
//! state in the input's float type).

use crate::Error;
use core::marker::PhantomData;

use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Device, Shape};
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{get_client, Fusion, FusionBackend, FusionTensor};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};

use distflash_kernels::AttentionDims;

use super::{fusion_group, fusion_product};
use crate::collective::DeviceGroup;
use crate::extension::{
    AttentionBackend, CheckpointBackend, FlashAttentionBackend, Grads, LayerOpsBackend,
    SequenceParallelBackend,
};
use crate::matmul::Transposed;
use crate::options::FlashAttentionOptions;
use crate::sequence_parallel::SequenceParallelOptions;
use crate::step::AttentionState;

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
            self.options.clone(),
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
            self.options.clone(),
        );
        handles.register_float_tensor::<B>(&dq.id, gq);
        handles.register_float_tensor::<B>(&dk.id, gk);
        handles.register_float_tensor::<B>(&dv.id, gv);
    }
}

/// Which step operation a [`StepOp`] runs on the inner backend, with its parameters.
#[derive(Debug, Clone)]
enum Step<D> {
    /// An empty state of query rows `[B, H, S, D]`; no inputs; outputs o, m, l.
    Empty([usize; 4], DType, D),
    /// Inputs q, k, v, o, m, l; outputs o, m, l.
    Forward(FlashAttentionOptions),
    /// Inputs the two states' o, m, l; outputs o, m, l.
    Merge,
    /// Inputs o, m, l; outputs O (of this float type), lse.
    Finalize(DType),
    /// Inputs O, dO; output delta.
    Delta,
    /// Inputs q, k, v, dO, lse, delta; outputs dq, dk, dv.
    Backward(FlashAttentionOptions),
}

/// One step operation of the sequence-parallel pass, run on the inner backend.
#[derive(Debug)]
struct StepOp<B: FusionBackend> {
    desc: CustomOpIr,
    step: Step<B::Device>,
}

/// The next input of a step.
fn take<T>(inputs: &mut impl Iterator<Item = T>) -> T {
    inputs.next().expect("a step input")
}

/// The next three inputs of a step as a state.
fn take_state<B: burn::tensor::backend::Backend>(
    inputs: &mut impl Iterator<Item = FloatTensor<B>>,
) -> AttentionState<B> {
    AttentionState {
        o: take(inputs),
        m: take(inputs),
        l: take(inputs),
    }
}

impl<B: FusionBackend + FlashAttentionBackend> Operation<B::FusionRuntime> for StepOp<B> {
    fn execute(&self, handles: &mut HandleContainer<B::Handle>) {
        let inputs: Vec<FloatTensor<B>> = (self.desc.inputs.iter())
            .map(|t| handles.get_float_tensor::<B>(t))
            .collect();
        let inputs = &mut inputs.into_iter();
        let outputs = match &self.step {
            Step::Empty(shape, dtype, device) => {
                state_tensors(B::attention_state_empty(*shape, *dtype, device))
            }
            Step::Forward(options) => {
                let (q, k, v) = (take(inputs), take(inputs), take(inputs));
                let state = take_state(inputs);
                state_tensors(B::attention_forward_step(q, k, v, state, options.clone()))
            }
            Step::Merge => {
                let a = take_state(inputs);
                let b = take_state(inputs);
                state_tensors(B::attention_merge(a, b))
            }
            Step::Finalize(output) => {
                let (out, lse) = B::attention_finalize(take_state(inputs), *output);
                vec![out, lse]
            }
            Step::Delta => {
                let (out, grad_out) = (take(inputs), take(inputs));
                vec![B::attention_delta(out, grad_out)]
            }
            Step::Backward(options) => {
                let (q, k, v) = (take(inputs), take(inputs), take(inputs));
                let (grad_out, lse, delta) = (take(inputs), take(inputs), take(inputs));
                let (dq, dk, dv) =
                    B::attention_backward_step(q, k, v, grad_out, lse, delta, options.clone());
                vec![dq, dk, dv]
            }
        };
        for (t, out) in self.desc.outputs.iter().zip(outputs) {
            handles.register_float_tensor::<B>(&t.id, out);
        }
    }
}

/// A state's tensors in input/output order.
fn state_tensors<B: burn::tensor::backend::Backend>(s: AttentionState<B>) -> Vec<FloatTensor<B>> {
    vec![s.o, s.m, s.l]
}

/// Registers `step` on `client`'s stream with `inputs`, and outputs of the given shapes and float
/// types; returns the outputs.
fn register_step<B: FusionBackend + FlashAttentionBackend>(
    client: &burn_fusion::Client<B::FusionRuntime>,
    name: &'static str,
    step: Step<B::Device>,
    inputs: Vec<FusionTensor<B::FusionRuntime>>,
    outputs: &[(Shape, DType)],
) -> Vec<FusionTensor<B::FusionRuntime>> {
    let streams = OperationStreams::with_inputs(&inputs);
    let outputs: Vec<TensorIr> = (outputs.iter())
        .map(|(shape, dtype)| TensorIr::uninit(client.create_empty_handle(), shape.clone(), *dtype))
        .collect();
    let inputs: Vec<TensorIr> = inputs.into_iter().map(|t| t.into_ir()).collect();
    let desc = CustomOpIr::new(name, &inputs, &outputs);
    let op = StepOp::<B> {
        desc: desc.clone(),
        step,
    };
    client.register(streams, OperationIr::Custom(desc), op)
}

/// A state from the three tensors a state step returns.
fn state_from<R: burn_fusion::FusionRuntime>(
    tensors: Vec<FusionTensor<R>>,
) -> [FusionTensor<R>; 3] {
    tensors.try_into().expect("three state tensors")
}

/// An output of `like`'s client with the given shape and type.
fn output_like<B: FusionBackend>(
    like: &FusionTensor<B::FusionRuntime>,
    shape: Shape,
    dtype: DType,
) -> TensorIr {
    TensorIr::uninit(like.client.create_empty_handle(), shape, dtype)
}

impl<B> SequenceParallelBackend for Fusion<B>
where
    B: FusionBackend + FlashAttentionBackend<Inner = B>,
{
    type Inner = B;

    fn inner_device(device: &Self::Device) -> Device<B> {
        device.clone()
    }

    fn sequence_parallel_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        group: &DeviceGroup<B>,
        options: &SequenceParallelOptions,
    ) -> Result<(FloatTensor<Self>, FloatTensor<Self>), Error> {
        fusion_group::attention::<B>(q, k, v, group, options)
    }

    fn sequence_parallel_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad_out: FloatTensor<Self>,
        group: &DeviceGroup<B>,
        options: &SequenceParallelOptions,
    ) -> Result<Grads<Self>, Error> {
        fusion_group::backward::<B>(q, k, v, out, lse, grad_out, group, options)
    }
}

/// The layers' operations from Burn tensor operations on the fusion stream (the trait's
/// defaults), which fusion may merge with their neighbours.
/// The element-wise operations are Burn tensor operations, which fusion fuses (the trait's
/// defaults); the products run on `B` (`fusion_product`).
impl<B> LayerOpsBackend for Fusion<B>
where
    B: FusionBackend + FlashAttentionBackend<Inner = B>,
{
    fn matrix_product(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        transposed: Transposed,
    ) -> FloatTensor<Self> {
        fusion_product::matrix_product::<B>(lhs, rhs, transposed)
    }
}

/// No autodiff: a checkpointed segment just runs (the trait's default).
impl<B> CheckpointBackend for Fusion<B> where B: FusionBackend + FlashAttentionBackend<Inner = B> {}

impl<B> AttentionBackend for Fusion<B>
where
    B: FusionBackend + FlashAttentionBackend<Inner = B>,
{
    fn lse_dtype(input: DType) -> DType {
        B::lse_dtype(input)
    }

    fn check_attention_limits(
        dims: &AttentionDims,
        dtype: DType,
        device: &B::Device,
        options: &FlashAttentionOptions,
    ) -> Result<(), Error> {
        B::check_attention_limits(dims, dtype, device, options)
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

    fn attention_state_empty(
        shape: [usize; 4],
        input: DType,
        device: &B::Device,
    ) -> AttentionState<Self> {
        let client = get_client::<B>(device);
        let stat = B::lse_dtype(input);
        let [b, h, s, _] = shape;
        let rows = Shape::new([b, h, s]);
        let [o, m, l] = state_from(register_step::<B>(
            &client,
            "distflash_state_empty",
            Step::Empty(shape, input, device.clone()),
            Vec::new(),
            &[
                (Shape::new(shape), stat),
                (rows.clone(), stat),
                (rows, stat),
            ],
        ));
        AttentionState { o, m, l }
    }

    fn attention_forward_step(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        state: AttentionState<Self>,
        options: FlashAttentionOptions,
    ) -> AttentionState<Self> {
        let client = q.client.clone();
        let shapes = state_shapes(&state);
        let [o, m, l] = state_from(register_step::<B>(
            &client,
            "distflash_forward_step",
            Step::Forward(options),
            vec![q, k, v, state.o, state.m, state.l],
            &shapes,
        ));
        AttentionState { o, m, l }
    }

    fn attention_merge(a: AttentionState<Self>, b: AttentionState<Self>) -> AttentionState<Self> {
        let client = a.o.client.clone();
        let shapes = state_shapes(&a);
        let [o, m, l] = state_from(register_step::<B>(
            &client,
            "distflash_merge",
            Step::Merge,
            vec![a.o, a.m, a.l, b.o, b.m, b.l],
            &shapes,
        ));
        AttentionState { o, m, l }
    }

    fn attention_finalize(
        state: AttentionState<Self>,
        output: DType,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let client = state.o.client.clone();
        let outputs = [
            (state.o.shape.clone(), output),
            (state.m.shape.clone(), state.m.dtype),
        ];
        let [out, lse]: [FusionTensor<B::FusionRuntime>; 2] = register_step::<B>(
            &client,
            "distflash_finalize",
            Step::Finalize(output),
            vec![state.o, state.m, state.l],
            &outputs,
        )
        .try_into()
        .expect("two outputs");
        (out, lse)
    }

    fn attention_delta(out: FloatTensor<Self>, grad_out: FloatTensor<Self>) -> FloatTensor<Self> {
        let client = out.client.clone();
        let [b, h, s, _] = out.shape.dims::<4>();
        let dtype = B::lse_dtype(out.dtype);
        register_step::<B>(
            &client,
            "distflash_delta",
            Step::Delta,
            vec![out, grad_out],
            &[(Shape::new([b, h, s]), dtype)],
        )
        .remove(0)
    }

    fn attention_backward_step(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        grad_out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        delta: FloatTensor<Self>,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let client = q.client.clone();
        let dtype = B::lse_dtype(q.dtype);
        let outputs = [
            (q.shape.clone(), dtype),
            (k.shape.clone(), dtype),
            (v.shape.clone(), dtype),
        ];
        let [dq, dk, dv] = state_from(register_step::<B>(
            &client,
            "distflash_backward_step",
            Step::Backward(options),
            vec![q, k, v, grad_out, lse, delta],
            &outputs,
        ));
        (dq, dk, dv)
    }
}

/// Shapes and float types of a state's o, m and l (a step's outputs match its state input).
fn state_shapes<B: FusionBackend>(state: &AttentionState<Fusion<B>>) -> [(Shape, DType); 3] {
    [
        (state.o.shape.clone(), state.o.dtype),
        (state.m.shape.clone(), state.m.dtype),
        (state.l.shape.clone(), state.l.dtype),
    ]
}
