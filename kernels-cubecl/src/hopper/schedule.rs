//! How the Hopper attention forward's consumer warpgroups order their work: FlashAttention-3's
//! two overlaps, each a compile-time switch of the kernel. The default is both; a thread-local
//! override lets benchmarks and tests run the others (each is its own compiled kernel).

use std::cell::Cell;

/// The overlaps one compiled Hopper forward uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ForwardSchedule {
    /// Within a warpgroup: the scores of key tile `t` are issued before the `P V` product of tile
    /// `t - 1`, and the softmax of tile `t` runs while that product does (two score tiles in
    /// registers). Without it each tile is scores, softmax, `P V` in turn.
    pub intra_overlap: bool,
    /// Between the two consumer warpgroups: they take turns (two named barriers) to issue their
    /// products, so that one's softmax runs while the other's products do.
    pub pingpong: bool,
}

impl Default for ForwardSchedule {
    /// Both overlaps, as FlashAttention-3 runs head dims up to 128.
    fn default() -> Self {
        Self {
            intra_overlap: true,
            pingpong: true,
        }
    }
}

thread_local! {
    static FORCED: Cell<Option<ForwardSchedule>> = const { Cell::new(None) };
}

/// The schedule the Hopper forward uses on this thread: the forced one, else the default.
pub fn current() -> ForwardSchedule {
    FORCED.with(Cell::get).unwrap_or_default()
}

/// Makes the Hopper forward launched on this thread use `schedule` (`None`: the default again).
pub fn force(schedule: Option<ForwardSchedule>) {
    FORCED.with(|forced| forced.set(schedule));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forced_schedule_holds_on_its_thread_until_released() {
        let plain = ForwardSchedule {
            intra_overlap: false,
            pingpong: false,
        };
        assert_eq!(current(), ForwardSchedule::default());
        force(Some(plain));
        assert_eq!(current(), plain);
        std::thread::spawn(|| assert_eq!(current(), ForwardSchedule::default()))
            .join()
            .unwrap();
        force(None);
        assert_eq!(current(), ForwardSchedule::default());
    }
}
