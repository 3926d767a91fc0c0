//! NCCL point-to-point transport for CUDA device groups: [`NcclTransport`], built through
//! [`DeviceGroup::nccl`] (one process, one rank per GPU, one host thread per rank) or
//! [`DeviceGroup::nccl_from_env`] / [`DeviceGroup::nccl_with_rendezvous`] (one process per GPU,
//! on one or many hosts, torchrun-style).
//!
//! How an exchange runs (see [`Transport::exchange`]):
//! 1. Sent tensors are made contiguous and receive buffers are allocated (contiguous, on the
//!    rank's device); their device addresses come from CubeCL's `get_resource`, which also keeps
//!    the memory alive until the exchange is done with it.
//! 2. The rank's CubeCL compute stream is host-synchronized (CubeCL's streams are internal, one
//!    per host thread, so the calling thread's stream is the one that wrote the sent tensors).
//! 3. One `ncclSend`/`ncclRecv` per tensor (as bytes) is posted inside one NCCL group on a
//!    dedicated per-rank communication stream, and an event is recorded behind them.
//! 4. [`Exchange::wait`] polls that event. Kernels that read received tensors are launched after
//!    the wait returns, so they see the data.
//!
//! Messages to or from the same peer are posted in `(peer, kind)` order on both sides, so a
//! sender and a receiver that list the same messages in different orders still match.
//! NCCL moves bytes only: unlike the in-process transport, layouts are not checked on the wire
//! (ranks are expected to agree on them; [`Transport::all_gather_values`] is the way to check).
//!
//! Never hanging: communicators are non-blocking (NCCL's `blocking = 0` config), so no NCCL
//! call blocks the host; every wait (communicator setup, posting, completion) is bounded by the
//! group's timeout. When it passes, the communicator is aborted (`ncclCommAbort`, which also
//! stops kernels waiting for a silent peer) and the call fails with [`CommError::Timeout`];
//! every later call on that rank fails with [`CommError::Nccl`]. Peers' point-to-point
//! connections are set up eagerly at construction (one byte to and from every peer), so a
//! posted exchange never waits for a peer to connect.
//!
//! `NCCL_NVLS_ENABLE` is set to `0` when unset, before the first communicator is created: NVLink
//! multicast (NVLS) reserves NVSwitch multicast resources and extra memory per communicator, which
//! the shared GPU machines this crate runs on must not use, and point-to-point traffic gains
//! nothing from it. Set the variable yourself (before building a group) to decide otherwise.
//!
//! libcuda and libnccl are loaded at run time (cudarc's dynamic loading); when either is missing,
//! constructors return [`CommError::Nccl`] saying so instead of panicking.

#[path = "rendezvous.rs"]
pub mod rendezvous;

use std::ffi::{c_char, c_int, c_void, CStr};
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::{null, null_mut};
use std::sync::{Arc, Mutex, MutexGuard, Once, OnceLock};
use std::time::{Duration, Instant};

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::client::ComputeClient;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::server::Handle;
use cubecl::Runtime;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DriverError};
use cudarc::nccl::sys as nccl;

use super::local::DEFAULT_TIMEOUT;
use super::{
    CommError, DeviceGroup, Exchange, Incoming, MessageKind, Outgoing, Received, TensorLayout,
    Transport,
};
use rendezvous::{EnvConfig, UniqueId, ID_BYTES};

/// The CubeCL CUDA backend this transport serves.
type Cube<F, I, BT> = CubeBackend<CudaRuntime, F, I, BT>;
type CudaTensor = CubeTensor<CudaRuntime>;
/// Marks the element types without owning any (and stays `Send + Sync`).
type Elements<F, I, BT> = PhantomData<fn() -> (F, I, BT)>;

/// Oldest NCCL with non-blocking communicators (`ncclCommInitRankConfig`).
const MIN_NCCL_VERSION: i32 = 21400;
/// `NCCL_VERSION(2, 30, 0)`: the header version cudarc's `ncclConfig_t` layout comes from. An
/// older library reads the prefix it knows (NCCL copies `min(size, its own size)` bytes).
const CONFIG_VERSION: u32 = 23000;
/// `NCCL_CONFIG_UNDEF_INT`: "let NCCL decide".
const UNDEF: c_int = c_int::MIN;
/// How long an aborted communicator's kernels get to stop before their buffers are leaked
/// rather than freed under them.
const ABORT_GRACE: Duration = Duration::from_secs(10);
/// How often a waiting rank asks NCCL whether the communicator failed (a peer's error).
const HEALTH_EVERY: Duration = Duration::from_millis(2);

/// Checks that the CUDA driver and NCCL (2.14 or newer) can be loaded, and returns NCCL's
/// version code (`22803` for 2.28.3). Fails with [`CommError::Nccl`], never a panic.
pub fn probe() -> Result<i32, CommError> {
    static RESULT: OnceLock<Result<i32, CommError>> = OnceLock::new();
    RESULT
        .get_or_init(|| {
            probe_driver()?;
            probe_nccl()
        })
        .clone()
}

/// Number of CUDA devices on this machine; [`CommError::Nccl`] (not a panic) when there is no
/// usable CUDA driver.
pub fn device_count() -> Result<usize, CommError> {
    probe_driver()?;
    guarded("counting CUDA devices", CudaContext::device_count)?
        .map(|n| n.max(0) as usize)
        .map_err(|e| driver_error("counting CUDA devices", e))
}

/// `major.minor.patch` of an NCCL version code.
fn version_text(code: i32) -> String {
    format!("{}.{}.{}", code / 10000, (code / 100) % 100, code % 100)
}

/// Runs `f`, turning a panic inside cudarc (its answer to a missing library or symbol) into an
/// error.
fn guarded<T>(doing: &str, f: impl FnOnce() -> T) -> Result<T, CommError> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|panic| {
        let why = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown panic".into());
        CommError::Nccl(format!("{doing}: {why}"))
    })
}

fn probe_driver() -> Result<(), CommError> {
    static RESULT: OnceLock<Result<(), CommError>> = OnceLock::new();
    RESULT
        .get_or_init(|| {
            // SAFETY: only tries to open the library, with cudarc's own list of names.
            if !unsafe { cudarc::driver::sys::is_culib_present() } {
                return Err(CommError::Nccl(
                    "the CUDA driver library (libcuda.so) could not be loaded: this machine has \
                     no NVIDIA driver, or the library is not on the loader's path \
                     (LD_LIBRARY_PATH)"
                        .into(),
                ));
            }
            guarded("initialising the CUDA driver", cudarc::driver::result::init)?
                .map_err(|e| driver_error("initialising the CUDA driver (cuInit)", e))
        })
        .clone()
}

fn probe_nccl() -> Result<i32, CommError> {
    // SAFETY: only tries to open the library, with cudarc's own list of names.
    if !unsafe { nccl::is_culib_present() } {
        return Err(CommError::Nccl(format!(
            "libnccl.so could not be loaded: install NCCL 2.x (2.14 or newer; e.g. the libnccl2 \
             and libnccl-dev packages or NVIDIA's NCCL archive), or put the folder holding it on \
             LD_LIBRARY_PATH; an install that has only libnccl.so.2 needs a libnccl.so link to it \
             (names searched: {:?})",
            cudarc::get_lib_name_candidates("nccl")
        )));
    }
    // cudarc resolves each symbol on first use and panics when one is missing: check them all
    // now, while the answer can still be an error.
    const SYMBOLS: [&str; 12] = [
        "ncclGetVersion",
        "ncclGetUniqueId",
        "ncclCommInitRankConfig",
        "ncclCommGetAsyncError",
        "ncclCommAbort",
        "ncclGroupStart",
        "ncclGroupEnd",
        "ncclSend",
        "ncclRecv",
        "ncclAllGather",
        "ncclGetErrorString",
        "ncclGetLastError",
    ];
    let missing: Vec<&str> = guarded("loading libnccl", || {
        // SAFETY: the library is present (checked above); symbols are only looked up.
        let library = unsafe { nccl::culib() };
        SYMBOLS
            .iter()
            .copied()
            // SAFETY: looking a symbol up does not call it.
            .filter(|name| {
                unsafe { library.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err()
            })
            .collect()
    })?;
    if !missing.is_empty() {
        return Err(CommError::Nccl(format!(
            "the loaded libnccl lacks {missing:?}: this transport needs NCCL 2.14 or newer"
        )));
    }
    let version = guarded(
        "asking NCCL its version",
        cudarc::nccl::result::get_nccl_version,
    )?
    .map_err(|e| nccl_error("ncclGetVersion", e.0, null_mut()))?;
    if version < MIN_NCCL_VERSION {
        return Err(CommError::Nccl(format!(
            "NCCL {} is too old: this transport needs NCCL 2.14 or newer (non-blocking \
             communicators)",
            version_text(version)
        )));
    }
    Ok(version)
}

fn driver_error(doing: &str, error: DriverError) -> CommError {
    CommError::Nccl(format!("{doing}: CUDA error {error:?}"))
}

/// # Safety
/// `text` is null or a NUL-terminated string that stays valid during the call.
unsafe fn c_text(text: *const c_char) -> String {
    if text.is_null() {
        String::new()
    } else {
        CStr::from_ptr(text).to_string_lossy().into_owned()
    }
}

fn nccl_error(doing: &str, result: nccl::ncclResult_t, comm: nccl::ncclComm_t) -> CommError {
    // SAFETY: NCCL returns static strings (or its per-thread last-error buffer); `comm` may be
    // null ("currently unused" per NCCL's documentation).
    let (text, last) = unsafe {
        (
            c_text(nccl::ncclGetErrorString(result)),
            c_text(nccl::ncclGetLastError(comm)),
        )
    };
    let last = if last.is_empty() {
        String::new()
    } else {
        format!("; NCCL says: {last}")
    };
    CommError::Nccl(format!("{doing}: {text} ({result:?}){last}"))
}

/// Success and "in progress" (non-blocking communicators) are both fine right after a call.
fn accepted(result: nccl::ncclResult_t) -> Result<(), nccl::ncclResult_t> {
    match result {
        nccl::ncclResult_t::ncclSuccess | nccl::ncclResult_t::ncclInProgress => Ok(()),
        other => Err(other),
    }
}

/// The state of a non-blocking communicator's last operation: `ncclInProgress` while NCCL still
/// works on it in the background, `ncclSuccess` once done, an error otherwise.
fn async_state(comm: nccl::ncclComm_t) -> nccl::ncclResult_t {
    let mut state = nccl::ncclResult_t::ncclSuccess;
    // SAFETY: `comm` is a live communicator; `state` is a valid out pointer.
    let result = unsafe { nccl::ncclCommGetAsyncError(comm, &mut state) };
    if result != nccl::ncclResult_t::ncclSuccess {
        result
    } else {
        state
    }
}

/// Why communicators did not become ready.
enum NotReady {
    /// The communicator at this index was still busy at the deadline.
    Timeout(usize),
    /// The communicator at this index failed.
    Failed(usize, nccl::ncclResult_t),
}

/// Waits until every communicator's pending operation is done (enqueued on its stream, or set
/// up), or the deadline passes.
fn wait_ready(comms: &[nccl::ncclComm_t], deadline: Instant) -> Result<(), NotReady> {
    let started = Instant::now();
    let mut pending: Vec<usize> = (0..comms.len()).collect();
    loop {
        let mut failed = None;
        pending.retain(|&i| match async_state(comms[i]) {
            nccl::ncclResult_t::ncclSuccess => false,
            nccl::ncclResult_t::ncclInProgress => true,
            other => {
                failed.get_or_insert((i, other));
                true
            }
        });
        if let Some((i, result)) = failed {
            return Err(NotReady::Failed(i, result));
        }
        if pending.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(NotReady::Timeout(pending[0]));
        }
        backoff(started);
    }
}

/// Spins briefly, then yields, then sleeps: a step's wait costs one host wake-up without burning
/// a core for long waits.
fn backoff(since: Instant) {
    let waited = since.elapsed();
    if waited < Duration::from_micros(100) {
        std::hint::spin_loop();
    } else if waited < Duration::from_millis(2) {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(50));
    }
}

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

fn new_unique_id() -> Result<UniqueId, CommError> {
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
fn open_member(rank: usize, device: &CudaDevice, count: usize) -> Result<Member, CommError> {
    if device.index >= count {
        return Err(CommError::Setup(format!(
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

/// Aborts every communicator that exists (setup failed half way).
fn abort_all(members: &[Member], comms: &[nccl::ncclComm_t]) {
    for (member, &comm) in members.iter().zip(comms) {
        if !comm.is_null() {
            let _ = member.context.bind_to_thread();
            // SAFETY: `comm` was created by NCCL and is not used after this.
            unsafe { nccl::ncclCommAbort(comm) };
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
) -> Result<Vec<nccl::ncclComm_t>, CommError> {
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
                failure = Some(CommError::Setup(format!(
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
) -> Result<(), CommError> {
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
            CommError::Setup(format!(
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

/// The raw communicator, `null` once aborted, with the reason.
struct CommState {
    raw: nccl::ncclComm_t,
    failure: Option<String>,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; the mutex
// around `CommState` serializes the calls.
unsafe impl Send for CommState {}

/// One rank of a group whose tensors travel through NCCL point-to-point operations, for the
/// CubeCL CUDA backend `CubeBackend<CudaRuntime, F, I, BT>`. Build a group with
/// [`DeviceGroup::nccl`], [`DeviceGroup::nccl_from_env`] or [`DeviceGroup::nccl_with_rendezvous`]
/// (or [`NcclTransport::group`] / [`NcclTransport::with_rendezvous`] for the bare transports).
///
/// Drive each rank from one host thread: CubeCL's compute stream is per thread, and an exchange
/// synchronizes the calling thread's stream before NCCL reads or writes the tensors.
/// Dropping the transport aborts its communicator (`ncclCommAbort`), which does not wait for
/// peers; drop it after the last exchange is waited on.
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
    /// One transport per device, all in this process (rank `i` computes on `devices[i]`), with
    /// their communicators created and connected now. Devices must be distinct and exist.
    pub fn group(devices: &[CudaDevice], timeout: Duration) -> Result<Vec<Self>, CommError> {
        if devices.is_empty() {
            return Err(CommError::Setup(
                "an NCCL group needs at least one device; none was given".into(),
            ));
        }
        for (i, device) in devices.iter().enumerate() {
            if let Some(j) = devices[..i].iter().position(|d| d == device) {
                return Err(CommError::Setup(format!(
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
    /// out over a TCP rendezvous at `addr` (`host:port`, where rank 0 listens; see
    /// [`rendezvous`]), then every rank creates and connects its communicator on `device`.
    /// Each step is bounded by `timeout`. A group of one ignores `addr`.
    pub fn with_rendezvous(
        rank: usize,
        world_size: usize,
        device: CudaDevice,
        addr: &str,
        timeout: Duration,
    ) -> Result<Self, CommError> {
        if world_size == 0 || rank >= world_size {
            return Err(CommError::Setup(format!(
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

    /// How long this rank waits for a peer before failing with [`CommError::Timeout`].
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn lock(&self) -> MutexGuard<'_, CommState> {
        self.comm
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn shut_down_error(&self, why: &str) -> CommError {
        CommError::Nccl(format!(
            "rank {}: the NCCL communicator was shut down after an earlier failure ({why}); \
             build a new group",
            self.rank
        ))
    }

    /// The communicator, or the error that shut it down.
    fn usable(&self, state: &CommState) -> Result<nccl::ncclComm_t, CommError> {
        match &state.failure {
            Some(why) => Err(self.shut_down_error(why)),
            None => Ok(state.raw),
        }
    }

    fn check_usable(&self) -> Result<(), CommError> {
        self.usable(&self.lock()).map(|_| ())
    }

    /// Aborts the communicator (stopping its kernels) and records why; later calls fail.
    fn abort(&self, why: String) {
        let mut state = self.lock();
        if !state.raw.is_null() {
            let _ = self.context.bind_to_thread();
            // SAFETY: the communicator is live and not used after this (the pointer is cleared
            // under the lock that every user takes).
            unsafe { nccl::ncclCommAbort(state.raw) };
            state.raw = null_mut();
        }
        state.failure.get_or_insert(why);
    }

    /// Whether the communicator failed (a peer's error, or an abort by another exchange).
    fn health(&self) -> Option<CommError> {
        let state = self.lock();
        if let Some(why) = &state.failure {
            return Some(self.shut_down_error(why));
        }
        match async_state(state.raw) {
            nccl::ncclResult_t::ncclSuccess | nccl::ncclResult_t::ncclInProgress => None,
            other => Some(nccl_error(
                &format!("rank {}: the NCCL communicator failed", self.rank),
                other,
                state.raw,
            )),
        }
    }

    fn check_peer(&self, peer: usize) -> Result<(), CommError> {
        if peer >= self.world_size {
            Err(CommError::Setup(format!(
                "rank {} addressed rank {peer}, but the group has {} ranks",
                self.rank, self.world_size
            )))
        } else if peer == self.rank {
            Err(CommError::Mismatch {
                rank: self.rank,
                peer,
                detail: "a rank cannot send to or receive from itself".into(),
            })
        } else {
            Ok(())
        }
    }

    fn timeout_error(&self, blame: Blame, since: Instant) -> CommError {
        CommError::Timeout {
            rank: self.rank,
            peer: blame.0,
            kind: blame.1,
            waited: since.elapsed(),
        }
    }

    /// Posts `ops` in one NCCL group on the communication stream, waits (bounded) until NCCL
    /// has enqueued them, and records an event behind them. Aborts on failure.
    fn post(&self, ops: &[Op], blame: Blame, posted_at: Instant) -> Result<CudaEvent, CommError> {
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
                    Op::AllGather { send, recv, bytes } => nccl::ncclAllGather(
                        send as *const c_void,
                        recv as *mut c_void,
                        bytes,
                        nccl::ncclDataType_t::ncclUint8,
                        comm,
                        stream,
                    ),
                }
            };
            if let Err(r) = accepted(result) {
                failure = Some(nccl_error(
                    &format!("rank {}: posting {op:?}", self.rank),
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
                    &format!("rank {}: ncclGroupEnd", self.rank),
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
                    &format!("rank {}: posting an exchange", self.rank),
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

    /// Waits for `work` to complete, at most until `posted_at + timeout`; on timeout or failure
    /// the communicator is aborted and the buffers are settled (see [`InFlight`]).
    fn finish(
        &self,
        work: &mut InFlight,
        blame: Blame,
        posted_at: Instant,
    ) -> Result<(), CommError> {
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
                if let Some(error) = self.health() {
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
    fn gather_bytes(&self, bytes: &[u8]) -> Result<Vec<u8>, CommError> {
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
            bytes: bytes.len(),
        };
        work.pending = true;
        match self.post(&[op], blame, posted_at) {
            Ok(event) => work.event = Some(event),
            Err(error) => {
                work.settle_after_abort(&self.stream);
                return Err(error);
            }
        }
        self.finish(&mut work, blame, posted_at)?;
        let gathered = client.read_one(recv).map_err(|e| {
            CommError::Nccl(format!(
                "rank {}: reading the gathered values back: {e}",
                self.rank
            ))
        })?;
        let expected = bytes.len() * self.world_size;
        if gathered.len() < expected {
            return Err(CommError::Nccl(format!(
                "rank {}: read {} gathered bytes back, expected {expected}",
                self.rank,
                gathered.len()
            )));
        }
        Ok(gathered[..expected].to_vec())
    }

    /// Host-waits for the calling thread's CubeCL stream on this device.
    fn sync_compute(&self, client: &ComputeClient<CudaRuntime>) -> Result<(), CommError> {
        cubecl::future::block_on(client.sync()).map_err(|e| {
            CommError::Nccl(format!(
                "rank {}: synchronizing the compute stream before NCCL: {e}",
                self.rank
            ))
        })
    }

    /// A tensor to send, contiguous on this rank's device.
    fn prepare_send(&self, tensor: CudaTensor) -> Result<CudaTensor, CommError> {
        if tensor.device != self.device {
            return Err(CommError::Setup(format!(
                "rank {}: a tensor to send is on {:?}, but this rank computes on {:?}",
                self.rank, tensor.device, self.device
            )));
        }
        if tensor.qparams.is_some() || !is_float(tensor.dtype) {
            return Err(CommError::Setup(format!(
                "rank {}: the NCCL transport sends float tensors, got {:?}",
                self.rank, tensor.dtype
            )));
        }
        Ok(into_contiguous(tensor))
    }
}

impl<F, I, BT> Drop for NcclTransport<F, I, BT> {
    fn drop(&mut self) {
        let state = self
            .comm
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if !state.raw.is_null() {
            let _ = self.context.bind_to_thread();
            // SAFETY: the communicator is live and nothing uses it any more.
            unsafe { nccl::ncclCommAbort(state.raw) };
            state.raw = null_mut();
        }
    }
}

fn is_float(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::F64 | DType::F32 | DType::Flex32 | DType::F16 | DType::BF16
    )
}

/// Who a timeout blames: the peer and the kind of message expected from it.
type Blame = (usize, MessageKind);

/// One NCCL operation of a group, on device addresses.
#[derive(Debug, Clone, Copy)]
enum Op {
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
    AllGather {
        send: u64,
        recv: u64,
        bytes: usize,
    },
}

/// The device address of `handle`'s memory (offsets applied), keeping the memory alive in `keep`.
fn device_pointer(
    client: &ComputeClient<CudaRuntime>,
    handle: &Handle,
    bytes: usize,
    keep: &mut Vec<Box<dyn Send>>,
) -> Result<u64, CommError> {
    let resource = client.get_resource(handle.clone()).map_err(|e| {
        CommError::Nccl(format!("could not get the device address of a buffer: {e}"))
    })?;
    let (pointer, size) = (resource.resource().ptr, resource.resource().size);
    if (size as usize) < bytes {
        return Err(CommError::Nccl(format!(
            "a buffer holds {size} bytes, fewer than the {bytes} its tensor needs"
        )));
    }
    keep.push(Box::new(resource));
    Ok(pointer)
}

/// GPU work posted on the communication stream, with everything it reads or writes.
#[derive(Default)]
struct InFlight {
    /// Completes after the work; `None` when nothing was posted.
    event: Option<CudaEvent>,
    /// Tensors, handles and resources the work uses.
    keep: Vec<Box<dyn Send>>,
    /// Whether the work was posted and may still use the buffers (which must then not be
    /// freed).
    pending: bool,
}

impl InFlight {
    /// After an abort: gives the kernels [`ABORT_GRACE`] to stop. If they do not, the buffers
    /// are leaked on drop rather than freed under a kernel that may still write into them.
    fn settle_after_abort(&mut self, stream: &CudaStream) {
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
struct NcclExchange<'a, F, I, BT> {
    transport: &'a NcclTransport<F, I, BT>,
    work: InFlight,
    posted_at: Instant,
    blame: Blame,
    receives: Vec<Incoming>,
    received: Vec<Vec<CudaTensor>>,
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
    fn wait(mut self: Box<Self>) -> Result<Vec<Received<Cube<F, I, BT>>>, CommError> {
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
    ) -> Result<Box<dyn Exchange<Cube<F, I, BT>> + '_>, CommError> {
        let posted_at = Instant::now();
        for message in &sends {
            self.check_peer(message.peer)?;
        }
        for incoming in &receives {
            self.check_peer(incoming.peer)?;
            if let Some(layout) = incoming.layouts.iter().find(|l| !is_float(l.dtype)) {
                return Err(CommError::Setup(format!(
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
            .collect::<Result<Vec<_>, CommError>>()?;
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

        // Every kernel that wrote a sent tensor, or last used a receive buffer's memory, is done.
        self.sync_compute(&client)?;

        if !ops.is_empty() {
            work.pending = true;
            match self.post(&ops, blame, posted_at) {
                Ok(event) => work.event = Some(event),
                Err(error) => {
                    work.settle_after_abort(&self.stream);
                    return Err(error);
                }
            }
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

    fn all_gather_values(&self, values: &[u64]) -> Result<Vec<Vec<u64>>, CommError> {
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
            return Err(CommError::Mismatch {
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
    /// Fails with [`CommError::Setup`] for an empty list, a repeated device or a device that
    /// does not exist, and with [`CommError::Nccl`] when libcuda or libnccl cannot be loaded.
    pub fn nccl(devices: &[CudaDevice]) -> Result<Vec<Self>, CommError> {
        Self::nccl_with_timeout(devices, DEFAULT_TIMEOUT)
    }

    /// [`DeviceGroup::nccl`] with a different wait limit for silent peers.
    pub fn nccl_with_timeout(
        devices: &[CudaDevice],
        timeout: Duration,
    ) -> Result<Vec<Self>, CommError> {
        Ok(NcclTransport::<F, I, BT>::group(devices, timeout)?
            .into_iter()
            .map(DeviceGroup::new)
            .collect())
    }

    /// This process's rank of a multi-process NCCL group described torchrun-style by the
    /// environment: `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (the CUDA device ordinal), and
    /// `MASTER_ADDR`/`MASTER_PORT`, where rank 0 listens for the rendezvous (see
    /// [`DeviceGroup::nccl_with_rendezvous`]). Missing or malformed variables give
    /// [`CommError::Setup`] naming the variable. Waits up to [`DEFAULT_TIMEOUT`].
    ///
    /// Under torchrun itself, `MASTER_PORT` is taken by torchrun's own store: use
    /// [`DeviceGroup::nccl_with_rendezvous`] with a port of your own there.
    pub fn nccl_from_env() -> Result<Self, CommError> {
        Self::nccl_from_env_with_timeout(DEFAULT_TIMEOUT)
    }

    /// [`DeviceGroup::nccl_from_env`] with a different wait limit.
    pub fn nccl_from_env_with_timeout(timeout: Duration) -> Result<Self, CommError> {
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
    pub fn nccl_with_rendezvous(
        rank: usize,
        world_size: usize,
        device: CudaDevice,
        addr: &str,
        timeout: Duration,
    ) -> Result<Self, CommError> {
        NcclTransport::<F, I, BT>::with_rendezvous(rank, world_size, device, addr, timeout)
            .map(DeviceGroup::new)
    }
}

// The id travels as raw bytes; NCCL's is exactly this size.
const _: () = assert!(std::mem::size_of::<nccl::ncclUniqueId>() == ID_BYTES);
