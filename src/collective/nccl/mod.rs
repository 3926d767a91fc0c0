//! NCCL transport for CUDA device groups: [`NcclTransport`], built through
//! [`DeviceGroup::nccl`] (one process, one rank per GPU, one host thread per rank) or
//! [`DeviceGroup::nccl_from_env`] / [`DeviceGroup::nccl_with_rendezvous`] (one process per GPU,
//! on one or many hosts, torchrun-style).
//!
//! How an exchange runs (see [`Transport::exchange`]):
//! 1. Sent tensors are made contiguous and receive buffers are allocated (contiguous, on the
//!    rank's device); their device addresses come from CubeCL's `get_resource`, which also keeps
//!    the memory alive until the exchange is done with it.
//! 2. The rank's CubeCL compute stream is host-synchronized (CubeCL's streams are internal, one
//!    per host thread, so the calling thread's stream is the one that wrote the sent tensors),
//!    unless the exchange moves no bytes (idle steps of a schedule).
//! 3. One `ncclSend`/`ncclRecv` per tensor (as bytes) is posted inside one NCCL group on a
//!    dedicated per-rank communication stream, and an event is recorded behind them.
//! 4. [`Exchange::wait`] polls that event. Kernels that read received tensors are launched after
//!    the wait returns, so they see the data.
//!
//! Collectives (`all_reduce`, `reduce_scatter`, `all_gather`: NCCL's own kernels) run the same
//! way, one operation per call, waited for before the call returns (see `collective`).
//!
//! Messages to or from the same peer are posted in `(peer, kind)` order on both sides, so a
//! sender and a receiver that list the same messages in different orders still match.
//! NCCL moves bytes only: unlike the in-process transport, layouts are not checked on the wire
//! (ranks are expected to agree on them; [`Transport::all_gather_values`] is the way to check).
//!
//! Never hanging: communicators are non-blocking (NCCL's `blocking = 0` config), so no NCCL
//! call blocks the host; every wait (communicator setup, posting, completion) is bounded by the
//! group's timeout. When it passes, the communicator is aborted (`ncclCommAbort`, which also
//! stops kernels waiting for a silent peer; waited for at most 10 s on a thread of its own, as
//! NCCL's abort may wait for peers that are gone) and the call fails with [`Error::Timeout`]; a
//! failure NCCL reports first (a peer process that exited) aborts it too, with an
//! [`Error::Nccl`] naming the peer waited for; every later call on that rank fails with
//! [`Error::Nccl`]. Peers' point-to-point
//! connections are set up eagerly at construction (one byte to and from every peer), so a
//! posted exchange never waits for a peer to connect.
//!
//! `NCCL_NVLS_ENABLE` is set to `0` when unset, before the first communicator is created: NVLink
//! multicast (NVLS) reserves NVSwitch multicast resources and extra memory per communicator, which
//! the shared GPU machines this crate runs on must not use; point-to-point traffic gains nothing
//! from it (collectives run on NCCL's other algorithms). Set the variable yourself (before building a group) to decide otherwise.
//!
//! libcuda and libnccl are loaded at run time (cudarc's dynamic loading); when either is missing,
//! constructors return [`Error::Nccl`] saying so instead of panicking.

mod rendezvous;

mod collective;
mod exchange;
mod library;
mod setup;
mod wait;

pub use library::{device_count, probe};
pub use rendezvous::{EnvConfig, RENDEZVOUS_PORT_VAR};

use crate::Error;
use std::marker::PhantomData;
use std::ptr::null_mut;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::client::ComputeClient;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::Runtime;
use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::sys as nccl;

use super::collectives::Collective;
use super::local::DEFAULT_TIMEOUT;
use super::{DeviceGroup, Exchange, Incoming, MessageKind, Outgoing, TensorLayout, Transport};
use exchange::{device_pointer, InFlight, NcclExchange, Op};
use library::nccl_error;
use wait::{async_state, finishes_within};

/// The CubeCL CUDA backend this transport serves.
type Cube<F, I, BT> = CubeBackend<CudaRuntime, F, I, BT>;
type CudaTensor = CubeTensor<CudaRuntime>;
/// Marks the element types without owning any (and stays `Send + Sync`).
type Elements<F, I, BT> = PhantomData<fn() -> (F, I, BT)>;

/// The raw communicator, `null` once aborted, with the reason.
struct CommState {
    raw: nccl::ncclComm_t,
    failure: Option<String>,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; the mutex
// around `CommState` serializes the calls.
unsafe impl Send for CommState {}

/// One rank of a group whose tensors travel through NCCL (point-to-point and collectives), for the
/// CubeCL CUDA backend `CubeBackend<CudaRuntime, F, I, BT>`. Build a group with
/// [`DeviceGroup::nccl`], [`DeviceGroup::nccl_from_env`] or [`DeviceGroup::nccl_with_rendezvous`]
/// (or [`NcclTransport::group`] / [`NcclTransport::with_rendezvous`] for the bare transports).
///
/// Drive each rank from one host thread: CubeCL's compute stream is per thread, and an exchange
/// synchronizes the calling thread's stream before NCCL reads or writes the tensors.
/// Dropping the transport aborts its communicator (`ncclCommAbort`, waited for at most 10 s);
/// drop it after the last exchange is waited on.
pub struct NcclTransport<F, I, BT> {
    rank: usize,
    world_size: usize,
    device: CudaDevice,
    timeout: Duration,
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    comm: Mutex<CommState>,
    _elements: Elements<F, I, BT>,
}

impl<F, I, BT> core::fmt::Debug for NcclTransport<F, I, BT> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("NcclTransport")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("device", &self.device)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl<F, I, BT> NcclTransport<F, I, BT> {
    /// How long this rank waits for a peer before failing with [`Error::Timeout`].
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn lock(&self) -> MutexGuard<'_, CommState> {
        self.comm
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn shut_down_error(&self, why: &str) -> Error {
        Error::Nccl(format!(
            "rank {}: the NCCL communicator was shut down after an earlier failure ({why}); \
             build a new group",
            self.rank
        ))
    }

    /// The communicator, or the error that shut it down.
    fn usable(&self, state: &CommState) -> Result<nccl::ncclComm_t, Error> {
        match &state.failure {
            Some(why) => Err(self.shut_down_error(why)),
            None => Ok(state.raw),
        }
    }

    fn check_usable(&self) -> Result<(), Error> {
        self.usable(&self.lock()).map(|_| ())
    }

    /// Aborts the communicator (stopping its kernels) and records why; later calls fail.
    fn abort(&self, why: String) {
        let mut state = self.lock();
        if !state.raw.is_null() {
            abort_within(self.rank, &self.context, state.raw);
            state.raw = null_mut();
        }
        state.failure.get_or_insert(why);
    }

    /// Whether the communicator failed (a peer's error, or an abort by another exchange), while
    /// this rank waited for a `kind` message from `peer` (named in the error).
    fn health(&self, peer: usize, kind: MessageKind) -> Option<Error> {
        let state = self.lock();
        if let Some(why) = &state.failure {
            return Some(self.shut_down_error(why));
        }
        match async_state(state.raw) {
            nccl::ncclResult_t::ncclSuccess | nccl::ncclResult_t::ncclInProgress => None,
            other => Some(nccl_error(
                &failed_while_waiting(self.rank, peer, kind),
                other,
                state.raw,
            )),
        }
    }

    fn check_peer(&self, peer: usize) -> Result<(), Error> {
        if peer >= self.world_size {
            Err(Error::GroupSetup(format!(
                "rank {} addressed rank {peer}, but the group has {} ranks",
                self.rank, self.world_size
            )))
        } else if peer == self.rank {
            Err(Error::Mismatch {
                rank: self.rank,
                peer,
                detail: "a rank cannot send to or receive from itself".into(),
            })
        } else {
            Ok(())
        }
    }
}

impl<F, I, BT> Drop for NcclTransport<F, I, BT> {
    fn drop(&mut self) {
        let state = self
            .comm
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if !state.raw.is_null() {
            abort_within(self.rank, &self.context, state.raw);
            state.raw = null_mut();
        }
    }
}

/// How long a rank waits for NCCL's abort before going on without it. The abort sets the flag
/// that stops the communicator's kernels at once, then frees its resources, which on one node may
/// wait for the peers' own aborts: a peer process that exited never sends them.
const ABORT_LIMIT: Duration = Duration::from_secs(10);

/// A communicator handed to the thread that aborts it.
struct Doomed(nccl::ncclComm_t);

// SAFETY: the communicator moves to the aborting thread and is used by nothing else after.
unsafe impl Send for Doomed {}

impl Doomed {
    fn raw(self) -> nccl::ncclComm_t {
        self.0
    }
}

/// Aborts `comm` (live, not used after this by the caller) on a thread of its own, waiting at
/// most [`ABORT_LIMIT`]; past it, says so on stderr and leaves the abort running.
fn abort_within(rank: usize, context: &Arc<CudaContext>, comm: nccl::ncclComm_t) {
    let (context, doomed) = (Arc::clone(context), Doomed(comm));
    let finished = finishes_within(ABORT_LIMIT, move || {
        let comm = doomed.raw();
        let _ = context.bind_to_thread();
        // SAFETY: the communicator is live and nothing else uses it (see `Doomed`).
        unsafe { nccl::ncclCommAbort(comm) };
    });
    if !finished {
        eprintln!(
            "burn-distflash: rank {rank}: NCCL's abort of the communicator did not return within \
             {} s (a peer process that exited?); going on without waiting for it",
            ABORT_LIMIT.as_secs()
        );
    }
}

/// What a rank was doing when its communicator failed: the peer and message it waited for (the
/// peer a silent-peer timeout would name), so a peer's exit reads like its silence does.
fn failed_while_waiting(rank: usize, peer: usize, kind: MessageKind) -> String {
    format!(
        "rank {rank}: the NCCL communicator failed while waiting for a {kind:?} message from \
         rank {peer} (a peer exited or crashed, a connection was lost, or NCCL failed)"
    )
}

fn is_float(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::F64 | DType::F32 | DType::Flex32 | DType::F16 | DType::BF16
    )
}

impl<F, I, BT> Transport<Cube<F, I, BT>> for NcclTransport<F, I, BT>
where
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn device(&self) -> &CudaDevice {
        &self.device
    }

    fn exchange(
        &self,
        sends: Vec<Outgoing<Cube<F, I, BT>>>,
        receives: Vec<Incoming>,
    ) -> Result<Box<dyn Exchange<Cube<F, I, BT>> + '_>, Error> {
        let posted_at = Instant::now();
        for message in &sends {
            self.check_peer(message.peer)?;
        }
        for incoming in &receives {
            self.check_peer(incoming.peer)?;
            if let Some(layout) = incoming.layouts.iter().find(|l| !is_float(l.dtype)) {
                return Err(Error::GroupSetup(format!(
                    "rank {}: the NCCL transport receives float tensors, but a {:?} from rank {} \
                     expects {:?}",
                    self.rank, incoming.kind, incoming.peer, layout.dtype
                )));
            }
        }
        self.check_usable()?;
        let blame = receives
            .first()
            .map(|m| (m.peer, m.kind))
            .or_else(|| sends.first().map(|m| (m.peer, m.kind)))
            .unwrap_or((self.rank, MessageKind::Values));
        let client = CudaRuntime::client(&self.device);

        // Sent tensors, contiguous, in the order both sides post them: by peer, then kind.
        let mut sends = sends
            .into_iter()
            .map(|message| {
                let tensors = message
                    .tensors
                    .into_iter()
                    .map(|t| self.prepare_send(t))
                    .collect::<Result<Vec<_>, _>>()?;
                Ok((message.peer, message.kind, tensors))
            })
            .collect::<Result<Vec<_>, Error>>()?;
        sends.sort_by_key(|(peer, kind, _)| (*peer, *kind));

        // Receive buffers, contiguous (CubeCL's own `empty` may pad rows).
        let received: Vec<Vec<CudaTensor>> = receives
            .iter()
            .map(|incoming| {
                incoming
                    .layouts
                    .iter()
                    .map(|layout| empty_contiguous(&client, &self.device, layout))
                    .collect()
            })
            .collect();
        let mut order: Vec<usize> = (0..receives.len()).collect();
        order.sort_by_key(|&i| (receives[i].peer, receives[i].kind));

        let mut work = InFlight::default();
        let mut ops = Vec::new();
        for (peer, _, tensors) in &sends {
            for tensor in tensors {
                let bytes = tensor.shape().num_elements() * tensor.dtype.size();
                if bytes > 0 {
                    let pointer =
                        device_pointer(&tensor.client, &tensor.handle, bytes, &mut work.keep)?;
                    ops.push(Op::Send {
                        peer: *peer,
                        pointer,
                        bytes,
                    });
                }
            }
        }
        for &i in &order {
            for tensor in &received[i] {
                let bytes = tensor.shape().num_elements() * tensor.dtype.size();
                if bytes > 0 {
                    let pointer = device_pointer(&client, &tensor.handle, bytes, &mut work.keep)?;
                    ops.push(Op::Recv {
                        peer: receives[i].peer,
                        pointer,
                        bytes,
                    });
                }
            }
        }
        for (_, _, tensors) in sends {
            work.keep
                .extend(tensors.into_iter().map(|t| Box::new(t) as Box<dyn Send>));
        }
        for tensors in &received {
            work.keep
                .extend(tensors.iter().map(|t| Box::new(t.clone()) as Box<dyn Send>));
        }

        if !ops.is_empty() {
            // Every kernel that wrote a sent tensor, or last used a receive buffer's memory, is
            // done (an exchange that moves no bytes needs no ordering, and skips the host wait).
            self.sync_compute(&client)?;
            self.launch(&ops, &mut work, blame, posted_at)?;
        }
        Ok(Box::new(NcclExchange {
            transport: self,
            work,
            posted_at,
            blame,
            receives,
            received,
        }))
    }

    fn all_gather_values(&self, values: &[u64]) -> Result<Vec<Vec<u64>>, Error> {
        if self.world_size == 1 {
            return Ok(vec![values.to_vec()]);
        }
        // First the lengths, so that ranks that disagree get an error rather than a hang.
        let lengths = self.gather_bytes(&(values.len() as u64).to_le_bytes())?;
        let lengths: Vec<u64> = lengths
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        if let Some(peer) = lengths.iter().position(|&n| n != values.len() as u64) {
            return Err(Error::Mismatch {
                rank: self.rank,
                peer,
                detail: format!(
                    "all_gather_values: rank {peer} gave {} values, this rank {}",
                    lengths[peer],
                    values.len()
                ),
            });
        }
        if values.is_empty() {
            return Ok(vec![Vec::new(); self.world_size]);
        }
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let gathered = self.gather_bytes(&bytes)?;
        Ok(gathered
            .chunks_exact(bytes.len())
            .map(|chunk| {
                chunk
                    .chunks_exact(8)
                    .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect()
            })
            .collect())
    }

    fn all_reduce(&self, tensor: CudaTensor) -> Result<CudaTensor, Error> {
        self.collective(Collective::AllReduce, tensor)
    }

    fn reduce_scatter(&self, tensor: CudaTensor) -> Result<CudaTensor, Error> {
        self.collective(Collective::ReduceScatter, tensor)
    }

    fn all_gather(&self, tensor: CudaTensor) -> Result<CudaTensor, Error> {
        self.collective(Collective::AllGather, tensor)
    }
}

/// An uninitialized contiguous tensor of `layout` on `device`.
fn empty_contiguous(
    client: &ComputeClient<CudaRuntime>,
    device: &CudaDevice,
    layout: &TensorLayout,
) -> CudaTensor {
    let handle = client.empty(layout.bytes().max(1));
    CubeTensor::new_contiguous(
        client.clone(),
        device.clone(),
        Shape::from(layout.shape.clone()),
        handle,
        layout.dtype,
    )
}

impl<F, I, BT> DeviceGroup<Cube<F, I, BT>>
where
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    /// An NCCL group of this process's GPUs, one rank per device (rank `i` computes on
    /// `devices[i]`), with communicators created and connected now; hand each returned rank to
    /// its own host thread. Waits for silent peers up to [`DEFAULT_TIMEOUT`].
    ///
    /// # Errors
    ///
    /// - [`Error::GroupSetup`] for an empty list, a repeated device or a device that does not
    ///   exist, or when creating or connecting the communicators does not finish within the
    ///   timeout.
    /// - [`Error::Nccl`] when libcuda or libnccl cannot be loaded, or a CUDA or NCCL call
    ///   fails.
    pub fn nccl(devices: &[CudaDevice]) -> Result<Vec<Self>, Error> {
        Self::nccl_with_timeout(devices, DEFAULT_TIMEOUT)
    }

    /// [`DeviceGroup::nccl`] with a different wait limit for silent peers.
    ///
    /// # Errors
    ///
    /// As [`DeviceGroup::nccl`].
    pub fn nccl_with_timeout(
        devices: &[CudaDevice],
        timeout: Duration,
    ) -> Result<Vec<Self>, Error> {
        Ok(NcclTransport::<F, I, BT>::group(devices, timeout)?
            .into_iter()
            .map(DeviceGroup::new)
            .collect())
    }

    /// This process's rank of a multi-process NCCL group described torchrun-style by the
    /// environment: `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (the CUDA device ordinal), and
    /// `MASTER_ADDR`/`MASTER_PORT`, where rank 0 listens for the rendezvous (see
    /// [`DeviceGroup::nccl_with_rendezvous`]). Waits up to [`DEFAULT_TIMEOUT`].
    ///
    /// Under torchrun itself, `MASTER_PORT` is taken by torchrun's own store: use
    /// [`DeviceGroup::nccl_with_rendezvous`] with a port of your own there.
    ///
    /// # Errors
    ///
    /// [`Error::GroupSetup`] naming the variable when `RANK`, `WORLD_SIZE` or `LOCAL_RANK` (and,
    /// for more than one process, `MASTER_ADDR` or the port: `DISTFLASH_RENDEZVOUS_PORT` when
    /// set, else `MASTER_PORT`) is missing or malformed; otherwise as
    /// [`DeviceGroup::nccl_with_rendezvous`].
    pub fn nccl_from_env() -> Result<Self, Error> {
        Self::nccl_from_env_with_timeout(DEFAULT_TIMEOUT)
    }

    /// [`DeviceGroup::nccl_from_env`] with a different wait limit.
    ///
    /// # Errors
    ///
    /// As [`DeviceGroup::nccl_from_env`].
    pub fn nccl_from_env_with_timeout(timeout: Duration) -> Result<Self, Error> {
        let env = EnvConfig::from_env()?;
        Self::nccl_with_rendezvous(
            env.rank,
            env.world_size,
            CudaDevice::new(env.local_rank),
            env.master.as_deref().unwrap_or(""),
            timeout,
        )
    }

    /// This process's rank `rank` of a group of `world_size` processes, computing on `device`:
    /// rank 0 listens on `addr` (`host:port`) and hands the NCCL id to the other ranks, which
    /// connect to it; then every rank creates and connects its communicator. Every step waits at
    /// most `timeout`, and a failure names the ranks that did not show up.
    ///
    /// # Errors
    ///
    /// - [`Error::GroupSetup`] when `rank` is not below `world_size`, `device` does not exist,
    ///   the rendezvous fails (an address that cannot be resolved or listened on, a rank that
    ///   does not show up in time), or creating or connecting the communicator does not finish
    ///   within `timeout`.
    /// - [`Error::Nccl`] when libcuda or libnccl cannot be loaded, or a CUDA or NCCL call
    ///   fails.
    pub fn nccl_with_rendezvous(
        rank: usize,
        world_size: usize,
        device: CudaDevice,
        addr: &str,
        timeout: Duration,
    ) -> Result<Self, Error> {
        NcclTransport::<F, I, BT>::with_rendezvous(rank, world_size, device, addr, timeout)
            .map(DeviceGroup::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_communicator_names_the_peer_and_message_waited_for() {
        let text = failed_while_waiting(0, 1, MessageKind::KeyValue);
        assert!(text.starts_with("rank 0: "), "{text}");
        assert!(text.contains("KeyValue message from rank 1"), "{text}");
        assert!(text.contains("exited"), "{text}");
    }
}
