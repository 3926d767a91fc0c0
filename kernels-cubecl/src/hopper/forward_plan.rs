//! The Hopper attention forward's constants and what it covers, pure logic: which calls
//! `attention_forward.cu` takes (element types, head dims, scales; every mask), what it starts from
//! and writes (a whole attention or one of the three steps of the stat-carrying contract), the
//! switches of the variant compiled for a call, its shared memory and the scalars it reads.

use super::band::{self, BandScalars};
use super::schedule::ForwardSchedule;
use crate::dims::AttentionDims;
use crate::kernel_error::KernelError;
use crate::mask::{KernelMask, MaskKind};
use crate::stats::LOG2_E;
use crate::tensor::ElemType;
use crate::Mask;

/// Query rows per cube (two consumer warpgroups of 64 rows).
pub const BLOCK_ROWS: usize = 128;
/// Keys per tile (the `n` of the score product `wgmma.m64n128k16`).
pub const BLOCK_KEYS: usize = 128;
/// Pipeline stages of K and of V in shared memory.
pub const STAGES: usize = 2;
/// Threads per cube: one producer and two consumer warpgroups.
pub const UNITS: usize = 384;
/// Columns of one box of the tensor maps: 64 16-bit values, one 128-byte swizzled row.
pub const BOX_COLUMNS: usize = 64;
/// Bytes of keys and values the cubes under way at one time should share: about two thirds of
/// the 50 MB L2 of an H100 or H200 (the rest holds queries, outputs and other heads' tails).
pub const L2_BUDGET: usize = 32 << 20;

/// Shared memory one cube of the grid of one cube per block uses at `head_dim`: the Q tile,
/// `STAGES` K and V tiles (16-bit values), `1 + 4 STAGES` barriers of 8 bytes, and up to 1023
/// bytes to align the tiles on the 128-byte swizzle's 1024-byte period.
pub const fn shared_bytes(head_dim: usize) -> usize {
    shared_bytes_for(head_dim, false)
}

/// Shared memory one cube uses at `head_dim`, on a persistent grid or not: a persistent cube
/// holds two Q tiles, each with a second barrier (`empty`) and a 4-byte item number.
pub const fn shared_bytes_for(head_dim: usize, persistent: bool) -> usize {
    let q_tiles = if persistent { 2 } else { 1 };
    let q_barriers = if persistent { 2 * q_tiles } else { q_tiles };
    let items = if persistent { 4 * q_tiles } else { 0 };
    (q_tiles * BLOCK_ROWS + 2 * STAGES * BLOCK_KEYS) * head_dim * 2
        + (q_barriers + 4 * STAGES) * 8
        + items
        + 1024
}

// Within the 227 KiB a Hopper cube may opt into.
const _: () = assert!(shared_bytes_for(128, true) <= 232_448);

/// What one compiled forward starts from and what it writes: a whole attention or one of the
/// stat-carrying contract's steps (ARCHITECTURE.md, "The state (o, m, l)").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ForwardEnds {
    /// From the empty state to the finished output and lse (`attention`).
    Whole,
    /// From the empty state to a running state, nothing read (`forward_first_step`).
    FirstStep,
    /// From a running state to the same state, in place (`forward_step`).
    Step,
    /// From a running state to the finished output and lse, the state only read
    /// (`forward_last_step`).
    LastStep,
}

impl ForwardEnds {
    /// Whether the kernel starts from a running state (else from the empty one).
    pub fn reads_state(self) -> bool {
        matches!(self, Self::Step | Self::LastStep)
    }

    /// Whether the kernel writes a running state (else the finished output and lse).
    pub fn writes_state(self) -> bool {
        matches!(self, Self::FirstStep | Self::Step)
    }
}

/// One compiled form of the kernel: what its switches select.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ForwardVariant {
    /// 64 or 128.
    pub head_dim: usize,
    /// f16 or bf16 (q, k, v and O).
    pub elem: ElemType,
    /// The parts of the mask compiled in: an upper bound per row (causal, a window), a lower one
    /// (a window), documents (a table argument).
    pub mask: MaskKind,
    /// How the consumer warpgroups order their work.
    pub schedule: ForwardSchedule,
    /// What it starts from and writes.
    pub ends: ForwardEnds,
}

impl ForwardVariant {
    /// The variant that computes attention of `dims` in `elem` under `mask` with score `scale`
    /// from and to `ends`, or why the kernel does not cover the call: another element type or
    /// head dim, a scale that is not positive and finite. A persistent `schedule` holds for a
    /// whole attention only: the steps run on a grid of one cube per block.
    pub fn for_call(
        dims: &AttentionDims,
        elem: ElemType,
        (mask, scale): (&Mask, f32),
        schedule: ForwardSchedule,
        ends: ForwardEnds,
    ) -> Result<Self, KernelError> {
        super::coverage::check("the Hopper attention forward", dims, elem, scale)?;
        Ok(Self {
            head_dim: dims.head_dim,
            elem,
            mask: mask.kind(),
            schedule: ForwardSchedule {
                persistent: schedule.persistent && ends == ForwardEnds::Whole,
                ..schedule
            },
            ends,
        })
    }

    /// The shared memory one cube of this variant uses.
    pub fn shared_bytes(&self) -> usize {
        shared_bytes_for(self.head_dim, self.schedule.persistent)
    }

    /// The `#define` lines that select this variant in `attention_forward.cu`.
    pub fn switches(&self) -> String {
        let flag = |on: bool| u8::from(on);
        format!(
            "#define DISTFLASH_HEAD_DIM {}\n#define DISTFLASH_F16 {}\n{}\
             #define DISTFLASH_INTRA_OVERLAP {}\n#define DISTFLASH_PINGPONG {}\n\
             #define DISTFLASH_STATE_IN {}\n#define DISTFLASH_STATE_OUT {}\n\
             #define DISTFLASH_PERSISTENT {}\n",
            self.head_dim,
            flag(self.elem == ElemType::F16),
            super::band::switches(self.mask),
            flag(self.schedule.intra_overlap),
            flag(self.schedule.pingpong),
            flag(self.ends.reads_state()),
            flag(self.ends.writes_state()),
            flag(self.schedule.persistent),
        )
    }
}

/// Cubes of a persistent grid over `blocks` blocks of query rows: one per multiprocessor (132,
/// an H100's or H200's, when the device does not say), never more than there are blocks. One
/// cube fits a multiprocessor (the kernel's launch bounds and its shared memory).
pub fn persistent_cubes(blocks: usize, multiprocessors: Option<u32>) -> usize {
    let per_device = multiprocessors.unwrap_or(132).max(1) as usize;
    blocks.min(per_device)
}

/// (batch, head) slices per launch group: with `grouped`, as many as share [`L2_BUDGET`] bytes
/// of keys and values (whole GQA groups, at least one key/value head's), else all of them.
pub fn slice_group(dims: &AttentionDims, grouped: bool) -> usize {
    let slices = dims.batch * dims.q_heads;
    if !grouped {
        return slices;
    }
    let kv_head_bytes = 2 * dims.kv_len * dims.head_dim * 2;
    let kv_heads = (L2_BUDGET / kv_head_bytes).max(1);
    (kv_heads * dims.group_size()).min(slices)
}

/// The fourteen `u32` scalars the kernel reads, in its `ForwardInfo` order: `q_len`, `kv_len`,
/// the query heads, the query heads per key/value head, the band's upper and lower offsets
/// from the diagonal ([`BandScalars`]), the scale times `log2(e)` (as `f32` bits), the slices
/// per launch group ([`slice_group`]) and the slices, the documents' four scalars, and 0.
pub fn scalars(dims: &AttentionDims, mask: &Mask, scale: f32, grouped: bool) -> [u32; 14] {
    let BandScalars {
        upper,
        lower,
        documents: [q_pos0, kv_pos0, doc_stride, doc_count],
    } = band::scalars(dims, mask);
    [
        dims.q_len as u32,
        dims.kv_len as u32,
        dims.q_heads as u32,
        dims.group_size() as u32,
        upper,
        lower,
        (scale * LOG2_E).to_bits(),
        slice_group(dims, grouped) as u32,
        (dims.batch * dims.q_heads) as u32,
        q_pos0,
        kv_pos0,
        doc_stride,
        doc_count,
        0,
    ]
}

#[cfg(test)]
mod tests {
    use super::super::coverage::{test_dims as dims, HEAD_DIMS};
    use super::*;
    use crate::hopper::source_task::assert_defines;
    use crate::{Documents, SlidingWindow};

    fn refusal(d: AttentionDims, elem: ElemType, mask: Mask, scale: f32) -> KernelError {
        let schedule = ForwardSchedule::default();
        ForwardVariant::for_call(&d, elem, (&mask, scale), schedule, ForwardEnds::Step).unwrap_err()
    }

    /// Every form of mask: none, causal, a causal window, a two-sided window, documents, and
    /// documents under a causal window at offsets.
    fn every_mask() -> Vec<Mask> {
        let documents = Documents::from_cu_seqlens(&[0, 1, 200, 517, 700]).unwrap();
        vec![
            Mask::none(),
            Mask::causal().at(40, 0),
            Mask::causal().with_window(SlidingWindow::causal(64).unwrap()),
            Mask::none().with_window(SlidingWindow::two_sided(3, 5)),
            Mask::none().with_documents(documents.clone()),
            Mask::causal()
                .with_window(SlidingWindow::causal(100).unwrap())
                .with_documents(documents)
                .at(100, 50),
        ]
    }

    #[test]
    fn both_head_dims_16_bit_types_and_every_mask_are_covered() {
        for head_dim in HEAD_DIMS {
            for elem in [ElemType::BF16, ElemType::F16] {
                for mask in every_mask() {
                    let schedule = ForwardSchedule::default();
                    let ends = ForwardEnds::LastStep;
                    let variant = ForwardVariant::for_call(
                        &dims(head_dim),
                        elem,
                        (&mask, 0.1),
                        schedule,
                        ends,
                    )
                    .unwrap();
                    assert_eq!(
                        variant,
                        ForwardVariant {
                            head_dim,
                            elem,
                            mask: mask.kind(),
                            // The steps keep a cube per block.
                            schedule: ForwardSchedule {
                                persistent: false,
                                ..schedule
                            },
                            ends,
                        }
                    );
                }
            }
        }
    }

    #[test]
    fn what_the_kernel_does_not_cover_is_refused_by_name() {
        let cases = [
            (
                refusal(dims(128), ElemType::F32, Mask::none(), 0.1),
                "got F32",
            ),
            (
                refusal(dims(96), ElemType::BF16, Mask::none(), 0.1),
                "got 96",
            ),
        ];
        for (err, what) in cases {
            let message = err.to_string();
            assert!(matches!(err, KernelError::Unsupported { .. }), "{message}");
            assert!(message.contains(what), "{what}: {message}");
        }
        for scale in [0.0, -0.5, f32::INFINITY, f32::NAN] {
            let err = refusal(dims(128), ElemType::BF16, Mask::causal(), scale);
            assert!(
                matches!(err, KernelError::BadOption { .. }) && err.to_string().contains("scale"),
                "{err}"
            );
        }
    }

    #[test]
    fn switches_select_the_variant() {
        let variant = ForwardVariant {
            head_dim: 64,
            elem: ElemType::F16,
            mask: Mask::causal().kind(),
            schedule: ForwardSchedule {
                intra_overlap: false,
                pingpong: true,
                grouped_slices: true,
                persistent: false,
            },
            ends: ForwardEnds::Whole,
        };
        assert_eq!(
            variant.switches(),
            "#define DISTFLASH_HEAD_DIM 64\n#define DISTFLASH_F16 1\n#define DISTFLASH_UPPER 1\n\
             #define DISTFLASH_LOWER 0\n#define DISTFLASH_DOCUMENTS 0\n\
             #define DISTFLASH_INTRA_OVERLAP 0\n#define DISTFLASH_PINGPONG 1\n\
             #define DISTFLASH_STATE_IN 0\n#define DISTFLASH_STATE_OUT 0\n\
             #define DISTFLASH_PERSISTENT 0\n"
        );
        // The mask's parts.
        let mask_switches = |mask: &Mask| {
            let switches = ForwardVariant {
                mask: mask.kind(),
                ..variant
            }
            .switches();
            let flag = |name: &str| switches.contains(&format!("#define DISTFLASH_{name} 1\n"));
            (flag("UPPER"), flag("LOWER"), flag("DOCUMENTS"))
        };
        let masks = every_mask();
        let parts: Vec<_> = masks.iter().map(mask_switches).collect();
        assert_eq!(
            parts,
            [
                (false, false, false),
                (true, false, false),
                (true, true, false),
                (true, true, false),
                (false, false, true),
                (true, true, true),
            ]
        );
        // The steps: what each reads and writes.
        let state_switches = |ends| {
            let switches = ForwardVariant { ends, ..variant }.switches();
            let flag = |name: &str| switches.contains(&format!("#define DISTFLASH_{name} 1\n"));
            (flag("STATE_IN"), flag("STATE_OUT"))
        };
        assert_eq!(state_switches(ForwardEnds::FirstStep), (false, true));
        assert_eq!(state_switches(ForwardEnds::Step), (true, true));
        assert_eq!(state_switches(ForwardEnds::LastStep), (true, false));
        // The persistent grid.
        let persistent = ForwardVariant {
            schedule: ForwardSchedule {
                persistent: true,
                ..variant.schedule
            },
            ..variant
        };
        assert!(persistent
            .switches()
            .ends_with("#define DISTFLASH_PERSISTENT 1\n"));
    }

    #[test]
    fn only_a_whole_attention_runs_on_the_persistent_grid() {
        let persistent = ForwardSchedule {
            persistent: true,
            ..ForwardSchedule::default()
        };
        for ends in [
            ForwardEnds::Whole,
            ForwardEnds::FirstStep,
            ForwardEnds::Step,
            ForwardEnds::LastStep,
        ] {
            let variant = ForwardVariant::for_call(
                &dims(128),
                ElemType::BF16,
                (&Mask::causal(), 0.1),
                persistent,
                ends,
            )
            .unwrap();
            let whole = ends == ForwardEnds::Whole;
            assert_eq!(variant.schedule.persistent, whole, "{ends:?}");
            // The steps compile to what the default schedule compiles to.
            assert_eq!(
                variant.schedule,
                ForwardSchedule {
                    persistent: whole,
                    ..ForwardSchedule::default()
                }
            );
            assert_eq!(
                variant.shared_bytes(),
                shared_bytes_for(128, whole),
                "{ends:?}"
            );
        }
    }

    #[test]
    fn scalars_carry_the_band_and_the_base_2_scale() {
        let d = dims(128);
        let documents = Documents::from_cu_seqlens(&[0, 1, 200, 700]).unwrap();
        let mask = Mask::causal()
            .with_window(SlidingWindow::causal(64).unwrap())
            .with_documents(documents)
            .at(217, 0);
        let [q_len, kv_len, heads, group, upper, lower, scale, slice_group, slices, rest @ ..] =
            scalars(&d, &mask, 0.125, true);
        assert_eq!([q_len, kv_len, heads, group], [300, 517, 8, 4]);
        let band = band::scalars(&d, &mask);
        assert_eq!([upper, lower], [band.upper, band.lower]);
        assert_eq!([upper as i32, lower as i32], [217, 217 - 63]);
        assert_eq!(f32::from_bits(scale), 0.125 * LOG2_E);
        assert_eq!([slice_group, slices], [16, 16]);
        assert_eq!(rest, [217, 0, 0, 4, 0]);
    }

    #[test]
    fn a_persistent_grid_holds_a_cube_per_multiprocessor_at_most_one_per_block() {
        assert_eq!(persistent_cubes(4096, Some(132)), 132);
        assert_eq!(persistent_cubes(100, Some(132)), 100);
        assert_eq!(persistent_cubes(4096, None), 132);
        assert_eq!(persistent_cubes(1, Some(0)), 1);
    }

    #[test]
    fn slice_groups_share_the_l2_budget_in_whole_kv_heads() {
        let long = |kv_len, q_heads, kv_heads| AttentionDims {
            batch: 2,
            q_heads,
            kv_heads,
            q_len: kv_len,
            kv_len,
            head_dim: 128,
        };
        // 8 MiB of keys and values per head at 16K: four heads; two at 32K; eight at 8K.
        assert_eq!(slice_group(&long(16384, 32, 32), true), 4);
        assert_eq!(slice_group(&long(32768, 32, 32), true), 2);
        assert_eq!(slice_group(&long(8192, 32, 32), true), 8);
        // GQA 32 / 8: four query heads per key/value head.
        assert_eq!(slice_group(&long(16384, 32, 8), true), 16);
        // At least one key/value head's queries, however long; at most every slice.
        assert_eq!(slice_group(&long(1 << 20, 32, 8), true), 4);
        assert_eq!(slice_group(&long(128, 32, 32), true), 64);
        assert_eq!(slice_group(&long(16384, 32, 32), false), 64);
    }

    #[test]
    fn the_device_source_agrees_with_these_constants() {
        let source = include_str!("attention_forward.cu");
        assert_defines(
            "attention_forward.cu",
            source,
            &[
                ("DF_BM", BLOCK_ROWS),
                ("DF_BN", BLOCK_KEYS),
                ("DF_STAGES", STAGES),
                ("DF_THREADS", UNITS),
            ],
        );
        // The kernel's shared memory: Q, then the stages of K and V, then nine barriers.
        assert!(source.contains("at.v_empty = at.v_full + DF_STAGES * 8;"));
        assert!(source.contains("#define DF_HALVES (DF_D / 64)\n"));
        assert_eq!(BOX_COLUMNS, 64);
        assert_eq!(shared_bytes(128), 160 * 1024 + 72 + 1024);
        // Two Q tiles, each with two barriers and an item number.
        assert_eq!(shared_bytes_for(128, true), 192 * 1024 + 96 + 8 + 1024);
        assert_eq!(shared_bytes_for(64, false), shared_bytes(64));
        assert!(source.contains("#define DF_Q_BUFFERS (DISTFLASH_PERSISTENT ? 2 : 1)\n"));
        assert!(source.contains("at.work = at.q_empty + DF_Q_BUFFERS * 8;"));
    }
}
