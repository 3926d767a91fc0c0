//! Room on disk for a checkpoint: what a [`Trainer`](crate::train::Trainer)'s checkpoint takes
//! ([`checkpoint_bytes`]) against what the filesystem that will hold it has available
//! ([`available`]), so that a run whose checkpoint cannot fit stops before it trains rather
//! than after, and a save that cannot fit stops before it writes.

use std::path::Path;

use crate::byte_units::format_bytes;
use crate::Error;

/// Bytes counted per file of a checkpoint beyond its tensors' elements: a shard's safetensors
/// header, the Burn record's names and shapes (a few KiB at LLaMA-7B's 291 tensors), the whole
/// of `trainer.json`.
pub const FILE_OVERHEAD: u64 = 1 << 20;

/// Bytes of a checkpoint of a model of `parameters` elements trained by `world` ranks: the model
/// in f32 (Burn's full-precision record), and either the replicated AdamW's two f32 moments
/// (`sharded` false) or, under ZeRO 1/2, each rank's f32 master weights and two moments over
/// the flat vector padded to a multiple of `world`; [`FILE_OVERHEAD`] per file.
pub fn checkpoint_bytes(parameters: u64, world: usize, sharded: bool) -> u64 {
    let world = world.max(1) as u64;
    let model = 4 * parameters;
    let (optimizer, files) = match sharded {
        true => (12 * parameters.div_ceil(world) * world, 2 + world),
        false => (8 * parameters, 3),
    };
    model + optimizer + files * FILE_OVERHEAD
}

/// Bytes an unprivileged process may still write on the filesystem holding `path` (or, where
/// `path` does not exist yet, its nearest ancestor that does); `None` where the system does not
/// say (not Unix, or no ancestor can be read).
pub fn available(path: &Path) -> Option<u64> {
    let existing = (path.ancestors())
        .map(|p| match p.as_os_str().is_empty() {
            true => Path::new("."),
            false => p,
        })
        .find(|p| p.exists())?;
    available_at(existing)
}

#[cfg(unix)]
fn available_at(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let name = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut stats = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `name` is a NUL-terminated path and `stats` a buffer statvfs fills on success.
    let status = unsafe { libc::statvfs(name.as_ptr(), stats.as_mut_ptr()) };
    if status != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it wrote the whole structure.
    let stats = unsafe { stats.assume_init() };
    // Both are u64 on 64-bit Linux, narrower on some other Unix targets.
    #[allow(clippy::useless_conversion)]
    let (blocks, block_bytes) = (u64::from(stats.f_bavail), u64::from(stats.f_frsize));
    Some(blocks.saturating_mul(block_bytes))
}

#[cfg(not(unix))]
fn available_at(_path: &Path) -> Option<u64> {
    None
}

/// Checks that the filesystem that will hold the checkpoint directory `dir` has `needed` bytes
/// available ([`checkpoint_bytes`]).
///
/// # Errors
///
/// [`Error::Invalid`] naming both sizes when it has fewer; none when the system does not say.
pub fn check_room(dir: &Path, needed: u64) -> Result<(), Error> {
    room_error(dir, needed, available(dir)).map_or(Ok(()), Err)
}

/// The error of [`check_room`] for a filesystem with `available` bytes, `None` when the
/// checkpoint fits or `available` is unknown.
fn room_error(dir: &Path, needed: u64, available: Option<u64>) -> Option<Error> {
    let available = available.filter(|&a| a < needed)?;
    Some(Error::Invalid {
        path: Some(dir.to_path_buf()),
        what: "the disk space for the checkpoint".into(),
        expected: format!(
            "{} for the model and the optimizer state in f32",
            format_bytes(needed)
        ),
        got: format!(
            "{} available on its filesystem; free space there, write the run elsewhere (--out) \
             or write no checkpoint (--no-checkpoint)",
            format_bytes(available)
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_counts_the_f32_model_and_the_optimizer_state() {
        let mib = FILE_OVERHEAD;
        // Replicated: the model and two moments in f32; model, optimizer and trainer files.
        assert_eq!(checkpoint_bytes(1000, 1, false), 4000 + 8000 + 3 * mib);
        // Sharded over 3 ranks: 1000 elements padded to 1002, master and two moments each.
        assert_eq!(checkpoint_bytes(1000, 3, true), 4000 + 12 * 1002 + 5 * mib);
        // LLaMA-7B on two ranks under ZeRO 2: about 108 GB.
        let seven_b = checkpoint_bytes(6_738_415_616, 2, true);
        assert!(
            (107_800_000_000..108_000_000_000).contains(&seven_b),
            "{seven_b}"
        );
    }

    #[test]
    fn the_filesystem_of_a_path_not_made_yet_is_its_nearest_ancestors() {
        let dir = std::env::temp_dir();
        let free = available(&dir).expect("the temporary directory's filesystem");
        assert!(free > 0);
        let deeper = available(&dir.join("not-made-yet/checkpoint")).expect("its ancestor's");
        // The same filesystem, read twice: other processes may write between the reads.
        assert!(
            deeper.abs_diff(free) < free / 10 + (1 << 30),
            "{deeper} vs {free}"
        );
        assert!(available(Path::new("relative/not-made-yet")).is_some());
    }

    #[test]
    fn a_checkpoint_larger_than_the_free_space_is_refused_naming_both() {
        let gib = 1u64 << 30;
        let dir = Path::new("runs/x/checkpoint");
        assert!(room_error(dir, 10 * gib, Some(10 * gib)).is_none());
        assert!(room_error(dir, 10 * gib, None).is_none());
        let why = room_error(dir, 108 * gib, Some(90 * gib))
            .expect("short")
            .to_string();
        assert!(
            why.contains("108.00 GiB") && why.contains("90.00 GiB") && why.contains("runs/x"),
            "{why}"
        );
        assert!(check_room(&std::env::temp_dir(), 1).is_ok());
        assert!(check_room(&std::env::temp_dir(), u64::MAX).is_err());
    }
}
