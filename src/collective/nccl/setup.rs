//! Communicator setup: one non-blocking NCCL communicator per rank, created from a shared
//! unique id and connected to every peer before the first exchange (aborted if setup fails).

use crate::Error;
use std::ffi::{c_char, c_int, c_void};
use std::marker::PhantomData;
use std::ptr::{null, null_mut};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use cubecl::cuda::CudaDevice;
use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::sys as nccl;

use super::library::{accepted, device_count, driver_error, guarded, nccl_error, probe};
use super::rendezvous::{self, UniqueId, ID_BYTES};
use super::wait::{backoff, wait_ready, NotReady};
use super::{CommState, NcclTransport};

/// `NCCL_VERSION(2, 30, 0)`: the header version cudarc's `ncclConfig_t` layout comes from. An
/// older library reads the prefix it knows (NCCL copies `min(size, its own size)` bytes).
const CONFIG_VERSION: u32 = 23000;
/// `NCCL_CONFIG_UNDEF_INT`: "let NCCL decide".
const UNDEF: c_int = c_int::MIN;

/// Sets `NCCL_NVLS_ENABLE=0` unless the user set it (see the module docs). NCCL reads its
/// parameters once per process, so this runs before the first communicator is created.
fn keep_nvlink_multicast_off() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            std::env::set_var("NCCL_NVLS_ENABLE", "0");
        }
    });
}

/// A non-blocking communicator configuration (`NCCL_CONFIG_INITIALIZER`, `blocking = 0`).
fn non_blocking_config() -> nccl::ncclConfig_t {
    nccl::ncclConfig_t {
        size: std::mem::size_of::<nccl::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: CONFIG_VERSION,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

fn new_unique_id() -> Result<UniqueId, Error> {
    let id = guarded(
        "creating the NCCL unique id",
        cudarc::nccl::result::get_uniqueid,
    )?
    .map_err(|e| nccl_error("creating the NCCL unique id", e.0, null_mut()))?;
    Ok(id.internal.map(|c| c as u8))
}

/// One rank's CUDA side, before its communicator exists.
struct Member {
    rank: usize,
    device: CudaDevice,
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
}

/// Retains the device's primary context (the one CubeCL uses, so CubeCL's pointers are valid
/// here) and creates the rank's communication stream on it.
fn open_member(rank: usize, device: &CudaDevice, count: usize) -> Result<Member, Error> {
    if device.index >= count {
        return Err(Error::GroupSetup(format!(
            "rank {rank}: {device:?} does not exist; this machine has {count} CUDA device(s) \
             (ordinals 0..{count})"
        )));
    }
    let doing = format!("rank {rank}: opening {device:?}");
    let context =
        guarded(&doing, || CudaContext::new(device.index))?.map_err(|e| driver_error(&doing, e))?;
    let doing = format!("rank {rank}: creating the communication stream on {device:?}");
    let stream = guarded(&doing, || context.new_stream())?.map_err(|e| driver_error(&doing, e))?;
    Ok(Member {
        rank,
        device: device.clone(),
        context,
        stream,
    })
}

/// Aborts every communicator that exists (setup failed half way), each on a thread of its own
/// and waited for at most the abort's limit, as a running group's are: a peer process that
/// exited during the setup can keep NCCL's abort waiting.
fn abort_all(members: &[Member], comms: &[nccl::ncclComm_t]) {
    for (member, &comm) in members.iter().zip(comms) {
        if !comm.is_null() {
            // `comm` was created by NCCL and is not used after this.
            super::abort_within(member.rank, &member.context, comm);
        }
    }
}

/// Creates the members' communicators of a group of `world_size` ranks (all of them in one
/// NCCL group, so one thread can set up several GPUs), and waits until they are ready.
fn init_comms(
    members: &[Member],
    world_size: usize,
    id: &UniqueId,
    deadline: Instant,
) -> Result<Vec<nccl::ncclComm_t>, Error> {
    let id = nccl::ncclUniqueId {
        internal: id.map(|b| b as c_char),
    };
    let mut comms = vec![null_mut(); members.len()];
    // Kept alive until the communicators are ready.
    let mut configs: Vec<nccl::ncclConfig_t> =
        members.iter().map(|_| non_blocking_config()).collect();
    // SAFETY: plain NCCL call.
    accepted(unsafe { nccl::ncclGroupStart() })
        .map_err(|r| nccl_error("ncclGroupStart (communicator setup)", r, null_mut()))?;
    let mut failure = None;
    for (i, member) in members.iter().enumerate() {
        if let Err(e) = member.context.bind_to_thread() {
            failure = Some(driver_error(
                &format!("rank {}: binding {:?}", member.rank, member.device),
                e,
            ));
            break;
        }
        // SAFETY: valid out pointer and config; NCCL copies the id.
        let result = unsafe {
            nccl::ncclCommInitRankConfig(
                &mut comms[i],
                world_size as c_int,
                id,
                member.rank as c_int,
                &mut configs[i],
            )
        };
        if let Err(r) = accepted(result) {
            failure = Some(nccl_error(
                &format!("rank {}: creating its NCCL communicator", member.rank),
                r,
                comms[i],
            ));
            break;
        }
    }
    // SAFETY: closes the group opened above.
    let end = accepted(unsafe { nccl::ncclGroupEnd() });
    if failure.is_none() {
        if let Err(r) = end {
            failure = Some(nccl_error(
                "ncclGroupEnd (communicator setup)",
                r,
                null_mut(),
            ));
        }
    }
    if failure.is_none() {
        let started = Instant::now();
        match wait_ready(&comms, deadline) {
            Ok(()) => return Ok(comms),
            Err(NotReady::Timeout(i)) => {
                failure = Some(Error::GroupSetup(format!(
                    "rank {}: NCCL communicator setup did not finish within {:.1} s: another \
                     rank of the group of {world_size} did not join (run with NCCL_DEBUG=INFO \
                     for details)",
                    members[i].rank,
                    started.elapsed().as_secs_f64()
                )))
            }
            Err(NotReady::Failed(i, r)) => {
                failure = Some(nccl_error(
                    &format!("rank {}: creating its NCCL communicator", members[i].rank),
                    r,
                    comms[i],
                ))
            }
        }
    }
    abort_all(members, &comms);
    drop(configs);
    Err(failure.expect("set on every path that gets here"))
}

/// Sets up every point-to-point connection now (one byte to and from every peer), instead of
/// on the first exchange, where NCCL would make the host wait for the peer to connect.
fn connect_peers(
    members: &[Member],
    comms: &[nccl::ncclComm_t],
    world_size: usize,
    deadline: Instant,
) -> Result<(), Error> {
    if world_size < 2 {
        return Ok(());
    }
    let bytes = 2 * world_size;
    let mut buffers = Vec::with_capacity(members.len());
    let free = |buffers: &[(usize, u64)]| {
        for &(i, pointer) in buffers {
            let _ = members[i].context.bind_to_thread();
            // SAFETY: allocated below with `malloc_sync` in this context; no work uses it.
            let _ = unsafe { cudarc::driver::result::free_sync(pointer) };
        }
    };
    for (i, member) in members.iter().enumerate() {
        let doing = format!("rank {}: allocating the connection buffer", member.rank);
        let allocated = member.context.bind_to_thread().and_then(|_| {
            // SAFETY: plain allocation in the bound context.
            unsafe { cudarc::driver::result::malloc_sync(bytes) }
        });
        match allocated {
            Ok(pointer) => buffers.push((i, pointer)),
            Err(e) => {
                free(&buffers);
                return Err(driver_error(&doing, e));
            }
        }
    }

    // SAFETY: plain NCCL call.
    accepted(unsafe { nccl::ncclGroupStart() })
        .map_err(|r| nccl_error("ncclGroupStart (connecting peers)", r, null_mut()))?;
    let mut failure = None;
    'post: for (&(i, buffer), &comm) in buffers.iter().zip(comms) {
        let member = &members[i];
        if let Err(e) = member.context.bind_to_thread() {
            failure = Some(driver_error("binding the context", e));
            break;
        }
        let stream = member.stream.cu_stream() as nccl::cudaStream_t;
        for peer in (0..world_size).filter(|&p| p != member.rank) {
            // SAFETY: `buffer` holds `2 * world_size` bytes; one byte each way per peer.
            let results = unsafe {
                [
                    nccl::ncclSend(
                        buffer as *const c_void,
                        1,
                        nccl::ncclDataType_t::ncclUint8,
                        peer as c_int,
                        comm,
                        stream,
                    ),
                    nccl::ncclRecv(
                        (buffer + (world_size + peer) as u64) as *mut c_void,
                        1,
                        nccl::ncclDataType_t::ncclUint8,
                        peer as c_int,
                        comm,
                        stream,
                    ),
                ]
            };
            if let Some(&r) = results.iter().find(|r| accepted(**r).is_err()) {
                failure = Some(nccl_error(
                    &format!("rank {}: connecting to rank {peer}", member.rank),
                    r,
                    comm,
                ));
                break 'post;
            }
        }
    }
    // SAFETY: closes the group opened above.
    let end = accepted(unsafe { nccl::ncclGroupEnd() });
    if failure.is_none() {
        if let Err(r) = end {
            failure = Some(nccl_error("ncclGroupEnd (connecting peers)", r, null_mut()));
        }
    }
    if failure.is_none() {
        let started = Instant::now();
        let timed_out = |i: usize| {
            Error::GroupSetup(format!(
                "rank {}: connecting to its peers did not finish within {:.1} s (a rank of the \
                 group of {world_size} stopped after joining)",
                members[i].rank,
                started.elapsed().as_secs_f64()
            ))
        };
        failure = match wait_ready(comms, deadline) {
            Err(NotReady::Timeout(i)) => Some(timed_out(i)),
            Err(NotReady::Failed(i, r)) => Some(nccl_error(
                &format!("rank {}: connecting to its peers", members[i].rank),
                r,
                comms[i],
            )),
            Ok(()) => {
                let mut events = Vec::new();
                for member in members {
                    match member.stream.record_event(None) {
                        Ok(event) => events.push(event),
                        Err(e) => {
                            failure = Some(driver_error("recording an event", e));
                            break;
                        }
                    }
                }
                failure.or_else(|| {
                    let mut pending: Vec<usize> = (0..events.len()).collect();
                    loop {
                        pending.retain(|&i| !matches!(events[i].try_is_complete(), Ok(true)));
                        if pending.is_empty() {
                            break None;
                        }
                        if Instant::now() >= deadline {
                            break Some(timed_out(pending[0]));
                        }
                        backoff(started);
                    }
                })
            }
        };
    }
    match failure {
        None => {
            free(&buffers);
            Ok(())
        }
        // Kernels may still use the buffers: leak them (a few bytes); the caller aborts.
        Some(error) => Err(error),
    }
}

impl<F, I, BT> NcclTransport<F, I, BT> {
    /// One transport per device, all in this process (rank `i` computes on `devices[i]`), with
    /// their communicators created and connected now. Devices must be distinct and exist.
    pub fn group(devices: &[CudaDevice], timeout: Duration) -> Result<Vec<Self>, Error> {
        if devices.is_empty() {
            return Err(Error::GroupSetup(
                "an NCCL group needs at least one device; none was given".into(),
            ));
        }
        for (i, device) in devices.iter().enumerate() {
            if let Some(j) = devices[..i].iter().position(|d| d == device) {
                return Err(Error::GroupSetup(format!(
                    "{device:?} is given twice (ranks {j} and {i}): NCCL needs one rank per GPU \
                     per process; use DeviceGroup::in_process to put several ranks on one device"
                )));
            }
        }
        probe()?;
        let count = device_count()?;
        keep_nvlink_multicast_off();
        let members = devices
            .iter()
            .enumerate()
            .map(|(rank, device)| open_member(rank, device, count))
            .collect::<Result<Vec<_>, _>>()?;
        let id = new_unique_id()?;
        let deadline = Instant::now() + timeout;
        let comms = init_comms(&members, devices.len(), &id, deadline)?;
        if let Err(e) = connect_peers(&members, &comms, devices.len(), deadline) {
            abort_all(&members, &comms);
            return Err(e);
        }
        let world_size = devices.len();
        Ok(members
            .into_iter()
            .zip(comms)
            .map(|(member, comm)| Self::from_parts(member, comm, world_size, timeout))
            .collect())
    }

    /// This process's rank of a multi-process group: rank 0 creates the NCCL id and hands it
    /// out over a TCP rendezvous at `addr` (`host:port`, where rank 0 listens), then every rank creates and connects its communicator on `device`.
    /// Each step is bounded by `timeout`. A group of one ignores `addr`.
    pub fn with_rendezvous(
        rank: usize,
        world_size: usize,
        device: CudaDevice,
        addr: &str,
        timeout: Duration,
    ) -> Result<Self, Error> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::GroupSetup(format!(
                "rank {rank} is not in a group of {world_size} ranks (expected 0..{world_size})"
            )));
        }
        probe()?;
        let count = device_count()?;
        keep_nvlink_multicast_off();
        let member = open_member(rank, &device, count)?;
        let id = rendezvous::share_id(rank, world_size, addr, timeout, new_unique_id)?;
        let members = [member];
        let deadline = Instant::now() + timeout;
        let comms = init_comms(&members, world_size, &id, deadline)?;
        if let Err(e) = connect_peers(&members, &comms, world_size, deadline) {
            abort_all(&members, &comms);
            return Err(e);
        }
        let [member] = members;
        Ok(Self::from_parts(member, comms[0], world_size, timeout))
    }

    fn from_parts(
        member: Member,
        comm: nccl::ncclComm_t,
        world_size: usize,
        timeout: Duration,
    ) -> Self {
        Self {
            rank: member.rank,
            world_size,
            device: member.device,
            timeout,
            context: member.context,
            stream: member.stream,
            comm: Mutex::new(CommState {
                raw: comm,
                failure: None,
            }),
            _elements: PhantomData,
        }
    }
}

// The id travels as raw bytes; NCCL's is exactly this size.
const _: () = assert!(std::mem::size_of::<nccl::ncclUniqueId>() == ID_BYTES);
