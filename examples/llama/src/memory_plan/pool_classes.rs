//! [`PoolClasses`]: the size classes of CubeCL 0.10's memory pools on CUDA, as a pure function
//! of the device's total memory, and how many bytes of pages a set of buffers of one class
//! reserves.
//!
//! CubeCL 0.10's CUDA runtime sets `max_page_size` to a quarter of the device's total memory
//! (`cuDeviceTotalMem`) and the alignment to 512 bytes, and builds its pools with the default
//! `MemoryConfiguration::SubSlices` (`cubecl-runtime`, `MemoryManagement::from_configuration`):
//! starting from `max_page`, while the page is at least 32 MiB it is divided by 4 (rounded up to
//! the alignment) and becomes a sliced class whose slices are at most `page / 2^k` (`k` = 1 for
//! the largest such page, 2 for the next, ...); a last class has pages of `max_page` and takes
//! slices up to a whole page. A buffer goes to the first class, smallest first, that accepts it:
//! one whose largest slice is at least the buffer, or whose page the buffer fills to more than
//! 80% (`SlicedPool::accept`). A buffer that fits no free space in its class's pages makes the
//! class allocate a whole new page, and the pools give no page back during training: a class's
//! pages serve only buffers of that class. The planner counts a step's buffers by the pages
//! their classes take: a buffer that fills more than 80% of a page takes a page of its own (on an
//! H200 a `[16384, 4096]` bf16 row of 128 MiB takes a 139.8 MiB page, a `[32000, 4096]` f32
//! gradient of 500 MiB a 559 MiB page), and every class keeps the pages of its own busiest phase.

/// The alignment CubeCL 0.10 gives CUDA's pools (`cuMemAllocPitch`'s row alignment).
pub const CUDA_ALIGNMENT: u64 = 512;

/// The smallest page CubeCL divides further into a smaller class.
const SMALLEST_DIVIDED_PAGE: u64 = 32 << 20;

/// One class of sliced pages: buffers up to `max_slice` (or filling more than 80% of a page)
/// share pages of `page` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolClass {
    /// Bytes of each page the class allocates.
    pub page: u64,
    /// The largest buffer the class slices a page for (beside ones filling 80% of a page).
    pub max_slice: u64,
}

impl PoolClass {
    /// Whether this class takes a buffer of `size` bytes (CubeCL's `SlicedPool::accept`).
    pub fn accepts(&self, size: u64) -> bool {
        size <= self.max_slice
            || (self.page.checked_sub(size)).is_some_and(|unused| unused * 5 < self.page)
    }
}

/// CubeCL 0.10's sliced pool classes on a CUDA device, smallest first, the top class (pages of
/// a quarter of the device's memory) last.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolClasses {
    classes: Vec<PoolClass>,
    alignment: u64,
}

impl PoolClasses {
    /// The classes of a CUDA device of `total_memory` bytes (`cuDeviceTotalMem`).
    pub fn cuda(total_memory: u64) -> Self {
        Self::sub_slices(total_memory / 4, CUDA_ALIGNMENT)
    }

    /// CubeCL's `SubSlices` classes for pages of at most `max_page` bytes aligned to
    /// `alignment` (see the module's documentation).
    pub fn sub_slices(max_page: u64, alignment: u64) -> Self {
        let alignment = alignment.max(1);
        let mut classes = Vec::new();
        let mut page = max_page;
        // The exclusive pool for empty buffers comes first, so the first sliced class's slices
        // are half its page.
        let mut halvings = 1;
        while page >= SMALLEST_DIVIDED_PAGE {
            page = (page / 4).next_multiple_of(alignment);
            classes.push(PoolClass {
                page,
                max_slice: page >> halvings,
            });
            halvings += 1;
        }
        classes.reverse();
        let top = max_page / alignment * alignment;
        classes.push(PoolClass {
            page: top,
            max_slice: top,
        });
        Self { classes, alignment }
    }

    /// Every class, smallest first, the top class last.
    pub fn classes(&self) -> &[PoolClass] {
        &self.classes
    }

    /// The top class: pages of a quarter of the device, for buffers the sliced classes refuse.
    pub fn top(&self) -> PoolClass {
        *self.classes.last().expect("the top class")
    }

    /// The largest sliced class (below the top one); `None` on a device too small for any.
    pub fn largest_sliced(&self) -> Option<PoolClass> {
        let n = self.classes.len();
        (n >= 2).then(|| self.classes[n - 2])
    }

    /// The largest buffer that stays out of the top class whatever its size below it: the
    /// largest sliced class's largest slice (0 on a device with no sliced class).
    pub fn largest_sliced_slice(&self) -> u64 {
        self.largest_sliced().map_or(0, |class| class.max_slice)
    }

    /// The index in [`classes`](Self::classes) of the class a buffer of `size` bytes goes to;
    /// `None` for a buffer larger than a top page, which CubeCL refuses (`BufferTooBig`).
    pub fn class_of(&self, size: u64) -> Option<usize> {
        self.classes.iter().position(|class| class.accepts(size))
    }

    /// Whether `class` is the top class.
    pub fn is_top(&self, class: usize) -> bool {
        class + 1 == self.classes.len()
    }

    /// Bytes of the pages class `class` allocates to hold `sizes` at once: the buffers, each
    /// rounded up to the alignment, placed largest first into the first page with room (a
    /// page's free space is one run here: these buffers are allocated together).
    pub fn pages_reserved(&self, class: usize, sizes: &[u64]) -> u64 {
        let page = self.classes[class].page;
        let mut sorted: Vec<u64> = sizes
            .iter()
            .map(|&s| s.next_multiple_of(self.alignment))
            .collect();
        sorted.sort_unstable_by(|a, b| b.cmp(a));
        let mut free: Vec<u64> = Vec::new();
        for size in sorted {
            match free.iter_mut().find(|room| **room >= size) {
                Some(room) => *room -= size,
                None => free.push(page.saturating_sub(size)),
            }
        }
        free.len() as u64 * page
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `cuDeviceTotalMem` of an H200 as specified: 143,771 MiB.
    const H200_SPECIFIED: u64 = 143_771 << 20;
    /// The total memory CubeCL's pages on the measured H200s imply, 143,155.94 MiB: their top
    /// page, 37,527,470,080 bytes, and the 2,345,466,880-byte page of the class below the
    /// largest sliced one are its quarter and its 64th.
    const H200_MEASURED: u64 = 150_109_880_320;

    #[test]
    fn an_h200_of_143_771_mib_has_six_sliced_classes_and_a_35_gib_top_page() {
        let pools = PoolClasses::cuda(H200_SPECIFIED);
        assert_eq!(H200_SPECIFIED, 150_754_820_096);
        let expected = [
            (9_201_664, 143_776),
            (36_805_632, 1_150_176),
            (147_221_504, 9_201_344),
            (588_886_016, 73_610_752),
            (2_355_544_064, 588_886_016),
            (9_422_176_256, 4_711_088_128),
            (37_688_705_024, 37_688_705_024),
        ];
        let table: Vec<(u64, u64)> = (pools.classes().iter())
            .map(|c| (c.page, c.max_slice))
            .collect();
        assert_eq!(table, expected);
        assert_eq!(pools.largest_sliced_slice(), 4_711_088_128);
        assert_eq!(pools.top().page, 37_688_705_024);
    }

    #[test]
    fn the_pages_that_failed_on_the_measured_h200s_are_a_top_page_and_a_2_2_gib_one() {
        let pools = PoolClasses::cuda(H200_MEASURED);
        assert_eq!(pools.top().page, 37_527_470_080);
        assert_eq!(pools.classes()[4].page, 2_345_466_880);
        assert_eq!(pools.largest_sliced().unwrap().page, 9_381_867_520);
        let specified = PoolClasses::cuda(H200_SPECIFIED);
        assert_ne!(specified.top().page, 37_527_470_080);
    }

    #[test]
    fn a_buffer_goes_to_the_first_class_that_slices_it_or_that_it_fills_to_80_percent() {
        let pools = PoolClasses::cuda(H200_SPECIFIED);
        let top = pools.classes().len() - 1;
        // 1 KiB and 100 KB: the smallest class.
        assert_eq!(pools.class_of(1024), Some(0));
        assert_eq!(pools.class_of(143_776), Some(0));
        assert_eq!(pools.class_of(143_777), Some(1));
        // 600 MB: above the 2.2 GiB class's slices (588,886,016), below 80% of its page.
        assert_eq!(pools.class_of(600_000_000), Some(5));
        // 2 GB fills the 2.2 GiB page to 85%: that class, a page of its own.
        assert_eq!(pools.class_of(2_000_000_000), Some(4));
        // The largest sliced class's slices, then the top class.
        assert_eq!(pools.class_of(4_711_088_128), Some(5));
        assert_eq!(pools.class_of(4_711_088_129), Some(top));
        // 65,536 x 32,000 f32 logits (8.39 GB) fill 89% of an 8.8 GiB page: not the top class.
        assert_eq!(pools.class_of(65_536 * 32_000 * 4), Some(5));
        // LLaMA-7B's summed f32 share on two GPUs (12.55 GiB): the top class.
        assert_eq!(pools.class_of(4 * 3_369_207_808), Some(top));
        assert!(pools.is_top(top) && !pools.is_top(5));
        // The largest sliced class: Llama-3-8B's feed-forward rows of 131,072 tokens (3.5
        // GiB), LLaMA-7B's (2.69 GiB), a third of its page and the 1 GiB `[131072, 4096]` rows,
        // down to the class below's largest slice, a sixteenth of its page; a buffer of that
        // size fills a page of the class below that.
        assert_eq!(pools.class_of(131_072 * 14_336 * 2), Some(5));
        assert_eq!(pools.class_of(131_072 * 11_008 * 2), Some(5));
        assert_eq!(pools.class_of(9_422_176_256 / 3), Some(5));
        assert_eq!(pools.class_of(131_072 * 4096 * 2), Some(5));
        assert_eq!(pools.classes()[4].max_slice, 9_422_176_256 / 16);
        assert_eq!(pools.class_of(9_422_176_256 / 16 + 1), Some(5));
        assert_eq!(pools.class_of(9_422_176_256 / 16), Some(3));
        assert_eq!(pools.class_of(37_688_705_025), None, "beyond a top page");
    }

    #[test]
    fn buffers_of_a_class_pack_into_its_pages_largest_first() {
        let pools = PoolClasses::sub_slices(4096, 16);
        // max_page 4096: no page of 32 MiB, only the top class (pages of 4096).
        assert_eq!(pools.classes().len(), 1);
        assert_eq!(pools.largest_sliced_slice(), 0);
        // 3000 + 1000 in one page, 2500 + 1500 in another; 10 rounds up to 16.
        assert_eq!(pools.pages_reserved(0, &[1000, 2500, 3000, 1500]), 2 * 4096);
        assert_eq!(pools.pages_reserved(0, &[4090, 10]), 2 * 4096);
        assert_eq!(pools.pages_reserved(0, &[4080, 10]), 4096);
        assert_eq!(pools.pages_reserved(0, &[]), 0);
        // An H200's top page holds two 12.55 GiB shares, not three.
        let h200 = PoolClasses::cuda(H200_SPECIFIED);
        let top = h200.classes().len() - 1;
        let share = 4 * 3_369_207_808;
        assert_eq!(h200.pages_reserved(top, &[share, share]), h200.top().page);
        assert_eq!(h200.pages_reserved(top, &[share; 3]), 2 * h200.top().page);
    }

    #[test]
    fn a_small_device_has_fewer_classes() {
        // 1 GiB: max page 256 MiB, classes of 64 and 16 MiB pages.
        let pools = PoolClasses::cuda(1 << 30);
        let pages: Vec<u64> = pools.classes().iter().map(|c| c.page).collect();
        assert_eq!(pages, [16 << 20, 64 << 20, 256 << 20]);
        assert_eq!(pools.largest_sliced().unwrap().max_slice, 32 << 20);
    }

    #[test]
    fn a_sharded_step_buffers_bound_is_half_the_largest_slice_of_a_16_gib_gpu_or_more() {
        use crate::optimizer::MAX_STEP_BUFFER_BYTES;
        assert_eq!(
            PoolClasses::cuda(16 << 30).largest_sliced_slice(),
            512 << 20
        );
        for gib in [16u64, 24, 40, 80, 139, 192] {
            let pools = PoolClasses::cuda(gib << 30);
            let slice = pools.largest_sliced_slice();
            assert!(2 * MAX_STEP_BUFFER_BYTES <= slice, "{gib} GiB");
            // From 80 GiB the step's buffers are slices of a smaller class than the largest
            // sliced one, and at 16 GiB each fills a 256 MiB page of the class below it. At 24
            // and 40 GiB they are slices of the largest sliced class, whose page (a sixteenth of
            // the GPU: 1.5 and 2.5 GiB) is a whole number of them, so the pages cost them no
            // tail, only the last page's rounding.
            let largest = pools.classes().len() - 2;
            let class = pools.class_of(MAX_STEP_BUFFER_BYTES);
            match gib >= 80 || gib == 16 {
                true => assert!(class.is_some_and(|c| c < largest), "{gib} GiB"),
                false => {
                    assert_eq!(class, Some(largest), "{gib} GiB");
                    let page = pools.classes()[largest].page;
                    assert_eq!(page % MAX_STEP_BUFFER_BYTES, 0, "{gib} GiB");
                    let per_page = (page / MAX_STEP_BUFFER_BYTES) as usize;
                    let buffers = vec![MAX_STEP_BUFFER_BYTES; 2 * per_page];
                    assert_eq!(pools.pages_reserved(largest, &buffers), 2 * page);
                }
            }
        }
    }
}
