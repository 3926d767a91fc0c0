//! Collectives on NCCL's own kernels for [`NcclTransport`]: `ncclAllReduce` (sum),
//! `ncclReduceScatter` (sum) and `ncclAllGather`, one per call, waited for (within the group's
//! timeout) before the call returns.
//!
//! As in an exchange: the input is made contiguous and the output allocated on the rank's device,
//! both are kept alive until NCCL is done, and the calling thread's compute stream is
//! host-synchronised before NCCL reads or writes them. An all-reduce runs in place (NCCL's
//! `sendbuff == recvbuff`) when the caller handed over the input's only handle; reduce-scatter and
//! all-gather write a buffer of their own. Sums are NCCL's, in the tensor's type (bf16 and f16
//! included) and in an order NCCL's algorithm picks: the same on every rank in practice (its ring
//! and tree all-reduces sum each element once and broadcast it), but not bitwise the in-process
//! transport's rank-ordered sums.
//! The ranks' calls are not compared: a peer that calls something else leaves this rank waiting
//! until the timeout aborts the communicator.

use crate::Error;
use std::time::Instant;

use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::{BoolElement, FloatElement, IntElement};
use cubecl::cuda::CudaRuntime;
use cubecl::Runtime;
use cudarc::nccl::sys as nccl;

use super::exchange::{device_pointer, InFlight, Op};
use super::{empty_contiguous, Cube, CudaTensor, NcclTransport};
use crate::collective::collectives::Collective;
use crate::collective::{MessageKind, TensorLayout};

impl<F, I, BT> NcclTransport<F, I, BT>
where
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    /// Runs `collective` on `tensor` and waits for it (see the module's documentation).
    pub(super) fn collective(
        &self,
        collective: Collective,
        tensor: CudaTensor,
    ) -> Result<CudaTensor, Error> {
        let posted_at = Instant::now();
        let layout = TensorLayout {
            shape: tensor.shape().to_vec(),
            dtype: tensor.dtype,
        };
        collective.check(&layout, self.world_size)?;
        let datatype = datatype(layout.dtype);
        self.check_usable()?;
        let input = self.prepare_send(tensor)?;
        let shape = collective.output_shape(&layout.shape, self.world_size);
        let count = layout.shape.iter().product::<usize>();
        if self.world_size == 1 || count == 0 {
            return Ok(<Cube<F, I, BT>>::float_reshape(input, Shape::from(shape)));
        }
        let client = CudaRuntime::client(&self.device);
        let output = if collective == Collective::AllReduce && input.can_mut() {
            input.clone()
        } else {
            let layout = TensorLayout {
                shape,
                dtype: layout.dtype,
            };
            empty_contiguous(&client, &self.device, &layout)
        };
        let size = layout.dtype.size();
        let out_count = output.shape().num_elements();
        let mut work = InFlight::default();
        let send = device_pointer(&client, &input.handle, count * size, &mut work.keep)?;
        let recv = device_pointer(&client, &output.handle, out_count * size, &mut work.keep)?;
        work.keep.push(Box::new(input));
        work.keep.push(Box::new(output.clone()));
        let (op, kind) = match collective {
            Collective::AllReduce => (
                Op::AllReduce {
                    send,
                    recv,
                    count,
                    datatype,
                },
                MessageKind::Reduction,
            ),
            Collective::ReduceScatter => (
                Op::ReduceScatter {
                    send,
                    recv,
                    count: out_count,
                    datatype,
                },
                MessageKind::Reduction,
            ),
            Collective::AllGather => (
                Op::AllGather {
                    send,
                    recv,
                    count,
                    datatype,
                },
                MessageKind::Gathered,
            ),
        };
        // Every kernel that wrote the input, or last used the output's memory, is done.
        self.sync_compute(&client)?;
        // NCCL does not say which peer is silent: a timeout names the next rank.
        let blame = ((self.rank + 1) % self.world_size, kind);
        self.run(&[op], &mut work, blame, posted_at)?;
        Ok(output)
    }
}

/// NCCL's element type for a float type [`Collective::check`] accepted.
fn datatype(dtype: DType) -> nccl::ncclDataType_t {
    match dtype {
        DType::F64 => nccl::ncclDataType_t::ncclFloat64,
        DType::F16 => nccl::ncclDataType_t::ncclFloat16,
        DType::BF16 => nccl::ncclDataType_t::ncclBfloat16,
        _ => nccl::ncclDataType_t::ncclFloat32,
    }
}
