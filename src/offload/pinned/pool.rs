//! Page-locked host memory for the CUDA offload, per device: buffers from `cuMemHostAlloc`,
//! allocated once (before the first step by [`reserve`], or on demand) and reused by every later
//! step, never freed while the process runs. A step takes the smallest free buffer that fits each
//! tensor closely, at most an eighth larger ([`lease`]), and gives it back when the tensor is back
//! on the device. A much larger free buffer is left to the tensors of its own size: otherwise one
//! kind of tensor takes the buffers reserved for another, which then allocates again (the
//! optimizer state's 171 MiB chunks in the layer checkpoints' 0.5-2 GiB buffers pinned 21-56 GiB
//! more than planned on two H200s).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use cudarc::driver::{result, sys, CudaContext};

use crate::offload::host_memory;
use crate::Error;

/// One `cuMemHostAlloc` allocation.
struct PinnedBuffer {
    address: usize,
    len: usize,
}

/// A device's free buffers, and how much was allocated in all.
#[derive(Default)]
struct Pool {
    free: Vec<PinnedBuffer>,
    allocated: u64,
}

/// The pools by device index.
fn pools() -> &'static Mutex<HashMap<usize, Pool>> {
    static POOLS: OnceLock<Mutex<HashMap<usize, Pool>>> = OnceLock::new();
    POOLS.get_or_init(Default::default)
}

fn with_pool<T>(device: usize, f: impl FnOnce(&mut Pool) -> T) -> T {
    let mut pools = pools().lock().unwrap_or_else(PoisonError::into_inner);
    f(pools.entry(device).or_default())
}

/// Whether a free buffer of `len` bytes may hold a tensor of `bytes`: it holds it and is at most
/// an eighth larger.
fn fits_closely(len: usize, bytes: usize) -> bool {
    len >= bytes && len - bytes <= bytes / 8
}

/// Index of the smallest of `free` that holds `bytes` closely ([`fits_closely`]).
fn best_fit(free: impl Iterator<Item = usize>, bytes: usize) -> Option<usize> {
    (free.enumerate())
        .filter(|&(_, len)| fits_closely(len, bytes))
        .min_by_key(|&(_, len)| len)
        .map(|(i, _)| i)
}

/// The sizes of `wanted` that buffers of the sizes `free` cannot serve, each wanted size
/// (largest first) taking the smallest free buffer that holds it closely ([`fits_closely`]).
pub(super) fn unserved(free: &[usize], wanted: &[usize]) -> Vec<usize> {
    let mut free = free.to_vec();
    let mut wanted = wanted.to_vec();
    wanted.sort_unstable_by(|a, b| b.cmp(a));
    let mut missing = Vec::new();
    for size in wanted {
        match best_fit(free.iter().copied(), size) {
            Some(i) => {
                free.swap_remove(i);
            }
            None => missing.push(size),
        }
    }
    missing
}

/// Allocates `bytes` of pinned memory after checking the host has them available.
fn allocate(context: &Arc<CudaContext>, bytes: usize) -> Result<PinnedBuffer, Error> {
    host_memory::check_available(bytes as u64)?;
    let failed = |why: String| Error::Offload {
        needed: bytes as u64,
        why,
    };
    context
        .bind_to_thread()
        .map_err(|e| failed(format!("binding the CUDA context: {e:?}")))?;
    // SAFETY: a plain allocation in the bound context; the pointer is owned by the pool from here.
    let address = unsafe { result::malloc_host(bytes.max(1), sys::CU_MEMHOSTALLOC_PORTABLE) }
        .map_err(|e| {
            failed(format!(
                "cuMemHostAlloc refused to pin the memory ({e:?}); the host may limit locked \
                 memory (ulimit -l) or have too little of it: offload less"
            ))
        })?;
    Ok(PinnedBuffer {
        address: address as usize,
        len: bytes,
    })
}

/// Makes sure `device`'s pool can serve tensors of every size of `sizes` at once, allocating
/// what it lacks.
///
/// # Errors
///
/// [`Error::Offload`] when the host has too little memory for what must be allocated, or
/// pinning fails.
pub(crate) fn reserve(
    context: &Arc<CudaContext>,
    device: usize,
    sizes: &[usize],
) -> Result<(), Error> {
    let free: Vec<usize> = with_pool(device, |pool| pool.free.iter().map(|b| b.len).collect());
    let missing = unserved(&free, sizes);
    host_memory::check_available(missing.iter().map(|&s| s as u64).sum())?;
    for bytes in missing {
        let buffer = allocate(context, bytes)?;
        with_pool(device, |pool| {
            pool.allocated += bytes as u64;
            pool.free.push(buffer);
        });
    }
    Ok(())
}

/// A pinned buffer lent to one tensor, back in its pool when dropped.
pub(super) struct Lease {
    buffer: Option<PinnedBuffer>,
    device: usize,
}

// SAFETY: the lease owns its buffer (no one else holds the address until it is given back), and
// the copies into and out of it are ordered by events the holder waits on.
unsafe impl Send for Lease {}
// SAFETY: as above; `&Lease` only reads the address and length.
unsafe impl Sync for Lease {}

impl Lease {
    /// A lease of no buffer (for a tensor of no bytes, or one whose buffer went back).
    pub(super) fn none(device: usize) -> Self {
        Self {
            buffer: None,
            device,
        }
    }

    /// The buffer's address (null for no buffer).
    pub(super) fn address(&self) -> *mut c_void {
        self.buffer
            .as_ref()
            .map_or(std::ptr::null_mut(), |b| b.address as *mut c_void)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(buffer) = self.buffer.take() {
            with_pool(self.device, |pool| pool.free.push(buffer));
        }
    }
}

/// A buffer of at least `bytes` from `device`'s pool, allocated when no free one holds them
/// closely ([`fits_closely`]).
///
/// # Errors
///
/// As [`reserve`].
pub(super) fn lease(
    context: &Arc<CudaContext>,
    device: usize,
    bytes: usize,
) -> Result<Lease, Error> {
    if bytes == 0 {
        return Ok(Lease::none(device));
    }
    let free = with_pool(device, |pool| {
        let i = best_fit(pool.free.iter().map(|b| b.len), bytes)?;
        Some(pool.free.swap_remove(i))
    });
    let buffer = match free {
        Some(buffer) => buffer,
        None => {
            let buffer = allocate(context, bytes)?;
            with_pool(device, |pool| pool.allocated += bytes as u64);
            buffer
        }
    };
    Ok(Lease {
        buffer: Some(buffer),
        device,
    })
}

/// Bytes of pinned memory allocated for `device` so far.
pub(crate) fn allocated(device: usize) -> u64 {
    with_pool(device, |pool| pool.allocated)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_size_takes_the_smallest_buffer_that_holds_it_closely() {
        assert!(unserved(&[10, 5, 5], &[5, 10, 5]).is_empty());
        assert_eq!(unserved(&[10, 5], &[5, 5, 10]), [5]);
        assert_eq!(unserved(&[], &[3, 7]), [7, 3]);
        assert_eq!(unserved(&[100, 4], &[4, 90]), Vec::<usize>::new());
        // A buffer more than an eighth larger serves nothing: it stays for its own size.
        assert_eq!(unserved(&[100], &[4, 90]), [4]);
        assert_eq!(unserved(&[100], &[4]), [4]);
        assert_eq!(best_fit([8, 3, 5].into_iter(), 4), None);
        assert_eq!(best_fit([8, 3, 5, 4].into_iter(), 4), Some(3));
        assert_eq!(best_fit([9, 8].into_iter(), 8), Some(1));
        assert_eq!(best_fit([9].into_iter(), 8), Some(0));
        assert_eq!(best_fit([10].into_iter(), 8), None);
        assert_eq!(best_fit([3].into_iter(), 4), None);
    }

    #[test]
    fn the_optimizer_states_chunks_leave_the_checkpoints_buffers_alone() {
        // Layer checkpoints of 512 MiB reserved first, then the state's 171 MiB vectors: the
        // state gets buffers of its own, and the next step's checkpoints still find theirs.
        let (mib, checkpoint, state) = (1 << 20, 512 << 20, 170 << 20);
        let free = vec![checkpoint; 32];
        let wanted = vec![state; 96];
        assert_eq!(unserved(&free, &wanted).len(), 96);
        assert!(unserved(&free, &[checkpoint; 32]).is_empty());
        assert!(unserved(&[checkpoint + 60 * mib], &[checkpoint]).is_empty());
    }
}
