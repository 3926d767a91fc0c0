//! A mask as the Hopper attention kernels take it, pure logic the forward and the backward share:
//! its parts as compile-time switches and its band's run-time values. Every mask is a band
//! (`crate::mask`): query row `i` sees keys from `i + lower` (a window) up to `i + upper` (causal,
//! a window), within its document (documents).

use crate::dims::AttentionDims;
use crate::mask::{KernelMask, MaskKind};
use crate::Mask;

/// The `#define` lines of `kind`'s parts: `DISTFLASH_UPPER` (an upper bound per row),
/// `DISTFLASH_LOWER` (a lower one) and `DISTFLASH_DOCUMENTS` (a document table argument).
pub fn switches(kind: MaskKind) -> String {
    let flag = |on: bool| u8::from(on);
    format!(
        "#define DISTFLASH_UPPER {}\n#define DISTFLASH_LOWER {}\n#define DISTFLASH_DOCUMENTS {}\n",
        flag(kind.upper),
        flag(kind.lower),
        flag(kind.documents),
    )
}

/// The run-time values of a mask for one call, as the kernels' scalars hold them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BandScalars {
    /// Query row `i` sees keys up to `i + upper`: the shift `q_offset - kv_offset` plus the keys
    /// a window sees after the diagonal (`i32` bits; 0 without an upper bound).
    pub upper: u32,
    /// Query row `i` sees keys from `i + lower`: the shift minus the keys a window sees before
    /// the diagonal (`i32` bits; 0 without a lower bound).
    pub lower: u32,
    /// The documents': positions of query and key row 0, entries between two batch rows'
    /// bounds (0 when shared) and bounds per batch row; zeros without documents.
    pub documents: [u32; 4],
}

/// The [`BandScalars`] of `mask` for a call of `dims`, each part clamped as [`Mask::bounds`]
/// clamps it.
pub fn scalars(dims: &AttentionDims, mask: &Mask) -> BandScalars {
    let bounds = mask.bounds(dims);
    let kind = mask.kind();
    let offset = |on: bool, value: i32| if on { value as u32 } else { 0 };
    BandScalars {
        upper: offset(kind.upper, bounds.shift + bounds.after),
        lower: offset(kind.lower, bounds.shift - bounds.before),
        documents: [
            bounds.q_pos0,
            bounds.kv_pos0,
            bounds.doc_stride,
            bounds.doc_count,
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::super::coverage::test_dims as dims;
    use super::*;
    use crate::{Documents, SlidingWindow};

    #[test]
    fn switches_name_the_parts() {
        let parts = |mask: Mask| switches(mask.kind());
        assert_eq!(
            parts(Mask::none()),
            "#define DISTFLASH_UPPER 0\n#define DISTFLASH_LOWER 0\n#define DISTFLASH_DOCUMENTS 0\n"
        );
        assert_eq!(
            parts(Mask::causal()),
            "#define DISTFLASH_UPPER 1\n#define DISTFLASH_LOWER 0\n#define DISTFLASH_DOCUMENTS 0\n"
        );
        let documents = Documents::from_cu_seqlens(&[0, 1, 517]).unwrap();
        assert_eq!(
            parts(
                Mask::causal()
                    .with_window(SlidingWindow::causal(64).unwrap())
                    .with_documents(documents)
            ),
            "#define DISTFLASH_UPPER 1\n#define DISTFLASH_LOWER 1\n#define DISTFLASH_DOCUMENTS 1\n"
        );
        // A two-sided window bounds both ends.
        assert_eq!(
            parts(Mask::none().with_window(SlidingWindow::two_sided(3, 5))),
            "#define DISTFLASH_UPPER 1\n#define DISTFLASH_LOWER 1\n#define DISTFLASH_DOCUMENTS 0\n"
        );
    }

    #[test]
    fn scalars_carry_the_band_and_the_documents() {
        let d = dims(128);
        let causal = scalars(&d, &Mask::causal().at(217, 0));
        assert_eq!((causal.upper as i32, causal.lower), (217, 0));
        assert_eq!(causal.documents, [0; 4]);
        // Keys ahead of the queries: a negative shift.
        assert_eq!(scalars(&d, &Mask::causal().at(0, 40)).upper as i32, -40);
        // A window of 64 keys (the diagonal and 63 before it) at shift 10: keys i - 53 to i + 10.
        let window = Mask::causal()
            .with_window(SlidingWindow::causal(64).unwrap())
            .at(10, 0);
        let band = scalars(&d, &window);
        assert_eq!([band.upper as i32, band.lower as i32], [10, -53]);
        // A two-sided window: 3 keys before, 5 after.
        let band = scalars(
            &d,
            &Mask::none().with_window(SlidingWindow::two_sided(3, 5)),
        );
        assert_eq!([band.upper as i32, band.lower as i32], [5, -3]);
        // Documents alone: no bound but theirs; the positions of row 0 and the bounds per batch
        // row (shared: stride 0).
        let documents = Documents::from_cu_seqlens(&[0, 1, 200, 700]).unwrap();
        let band = scalars(&d, &Mask::none().with_documents(documents).at(100, 50));
        assert_eq!((band.upper, band.lower), (0, 0));
        assert_eq!(band.documents, [100, 50, 0, 4]);
    }
}
