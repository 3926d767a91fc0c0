//! The CUDA driver and NCCL libraries, loaded at run time: probing them (presence, symbols,
//! version) and turning their failures, panics included, into [`Error::Nccl`].

use crate::Error;
use std::ffi::{c_char, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::null_mut;
use std::sync::OnceLock;

use cudarc::driver::{CudaContext, DriverError};
use cudarc::nccl::sys as nccl;

/// Oldest NCCL with non-blocking communicators (`ncclCommInitRankConfig`).
const MIN_NCCL_VERSION: i32 = 21400;

/// Checks that the CUDA driver and NCCL (2.14 or newer) can be loaded, and returns NCCL's
/// version code (`22803` for 2.28.3). Fails with [`Error::Nccl`], never a panic.
pub fn probe() -> Result<i32, Error> {
    static RESULT: OnceLock<Result<i32, Error>> = OnceLock::new();
    RESULT
        .get_or_init(|| {
            probe_driver()?;
            probe_nccl()
        })
        .clone()
}

/// Number of CUDA devices on this machine; [`Error::Nccl`] (not a panic) when there is no
/// usable CUDA driver.
pub fn device_count() -> Result<usize, Error> {
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
pub(super) fn guarded<T>(doing: &str, f: impl FnOnce() -> T) -> Result<T, Error> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|panic| {
        let why = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown panic".into());
        Error::Nccl(format!("{doing}: {why}"))
    })
}

fn probe_driver() -> Result<(), Error> {
    static RESULT: OnceLock<Result<(), Error>> = OnceLock::new();
    RESULT
        .get_or_init(|| {
            // SAFETY: only tries to open the library, with cudarc's own list of names.
            if !unsafe { cudarc::driver::sys::is_culib_present() } {
                return Err(Error::Nccl(
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

fn probe_nccl() -> Result<i32, Error> {
    // SAFETY: only tries to open the library, with cudarc's own list of names.
    if !unsafe { nccl::is_culib_present() } {
        return Err(Error::Nccl(format!(
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
        return Err(Error::Nccl(format!(
            "the loaded libnccl lacks {missing:?}: this transport needs NCCL 2.14 or newer"
        )));
    }
    let version = guarded(
        "asking NCCL its version",
        cudarc::nccl::result::get_nccl_version,
    )?
    .map_err(|e| nccl_error("ncclGetVersion", e.0, null_mut()))?;
    if version < MIN_NCCL_VERSION {
        return Err(Error::Nccl(format!(
            "NCCL {} is too old: this transport needs NCCL 2.14 or newer (non-blocking \
             communicators)",
            version_text(version)
        )));
    }
    Ok(version)
}

pub(super) fn driver_error(doing: &str, error: DriverError) -> Error {
    Error::Nccl(format!("{doing}: CUDA error {error:?}"))
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

pub(super) fn nccl_error(doing: &str, result: nccl::ncclResult_t, comm: nccl::ncclComm_t) -> Error {
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
    Error::Nccl(format!("{doing}: {text} ({result:?}){last}"))
}

/// Success and "in progress" (non-blocking communicators) are both fine right after a call.
pub(super) fn accepted(result: nccl::ncclResult_t) -> Result<(), nccl::ncclResult_t> {
    match result {
        nccl::ncclResult_t::ncclSuccess | nccl::ncclResult_t::ncclInProgress => Ok(()),
        other => Err(other),
    }
}
