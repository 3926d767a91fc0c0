//! How the Hopper attention forward orders its work: FlashAttention-3's two overlaps of the
//! consumer warpgroups, each a compile-time switch of the kernel, the order in which cubes
//! take the (batch, head) slices, and whether the grid is persistent. The default is both
//! overlaps and grouped slices on a persistent grid (for a whole attention; the steps keep a
//! cube per block); a thread-local override lets benchmarks and tests run the others. How the
//! backward splits a GQA group's query heads over cubes ([`BackwardSchedule`], [`HeadSplit`])
//! has its own thread-local override ([`force_backward`]).

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
    /// Cubes take the slices in groups whose keys and values fit in L2 together (see
    /// `forward_plan::slice_group`), each group's heaviest blocks first; without it, every
    /// slice's block `b` starts before any slice's block `b - 1` (the grid's first wave then
    /// spans every head's keys and values).
    pub grouped_slices: bool,
    /// A whole attention on a persistent grid: one cube per multiprocessor, each taking blocks
    /// (in the order above, the next one claimed by whichever cube is free first) until none is
    /// left, its producer copying the next block's Q and first K and V tiles while the consumers
    /// finish the current one's last `P V` and store its O. The steps of the stat-carrying
    /// contract keep a cube per block whatever this says.
    pub persistent: bool,
}

impl Default for ForwardSchedule {
    /// Both overlaps, as FlashAttention-3 runs head dims up to 128, and grouped slices, on a
    /// persistent grid (measured on an H200 against a cube per block, 8 calls queued: +3% at
    /// 16K, +1% at 32K, and +3-14% at 8K, whose rows spread that much; causal, head dim 128).
    fn default() -> Self {
        Self {
            intra_overlap: true,
            pingpong: true,
            grouped_slices: true,
            persistent: true,
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

/// How many cubes walk the query heads of one GQA group for one block of 128 keys in the Hopper
/// attention backward (`backward_plan::head_parts`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum HeadSplit {
    /// The plan's choice, the default: split only where a GQA/MQA call would otherwise give the
    /// device fewer than `backward_plan::MIN_CUBES_PER_SM` cubes per multiprocessor (measured
    /// on an H200, GQA 32/8 at 8K: the backward 4.5% faster than unsplit; at 16K it does not
    /// split).
    #[default]
    Auto,
    /// One cube per (key/value head, key block) walks every query head of the group, whatever
    /// the call.
    Never,
    /// The group's heads over `n` cubes, or over the largest divisor of the group size below
    /// `n` (`usize::MAX`: one query head per cube).
    Parts(usize),
}

/// Who adds each key block's dQ to a query tile's sum, in the fixed order, in the deterministic
/// Hopper backward (`attention_backward.cu`, `DISTFLASH_PRODUCER_ADDS`). Both forms add the same
/// values in the same order: the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum DeterministicAdds {
    /// Each consumer warpgroup waits for its turn and adds its dQ itself (vector atomics).
    Consumers,
    /// FlashAttention-3's form, the default: the consumers write their dQ (f32) to a buffer in
    /// shared memory and go on; a producer warp per warpgroup waits for the turn and adds the
    /// buffer with a bulk reduction (measured on an H200: forward+backward 1.13-1.17x the
    /// consumers' form).
    #[default]
    Producer,
}

/// What the Hopper backward may choose per call. The deterministic backward and the backward
/// steps never split (see `backward_plan::head_parts`), whatever this says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct BackwardSchedule {
    /// See [`HeadSplit`].
    pub head_split: HeadSplit,
    /// See [`DeterministicAdds`] (read only by the deterministic backward).
    pub deterministic_adds: DeterministicAdds,
}

thread_local! {
    static FORCED_BACKWARD: Cell<Option<BackwardSchedule>> = const { Cell::new(None) };
}

/// The schedule the Hopper backward uses on this thread: the forced one, else the default
/// (the plan's choice).
pub fn current_backward() -> BackwardSchedule {
    FORCED_BACKWARD.with(Cell::get).unwrap_or_default()
}

/// Makes the Hopper backward launched on this thread use `schedule` (`None`: the default
/// again).
pub fn force_backward(schedule: Option<BackwardSchedule>) {
    FORCED_BACKWARD.with(|forced| forced.set(schedule));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forced_backward_schedule_holds_on_its_thread_until_released() {
        let never = BackwardSchedule {
            head_split: HeadSplit::Never,
            deterministic_adds: DeterministicAdds::Consumers,
        };
        assert_eq!(current_backward().head_split, HeadSplit::Auto);
        assert_eq!(
            current_backward().deterministic_adds,
            DeterministicAdds::Producer
        );
        force_backward(Some(never));
        assert_eq!(current_backward(), never);
        // The forward's override is another.
        assert_eq!(current(), ForwardSchedule::default());
        std::thread::spawn(|| assert_eq!(current_backward(), BackwardSchedule::default()))
            .join()
            .unwrap();
        force_backward(None);
        assert_eq!(current_backward(), BackwardSchedule::default());
    }

    #[test]
    fn a_forced_schedule_holds_on_its_thread_until_released() {
        let plain = ForwardSchedule {
            intra_overlap: false,
            pingpong: false,
            grouped_slices: false,
            persistent: true,
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
