//! The Hopper matrix product's tile constants and input checks, pure logic: which shapes and
//! element types `gemm.cu` takes, and how many cubes its persistent grid launches.

use crate::kernel_error::KernelError;
use crate::tensor::ElemType;

/// Output rows per tile (two consumer warpgroups of 64 rows).
pub const TILE_M: usize = 128;
/// Output columns per tile (one `wgmma.m64n256k16` per warpgroup and 16-deep step).
pub const TILE_N: usize = 256;
/// Depth of one pipeline stage (64 bf16 = one 128-byte swizzled row).
pub const TILE_K: usize = 64;
/// Pipeline stages in shared memory.
pub const STAGES: usize = 4;
/// Threads per cube: one producer and two consumer warpgroups.
pub const UNITS: usize = 384;
/// Shared memory one cube uses: the stages' A and B tiles, 8 barriers of 8 bytes, and up to
/// 1023 bytes to align the tiles on the 128-byte swizzle's 1024-byte period.
pub const SHARED_BYTES: usize = STAGES * (TILE_M + TILE_N) * TILE_K * 2 + 2 * STAGES * 8 + 1024;

// Within the 227 KiB a Hopper cube may opt into.
const _: () = assert!(SHARED_BYTES <= 232_448);

/// How B is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GemmLayout {
    /// B is `[N, K]` row-major: `C = A B^T` (both operands K-major, as attention's `Q K^T`).
    BTransposed,
    /// B is `[K, N]` row-major: `C = A B` (B N-major, as a linear layer's `x W` or attention's
    /// `P V`).
    BRowMajor,
}

/// The sizes of one product `C[M, N] = A[M, K] op(B)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmShape {
    /// Rows of A and C.
    pub m: usize,
    /// Columns of C.
    pub n: usize,
    /// The reduced dimension.
    pub k: usize,
}

impl GemmShape {
    /// The product's sizes, once `a` (`[M, K]`), `b` (`[N, K]` or `[K, N]` by `layout`) and `c`
    /// (`[M, N]`) agree, A and B are bf16, C is bf16 or f32, and every size is a positive
    /// multiple of its tile and small enough for the copy engine's 32-bit coordinates.
    pub fn check(
        (a, a_elem): (&[usize], ElemType),
        (b, b_elem): (&[usize], ElemType),
        (c, c_elem): (&[usize], ElemType),
        layout: GemmLayout,
    ) -> Result<Self, KernelError> {
        for (name, shape) in [("a", a), ("b", b), ("c", c)] {
            if shape.len() != 2 {
                return Err(KernelError::Rank {
                    name,
                    expected: 2,
                    got: shape.to_vec(),
                });
            }
        }
        if a_elem != ElemType::BF16 || b_elem != ElemType::BF16 {
            return Err(KernelError::DType {
                what: format!(
                    "the Hopper matrix product takes bf16 a and b, got {a_elem:?} and {b_elem:?}"
                ),
            });
        }
        if !matches!(c_elem, ElemType::BF16 | ElemType::F32) {
            return Err(KernelError::DType {
                what: format!("the Hopper matrix product writes a bf16 or f32 c, got {c_elem:?}"),
            });
        }
        let (m, k) = (a[0], a[1]);
        let (n, b_k) = match layout {
            GemmLayout::BTransposed => (b[0], b[1]),
            GemmLayout::BRowMajor => (b[1], b[0]),
        };
        if b_k != k {
            let expected = match layout {
                GemmLayout::BTransposed => vec![n, k],
                GemmLayout::BRowMajor => vec![k, n],
            };
            return Err(KernelError::ShapeMismatch {
                what: format!("b of a product with a of shape {a:?} ({layout:?})"),
                expected,
                got: b.to_vec(),
            });
        }
        if c != [m, n] {
            return Err(KernelError::ShapeMismatch {
                what: "c, the product's output [m, n]".into(),
                expected: vec![m, n],
                got: c.to_vec(),
            });
        }
        for (name, size, tile) in [("m", m, TILE_M), ("n", n, TILE_N), ("k", k, TILE_K)] {
            if size == 0 || size % tile != 0 || size > i32::MAX as usize {
                return Err(KernelError::BadLength {
                    what: format!(
                        "{name} = {size}: the Hopper matrix product's tile is {TILE_M} x \
                         {TILE_N} x {TILE_K}, so m, n and k must be positive multiples of \
                         {TILE_M}, {TILE_N} and {TILE_K} (below 2^31)"
                    ),
                });
            }
        }
        Ok(Self { m, n, k })
    }

    /// Output tiles of the product.
    pub fn tiles(&self) -> usize {
        (self.m / TILE_M) * (self.n / TILE_N)
    }

    /// Cubes of the persistent grid: one per multiprocessor (132 when the device does not say),
    /// never more than there are tiles.
    pub fn cubes(&self, multiprocessors: Option<u32>) -> u32 {
        let per_device = multiprocessors.unwrap_or(132).max(1) as usize;
        self.tiles().min(per_device) as u32
    }

    /// The `u32` scalars the kernel reads, in its `GemmInfo` order.
    pub fn scalars(&self) -> [u32; 4] {
        [self.m as u32, self.n as u32, self.k as u32, 0]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hopper::source_task::assert_defines;
    use ElemType::{BF16, F16, F32};
    use GemmLayout::{BRowMajor, BTransposed};

    fn check(
        a: &[usize],
        b: &[usize],
        c: &[usize],
        elems: [ElemType; 3],
        layout: GemmLayout,
    ) -> Result<GemmShape, KernelError> {
        GemmShape::check((a, elems[0]), (b, elems[1]), (c, elems[2]), layout)
    }

    #[test]
    fn both_layouts_read_n_and_k_from_b() {
        let bf = [BF16, BF16, BF16];
        let t = check(&[256, 192], &[512, 192], &[256, 512], bf, BTransposed).unwrap();
        assert_eq!(
            t,
            GemmShape {
                m: 256,
                n: 512,
                k: 192
            }
        );
        let r = check(
            &[256, 192],
            &[192, 512],
            &[256, 512],
            [BF16, BF16, F32],
            BRowMajor,
        );
        assert_eq!(r.unwrap(), t);
        assert_eq!(t.tiles(), 4);
        assert_eq!(t.scalars(), [256, 512, 192, 0]);
    }

    #[test]
    fn mismatched_shapes_are_named() {
        let bf = [BF16, BF16, BF16];
        let err = check(&[256, 192], &[192, 512], &[256, 512], bf, BTransposed).unwrap_err();
        assert!(
            matches!(&err, KernelError::ShapeMismatch { expected, got, .. }
                if expected == &vec![192, 192] && got == &vec![192, 512]),
            "{err}"
        );
        let err = check(&[256, 192], &[512, 192], &[512, 256], bf, BTransposed).unwrap_err();
        assert!(err.to_string().contains("c, the product's output"), "{err}");
        let err = check(&[256, 192, 1], &[512, 192], &[256, 512], bf, BTransposed).unwrap_err();
        assert!(matches!(err, KernelError::Rank { name: "a", .. }), "{err}");
    }

    #[test]
    fn sizes_off_the_tile_are_refused_with_the_tile() {
        let bf = [BF16, BF16, BF16];
        for (a, b, c, name) in [
            ([100, 64], [256, 64], [100, 256], "m = 100"),
            ([128, 64], [200, 64], [128, 200], "n = 200"),
            ([128, 96], [256, 96], [128, 256], "k = 96"),
            ([0, 64], [256, 64], [0, 256], "m = 0"),
        ] {
            let err = check(&a, &b, &c, bf, BTransposed).unwrap_err();
            let message = err.to_string();
            assert!(matches!(err, KernelError::BadLength { .. }), "{message}");
            assert!(
                message.contains(name) && message.contains("128 x 256 x 64"),
                "{message}"
            );
        }
    }

    #[test]
    fn element_types_other_than_bf16_inputs_are_refused() {
        let shapes = (&[128, 64][..], &[256, 64][..], &[128, 256][..]);
        for elems in [[F16, BF16, BF16], [BF16, F32, BF16], [BF16, BF16, F16]] {
            let err = check(shapes.0, shapes.1, shapes.2, elems, BTransposed).unwrap_err();
            assert!(matches!(err, KernelError::DType { .. }), "{err}");
        }
    }

    #[test]
    fn the_grid_is_one_cube_per_multiprocessor_at_most() {
        let shape = GemmShape {
            m: 8192,
            n: 8192,
            k: 64,
        };
        assert_eq!(shape.tiles(), 64 * 32);
        assert_eq!(shape.cubes(Some(132)), 132);
        assert_eq!(shape.cubes(None), 132);
        let small = GemmShape {
            m: 256,
            n: 256,
            k: 64,
        };
        assert_eq!(small.cubes(Some(132)), 2);
    }

    #[test]
    fn the_device_source_agrees_with_these_constants() {
        let source = include_str!("gemm.cu");
        assert_defines(
            "gemm.cu",
            source,
            &[
                ("DF_BM", TILE_M),
                ("DF_BN", TILE_N),
                ("DF_BK", TILE_K),
                ("DF_STAGES", STAGES),
            ],
        );
        assert!(source.contains(&format!("#define DF_CONSUMERS {}\n", UNITS / 128 - 1)));
        assert!(include_str!("ptx.cuh").contains("#define DF_SWIZZLE_SPAN 1024\n"));
        // The kernel's layout: tiles from the first 1024-byte boundary, then the full and
        // empty barriers; its last byte is within what the host asks for.
        assert!(source.contains("const u32 full = b_tiles + DF_STAGES * DF_B_STAGE;"));
        assert!(source.contains("const u32 empty = full + DF_STAGES * 8;"));
    }
}
