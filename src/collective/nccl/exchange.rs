//! Moving bytes: NCCL operations posted in one group on the communication stream, the bounded
//! wait for them (aborting on timeout or failure), the in-flight exchange, and the all-gather of
//! host values.

use crate::Error;
use std::ffi::{c_int, c_void};
use std::time::{Duration, Instant};

use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::{BoolElement, FloatElement, IntElement};
use cubecl::client::ComputeClient;
use cubecl::cuda::CudaRuntime;
use cubecl::server::Handle;
use cubecl::Runtime;
use cudarc::driver::{CudaEvent, CudaStream};
use cudarc::nccl::sys as nccl;

use super::library::{accepted, driver_error, nccl_error};
use super::wait::{backoff, wait_ready, NotReady};
use super::{is_float, Cube, CudaTensor, NcclTransport};
use crate::collective::{Exchange, Incoming, MessageKind, Received};

/// How long an aborted communicator's kernels get to stop before their buffers are leaked
/// rather than freed under them.
const ABORT_GRACE: Duration = Duration::from_secs(10);
/// How often a waiting rank asks NCCL whether the communicator failed (a peer's error).
const HEALTH_EVERY: Duration = Duration::from_millis(2);

impl<F, I, BT> NcclTransport<F, I, BT> {
    fn timeout_error(&self, blame: Blame, since: Instant) -> Error {
        Error::Timeout {
            rank: self.rank,
            peer: blame.0,
            kind: blame.1,
            waited: since.elapsed(),
        }
    }

    /// Posts `ops` in one NCCL group on the communication stream, waits (bounded) until NCCL
    /// has enqueued them, and records an event behind them. Aborts on failure.
    pub(super) fn post(
        &self,
        ops: &[Op],
        blame: Blame,
        posted_at: Instant,
    ) -> Result<CudaEvent, Error> {
        let deadline = posted_at + self.timeout;
        let state = self.lock();
        let comm = self.usable(&state)?;
        self.context
            .bind_to_thread()
            .map_err(|e| driver_error(&format!("rank {}: binding the context", self.rank), e))?;
        let stream = self.stream.cu_stream() as nccl::cudaStream_t;
        // SAFETY: plain NCCL call.
        accepted(unsafe { nccl::ncclGroupStart() })
            .map_err(|r| nccl_error("ncclGroupStart", r, comm))?;
        let mut failure = None;
        for op in ops {
            // SAFETY: the pointers address live device buffers of at least `bytes` bytes on
            // this rank's device, kept alive by the caller until the event completes.
            let result = unsafe {
                match *op {
                    Op::Send {
                        peer,
                        pointer,
                        bytes,
                    } => nccl::ncclSend(
                        pointer as *const c_void,
                        bytes,
                        nccl::ncclDataType_t::ncclUint8,
                        peer as c_int,
                        comm,
                        stream,
                    ),
                    Op::Recv {
                        peer,
                        pointer,
                        bytes,
                    } => nccl::ncclRecv(
                        pointer as *mut c_void,
                        bytes,
                        nccl::ncclDataType_t::ncclUint8,
                        peer as c_int,
                        comm,
                        stream,
                    ),
                    Op::AllGather {
                        send,
                        recv,
                        count,
                        datatype,
                    } => nccl::ncclAllGather(
                        send as *const c_void,
                        recv as *mut c_void,
                        count,
                        datatype,
                        comm,
                        stream,
                    ),
                    Op::AllReduce {
                        send,
                        recv,
                        count,
                        datatype,
                    } => nccl::ncclAllReduce(
                        send as *const c_void,
                        recv as *mut c_void,
                        count,
                        datatype,
                        nccl::ncclRedOp_t::ncclSum,
                        comm,
                        stream,
                    ),
                    Op::ReduceScatter {
                        send,
                        recv,
                        count,
                        datatype,
                    } => nccl::ncclReduceScatter(
                        send as *const c_void,
                        recv as *mut c_void,
                        count,
                        datatype,
                        nccl::ncclRedOp_t::ncclSum,
                        comm,
                        stream,
                    ),
                }
            };
            if let Err(r) = accepted(result) {
                failure = Some(nccl_error(
                    &format!(
                        "rank {}: posting {op:?} (an exchange with rank {})",
                        self.rank, blame.0
                    ),
                    r,
                    comm,
                ));
                break;
            }
        }
        // SAFETY: closes the group opened above.
        let end = accepted(unsafe { nccl::ncclGroupEnd() });
        if failure.is_none() {
            if let Err(r) = end {
                failure = Some(nccl_error(
                    &format!(
                        "rank {}: ncclGroupEnd (an exchange with rank {})",
                        self.rank, blame.0
                    ),
                    r,
                    comm,
                ));
            }
        }
        if failure.is_none() {
            failure = match wait_ready(&[comm], deadline) {
                Ok(()) => None,
                Err(NotReady::Timeout(_)) => Some(self.timeout_error(blame, posted_at)),
                Err(NotReady::Failed(_, r)) => Some(nccl_error(
                    &format!(
                        "rank {}: posting an exchange with rank {} ({:?})",
                        self.rank, blame.0, blame.1
                    ),
                    r,
                    comm,
                )),
            };
        }
        let recorded = match failure {
            None => self
                .stream
                .record_event(None)
                .map_err(|e| driver_error(&format!("rank {}: recording an event", self.rank), e)),
            Some(error) => Err(error),
        };
        drop(state);
        recorded.inspect_err(|error| self.abort(error.to_string()))
    }

    /// Posts `ops` for `work` (see [`post`](Self::post)); on failure the buffers are settled
    /// (see [`InFlight`]).
    pub(super) fn launch(
        &self,
        ops: &[Op],
        work: &mut InFlight,
        blame: Blame,
        posted_at: Instant,
    ) -> Result<(), Error> {
        work.pending = true;
        match self.post(ops, blame, posted_at) {
            Ok(event) => {
                work.event = Some(event);
                Ok(())
            }
            Err(error) => {
                work.settle_after_abort(&self.stream);
                Err(error)
            }
        }
    }

    /// [`launch`](Self::launch), then [`finish`](Self::finish): `ops` are done when it returns.
    pub(super) fn run(
        &self,
        ops: &[Op],
        work: &mut InFlight,
        blame: Blame,
        posted_at: Instant,
    ) -> Result<(), Error> {
        self.launch(ops, work, blame, posted_at)?;
        self.finish(work, blame, posted_at)
    }

    /// Waits for `work` to complete, at most until `posted_at + timeout`; on timeout or failure
    /// the communicator is aborted and the buffers are settled (see [`InFlight`]).
    fn finish(&self, work: &mut InFlight, blame: Blame, posted_at: Instant) -> Result<(), Error> {
        let deadline = posted_at + self.timeout;
        let started = Instant::now();
        let mut checked = started;
        let outcome = loop {
            let Some(event) = &work.event else {
                work.pending = false;
                return Ok(());
            };
            match event.try_is_complete() {
                Ok(true) => break Ok(()),
                Ok(false) => {}
                Err(e) => {
                    break Err(driver_error(
                        &format!("rank {}: waiting for the communication stream", self.rank),
                        e,
                    ))
                }
            }
            if checked.elapsed() >= HEALTH_EVERY {
                checked = Instant::now();
                if let Some(error) = self.health(blame.0, blame.1) {
                    break Err(error);
                }
            }
            if Instant::now() >= deadline {
                break Err(self.timeout_error(blame, posted_at));
            }
            backoff(started);
        };
        match outcome {
            Ok(()) => {
                work.pending = false;
                // A completed event on an aborted communicator says nothing about the data.
                self.check_usable()
            }
            Err(error) => {
                self.abort(error.to_string());
                work.settle_after_abort(&self.stream);
                Err(error)
            }
        }
    }

    /// All ranks' `bytes` (the same length everywhere), concatenated in rank order.
    pub(super) fn gather_bytes(&self, bytes: &[u8]) -> Result<Vec<u8>, Error> {
        let posted_at = Instant::now();
        self.check_usable()?;
        let client = CudaRuntime::client(&self.device);
        let send = client.create_from_slice(bytes);
        let recv = client.empty(bytes.len() * self.world_size);
        let mut work = InFlight::default();
        let send_pointer = device_pointer(&client, &send, bytes.len(), &mut work.keep)?;
        let recv_pointer = device_pointer(
            &client,
            &recv,
            bytes.len() * self.world_size,
            &mut work.keep,
        )?;
        work.keep.push(Box::new(send));
        work.keep.push(Box::new(recv.clone()));
        self.sync_compute(&client)?;
        let blame = (if self.rank == 0 { 1 } else { 0 }, MessageKind::Values);
        let op = Op::AllGather {
            send: send_pointer,
            recv: recv_pointer,
            count: bytes.len(),
            datatype: nccl::ncclDataType_t::ncclUint8,
        };
        self.run(&[op], &mut work, blame, posted_at)?;
        let gathered = client.read_one(recv).map_err(|e| {
            Error::Nccl(format!(
                "rank {}: reading the gathered values back: {e}",
                self.rank
            ))
        })?;
        let expected = bytes.len() * self.world_size;
        if gathered.len() < expected {
            return Err(Error::Nccl(format!(
                "rank {}: read {} gathered bytes back, expected {expected}",
                self.rank,
                gathered.len()
            )));
        }
        Ok(gathered[..expected].to_vec())
    }

    /// Host-waits for the calling thread's CubeCL stream on this device.
    pub(super) fn sync_compute(&self, client: &ComputeClient<CudaRuntime>) -> Result<(), Error> {
        cubecl::future::block_on(client.sync()).map_err(|e| {
            Error::Nccl(format!(
                "rank {}: synchronizing the compute stream before NCCL: {e}",
                self.rank
            ))
        })
    }

    /// A tensor to send, contiguous on this rank's device.
    pub(super) fn prepare_send(&self, tensor: CudaTensor) -> Result<CudaTensor, Error> {
        if tensor.device != self.device {
            return Err(Error::GroupSetup(format!(
                "rank {}: a tensor to send is on {:?}, but this rank computes on {:?}",
                self.rank, tensor.device, self.device
            )));
        }
        if tensor.qparams.is_some() || !is_float(tensor.dtype) {
            return Err(Error::GroupSetup(format!(
                "rank {}: the NCCL transport sends float tensors, got {:?}",
                self.rank, tensor.dtype
            )));
        }
        Ok(into_contiguous(tensor))
    }
}

/// Who a timeout blames: the peer and the kind of message expected from it.
type Blame = (usize, MessageKind);

/// One NCCL operation of a group, on device addresses; counts are in elements of `datatype`.
#[derive(Debug, Clone, Copy)]
pub(super) enum Op {
    Send {
        peer: usize,
        pointer: u64,
        bytes: usize,
    },
    Recv {
        peer: usize,
        pointer: u64,
        bytes: usize,
    },
    /// Every rank's `count` elements, concatenated in rank order into `recv`.
    AllGather {
        send: u64,
        recv: u64,
        count: usize,
        datatype: nccl::ncclDataType_t,
    },
    /// The sum over the ranks of `count` elements (`send == recv`: in place).
    AllReduce {
        send: u64,
        recv: u64,
        count: usize,
        datatype: nccl::ncclDataType_t,
    },
    /// This rank's `count` elements of the sum over the ranks of `count * P` elements.
    ReduceScatter {
        send: u64,
        recv: u64,
        count: usize,
        datatype: nccl::ncclDataType_t,
    },
}

/// The device address of `handle`'s memory (offsets applied), keeping the memory alive in `keep`.
pub(super) fn device_pointer(
    client: &ComputeClient<CudaRuntime>,
    handle: &Handle,
    bytes: usize,
    keep: &mut Vec<Box<dyn Send>>,
) -> Result<u64, Error> {
    let resource = client
        .get_resource(handle.clone())
        .map_err(|e| Error::Nccl(format!("could not get the device address of a buffer: {e}")))?;
    let (pointer, size) = (resource.resource().ptr, resource.resource().size);
    if (size as usize) < bytes {
        return Err(Error::Nccl(format!(
            "a buffer holds {size} bytes, fewer than the {bytes} its tensor needs"
        )));
    }
    keep.push(Box::new(resource));
    Ok(pointer)
}

/// GPU work posted on the communication stream, with everything it reads or writes.
#[derive(Default)]
pub(super) struct InFlight {
    /// Completes after the work; `None` when nothing was posted.
    pub(super) event: Option<CudaEvent>,
    /// Tensors, handles and resources the work uses.
    pub(super) keep: Vec<Box<dyn Send>>,
    /// Whether the work was posted and may still use the buffers (which must then not be
    /// freed).
    pub(super) pending: bool,
}

impl InFlight {
    /// After an abort: gives the kernels [`ABORT_GRACE`] to stop. If they do not, the buffers
    /// are leaked on drop rather than freed under a kernel that may still write into them.
    pub(super) fn settle_after_abort(&mut self, stream: &CudaStream) {
        if !self.pending {
            return;
        }
        let Ok(event) = stream.record_event(None) else {
            return;
        };
        let until = Instant::now() + ABORT_GRACE;
        while Instant::now() < until {
            match event.try_is_complete() {
                Ok(true) => {
                    self.pending = false;
                    return;
                }
                Ok(false) => std::thread::sleep(Duration::from_millis(1)),
                Err(_) => return,
            }
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.pending {
            std::mem::forget(std::mem::take(&mut self.keep));
        }
    }
}

/// A posted NCCL exchange: the operations run on the communication stream; [`Exchange::wait`]
/// waits for them and hands out the received tensors.
pub(super) struct NcclExchange<'a, F, I, BT> {
    pub(super) transport: &'a NcclTransport<F, I, BT>,
    pub(super) work: InFlight,
    pub(super) posted_at: Instant,
    pub(super) blame: Blame,
    pub(super) receives: Vec<Incoming>,
    pub(super) received: Vec<Vec<CudaTensor>>,
}

impl<F, I, BT> Drop for NcclExchange<'_, F, I, BT> {
    fn drop(&mut self) {
        if !self.work.pending {
            return;
        }
        match &self.work.event {
            None => self.work.pending = false,
            Some(event) if matches!(event.try_is_complete(), Ok(true)) => self.work.pending = false,
            Some(_) => {
                // The peers expect this exchange to complete; the group cannot go on.
                self.transport.abort(format!(
                    "rank {}: an exchange was dropped before it completed",
                    self.transport.rank
                ));
                self.work.settle_after_abort(&self.transport.stream);
            }
        }
    }
}

impl<F, I, BT> Exchange<Cube<F, I, BT>> for NcclExchange<'_, F, I, BT>
where
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn wait(mut self: Box<Self>) -> Result<Vec<Received<Cube<F, I, BT>>>, Error> {
        self.transport
            .finish(&mut self.work, self.blame, self.posted_at)?;
        let receives = std::mem::take(&mut self.receives);
        let received = std::mem::take(&mut self.received);
        Ok(receives
            .into_iter()
            .zip(received)
            .map(|(incoming, tensors)| Received {
                peer: incoming.peer,
                kind: incoming.kind,
                tensors,
            })
            .collect())
    }
}
