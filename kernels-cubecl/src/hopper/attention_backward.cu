// Hopper (sm_90a) attention backward, FlashAttention-3's design: dQ, dK and dV of
// O = softmax(scale Q K^T) V from the stored log-sum-exp and delta = rowsum(dO * O), never
// recomputing the forward, with `wgmma` (asynchronous warpgroup MMA) for the five products, the
// bulk tensor copy engine (TMA) staging K, V, Q and dO in shared memory, and one producer
// warpgroup feeding two consumer warpgroups.
//
// CUDA C++ with inline PTX, no headers: compiled by NVRTC for sm_90a and launched through
// CubeCL's CUDA runtime (`hopper/source_task.rs`). The host (`hopper/backward.rs`) prepends the
// variant's switches, the PTX building blocks (`ptx.cuh`) and what the attention kernels share
// (`attention.cuh`). The switches:
//   DISTFLASH_HEAD_DIM  64 or 128
//   DISTFLASH_F16       0: q, k, v, dO and the gradients are bf16; 1: f16
//   DISTFLASH_UPPER     1: query row i sees key j only if j <= i + upper (causal: the shift
//                       q_offset - kv_offset; a window adds the keys after the diagonal)
//   DISTFLASH_LOWER     1: ... and only if j >= i + lower (a sliding window)
//   DISTFLASH_DOCUMENTS 1: ... and only if i and j lie in one document (a table argument)
//   DISTFLASH_ACCUMULATE  1: dK and dV are added to f32 accumulators [B * Hkv, Skv, D] (a
//                       backward step's, or a split whole attention's zeroed sums) instead of
//                       stored in the inputs' type
//   DISTFLASH_DETERMINISTIC 1: the cubes add to each tile's dQ sum in a fixed order (below), so
//                       that the gradients are bitwise the same from run to run
//   DISTFLASH_PRODUCER_ADDS 1 (with DISTFLASH_DETERMINISTIC): the ordered dQ adds are a producer
//                       warp's, not the consumers' (below)
//   DISTFLASH_SPLIT     1: each block of keys of a key/value slice is walked by `head_parts`
//                       cubes, each taking `group_size / head_parts` of the group's query heads,
//                       which add dK and dV to the accumulators with atomics (with
//                       DISTFLASH_ACCUMULATE, never with DISTFLASH_DETERMINISTIC)
//
// Tensors are row-major: q and dO [B * Hq, Sq, D], k, v, dK and dV [B * Hkv, Skv, D], seen
// through three-dimensional tensor maps whose boxes are 64 columns (128 bytes, the 128-byte
// swizzle) of 64 rows (q, dO, the stores of dK and dV) or 128 rows (k, v) of one (batch, head)
// slice: rows past a slice's length arrive as zeros and are never stored. The row kernels of
// `backward_rows.cu` run before and after this one: before, they write each query row's
// log-sum-exp in base 2 and its delta, f32 [B * Hq, Tq * 64] with every slice padded to whole
// tiles of 64 rows (padding rows: a log-sum-exp of FLT_MAX and a delta of 0, so their
// probabilities are exactly 0), and zero the f32 sum of dQ, [B * Hq, Tq, 64 * D] in fragment
// order (see `add_query_grads`); after, they turn that sum into dQ.
//
// A cube (CTA) of 384 threads takes 128 keys of one key/value slice, keeps their K and V in
// shared memory, and walks the 64-row query tiles of every query head of the slice's group (with
// DISTFLASH_SPLIT, of its part of the group) that see them: from the tile holding the first row that sees the block's first key (under a causal
// mask; else the first tile) to the tile holding the last row that sees its last key (with a
// window or documents; else the last tile). Every mask is a band (`kernels-cubecl/src/mask.rs`):
// key j is seen by the query rows [from(j), until(j)), both ends non-decreasing in j. The tiles
// at either edge of each head's walk (those that do not see every key of the block, and every
// tile of a block that ends past the keys) compare query rows against each key's range; the
// others run without a mask. Cubes start in groups
// of slices whose queries, output gradients and dQ sums fit in L2 together, the blocks of a group
// by rank, the first (under a causal mask the heaviest) first (see `grouped_cube`).
// - Warpgroup 0 (producer) keeps 24 registers; one thread has the copy engine fetch K and V
//   once, then each tile's Q with its base-2 log-sum-exp and dO with its delta into two stages,
//   on `full` barriers, reusing a stage once its consumers arrive on its `empty` barrier.
// - Warpgroups 1 and 2 (consumers) take 240 registers each and own keys 0-63 and 64-127 of the
//   block. Per tile: S^T = K Q^T and dP^T = V dO^T (`wgmma.m64n64k16`, both operands in shared
//   memory, 32 f32 per thread each: keys are the fragment's rows, queries its columns), then in
//   registers P^T = 2^(S^T scale log2(e) - lse) and dS^T = P^T (dP^T - delta); dV += P^T dO and
//   dK += dS^T Q with P^T and dS^T from registers (the accumulator fragment of a product is the A
//   fragment of the next once packed to 16 bits); dS^T goes to shared memory, and once both
//   warpgroups have written theirs, dQ = dS K (each warpgroup 64 columns of the head dim; at head
//   dim 64 the first alone), added to the tile's f32 sum with vector atomics.
// - The epilogue scales dK by the score scale, writes dK and dV into the warpgroup's rows of K's
//   and V's shared memory and has the copy engine store them (rows past the keys clipped); a
//   block no query sees stores zeros. With DISTFLASH_ACCUMULATE each thread instead adds its
//   fragment of dK and dV to the f32 accumulators (the cube owns its keys' rows: one cube per
//   key block and key/value slice, every query head of the group summed in its registers, so
//   no two cubes add to one element); a block no query sees adds nothing. With DISTFLASH_SPLIT
//   the `head_parts` cubes of one block (each of which has summed its own heads in registers)
//   add to the same elements, with vector atomics (`red.global.add.v2.f32`); for a whole
//   attention the host zeroes those f32 sums before and a row kernel converts them after.
// - DISTFLASH_DETERMINISTIC: the cubes of one key/value slice that walk a query tile form a run
//   of consecutive key blocks (every mask here is a band whose ends rise with the key, packed
//   documents included, and a block that walks nothing lies before or after every block that
//   walks something). They add their dQ to the
//   tile's sum from the last block of the run down, each warpgroup waiting on its own counter
//   [B * Hq, Tq, DF_DQ_WARPGROUPS] (zeroed by the host) until the blocks above it have added,
//   then adding and counting itself in. Off the critical path where it can be: the counter is
//   read while the dQ product runs, and the count (a fence, then a release) goes in once the
//   next tile's score products are issued. Cubes start last block first (lightest first under
//   a causal mask), so a cube only ever waits on cubes that started before it.
// - DISTFLASH_PRODUCER_ADDS (FlashAttention-3's form of the ordered adds): each consumer
//   warpgroup writes its dQ block (f32, fragment order, 16 KiB) to its own buffer in shared
//   memory (once the buffer's `dq_empty` barrier says the last one was read), with the tile's
//   index and its place in the order, arrives on `dq_full` and goes on to the next tile. One
//   thread of producer warp 1 + wg waits for that block's turn on the same counter, adds the
//   buffer to the tile's sum with one bulk reduction (`cp.reduce.async.bulk ... add.f32`),
//   releases the buffer once the copy engine has read it, and counts itself in once the
//   reduction is complete. Every element of the sum takes the same f32 adds in the same order
//   as the consumers' form (round to nearest even, last block first): the same bits (unless the
//   copy engine keeps subnormal f32 values, below 2^-126, that `red.add.f32` flushes to zero:
//   the SASS of `red` says FTZ, that of the bulk reduction does not say).

#ifndef DISTFLASH_HEAD_DIM
#define DISTFLASH_HEAD_DIM 128
#endif
#ifndef DISTFLASH_ACCUMULATE
#define DISTFLASH_ACCUMULATE 0
#endif
#ifndef DISTFLASH_DETERMINISTIC
#define DISTFLASH_DETERMINISTIC 0
#endif
#ifndef DISTFLASH_SPLIT
#define DISTFLASH_SPLIT 0
#endif
#ifndef DISTFLASH_PRODUCER_ADDS
#define DISTFLASH_PRODUCER_ADDS 0
#endif
#if DISTFLASH_PRODUCER_ADDS && !DISTFLASH_DETERMINISTIC
#error "DISTFLASH_PRODUCER_ADDS orders the deterministic backward's dQ adds: it needs DISTFLASH_DETERMINISTIC"
#endif
#if DISTFLASH_SPLIT && (!DISTFLASH_ACCUMULATE || DISTFLASH_DETERMINISTIC)
#error "DISTFLASH_SPLIT adds dK and dV with atomics: it needs DISTFLASH_ACCUMULATE and excludes DISTFLASH_DETERMINISTIC"
#endif

// The scalars, as CubeCL packs sixteen u32 scalars (64 bytes).
struct BackwardInfo {
    u32 q_len;
    u32 kv_len;
    u32 kv_heads;
    // Query heads per key/value head.
    u32 group_size;
    // Query row i sees key j only if j <= i + upper (DISTFLASH_UPPER) and j >= i + lower
    // (DISTFLASH_LOWER).
    int upper;
    int lower;
    // The score scale times log2(e), and the score scale, as f32 bits.
    u32 scale_log2_bits;
    u32 scale_bits;
    // Key/value slices per launch group (see `grouped_cube`), and all of them.
    u32 slice_group;
    u32 kv_slices;
    // Query tiles of 64 rows per slice (the padded row count of lse and delta over 64).
    u32 q_tiles;
    // The documents (DISTFLASH_DOCUMENTS): absolute positions of query row 0 and key row 0,
    // entries between two batch rows' bounds (0 when shared) and bounds per batch row.
    u32 q_pos0;
    u32 kv_pos0;
    u32 doc_stride;
    u32 doc_count;
    // Cubes per (key/value slice, block of keys), each walking group_size / head_parts of the
    // group's query heads (DISTFLASH_SPLIT; else 1).
    u32 head_parts;
};

#define DF_D DISTFLASH_HEAD_DIM
#define DF_BM 64
#define DF_BN 128
#define DF_HALVES (DF_D / 64)
#define DF_STAGES 2
#define DF_THREADS 384
// Bytes of one 64-column half of a stage's Q or dO tile and of the block's K or V (rows of 128
// bytes), one stage's dS^T (128 keys by 64 queries), and one tile's log-sum-exp or delta.
#define DF_Q_HALF (DF_BM * 128)
#define DF_KV_HALF (DF_BN * 128)
#define DF_Q_BYTES (DF_HALVES * DF_Q_HALF)
#define DF_KV_BYTES (DF_HALVES * DF_KV_HALF)
#define DF_DS_BYTES (DF_BN * DF_BM * 2)
#define DF_ROW_BYTES (DF_BM * 4)
// Per consumer thread: S^T's (and dP^T's) accumulators (64 keys by DF_BM queries over 128
// threads), P^T (and dS^T) packed two values a register, dK's (and dV's), dQ's.
#define DF_S_REGS (64 * DF_BM / 128)
#define DF_P_REGS (DF_S_REGS / 2)
#define DF_KV_REGS (DF_D / 2)
#define DF_DQ_REGS 32
// Consumer warpgroups computing dQ (64 columns each), and the floats of one tile's dQ sum.
#define DF_DQ_WARPGROUPS DF_HALVES
#define DF_DQ_TILE (DF_BM * DF_D)
// DISTFLASH_PRODUCER_ADDS: bytes of one warpgroup's dQ block (64 rows by 64 columns, f32) and of
// its header (the tile's index, u64, and the block's place in the tile's order, u32).
#define DF_DQ_BLOCK_BYTES (DF_BM * 64 * 4)
#define DF_DQ_HEADER_BYTES 16
// Named barriers: 1 gathers both consumer warpgroups once their dS^T is in shared memory, 2 once
// both are done with K and V, 3 and 4 one warpgroup before its stores of dK and dV.
#define DF_DS_BARRIER 1
#define DF_DONE_BARRIER 2
#define DF_STORE_BARRIER 3
// 5 and 6 (DISTFLASH_DETERMINISTIC): one warpgroup around its ordered dQ adds.
#define DF_ORDER_BARRIER 5
// Nanoseconds a warpgroup waits for its turn to add dQ before it traps (a launch error, not a
// hang): far beyond any cube's walk.
#define DF_ORDER_TIMEOUT_NS 20000000000ull
// Larger than any column offset of a tile: a key no query row of the tile sees.
#define DF_NO_COLUMN (1 << 20)

// ---- warpgroup MMA ----------------------------------------------------------------------------

#define DF_W4(x, i) "=f"(x[i]), "=f"(x[i + 1]), "=f"(x[i + 2]), "=f"(x[i + 3])
#define DF_W16(x, i) DF_W4(x, i), DF_W4(x, i + 4), DF_W4(x, i + 8), DF_W4(x, i + 12)

// d = A[64 x 16] B[16 x 64] (the first product of a chain: d is only written), both in shared
// memory, each K-major or (TRANSPOSE) MN-major.
template <int TRANSPOSE_A, int TRANSPOSE_B>
__device__ __forceinline__ void wgmma_ss_n64_first(float (&d)[32], u64 a, u64 b) {
    asm volatile(DF_WGMMA_KEEP("0") "wgmma.mma_async.sync.aligned.m64n64k16.f32." DF_AB
                                    "." DF_AB " {" DF_ACC32 "}, %32, %33, keep, 1, 1, %34, %35;\n}\n"
                 : DF_W16(d, 0), DF_W16(d, 16)
        : "l"(a), "l"(b), "n"(TRANSPOSE_A), "n"(TRANSPOSE_B));
}

// d += A[64 x 16] B[16 x 64], as `wgmma_ss_n64_first` after the chain's first product.
template <int TRANSPOSE_A, int TRANSPOSE_B>
__device__ __forceinline__ void wgmma_ss_n64(float (&d)[32], u64 a, u64 b) {
    asm volatile(DF_WGMMA_KEEP("1") "wgmma.mma_async.sync.aligned.m64n64k16.f32." DF_AB
                                    "." DF_AB " {" DF_ACC32 "}, %32, %33, keep, 1, 1, %34, %35;\n}\n"
                 : DF_F32(d)
        : "l"(a), "l"(b), "n"(TRANSPOSE_A), "n"(TRANSPOSE_B));
}

// S^T (or dP^T) of one warpgroup: its 64 keys' rows of K (or V) from `a` (the rows' address in
// the block's first half) against the stage's 64 query rows of Q (or dO) at `b`, over the head
// dim in steps of 16 (4 per 64-column half).
__device__ __forceinline__ void issue_transposed_scores(float (&s)[DF_S_REGS], u32 a, u32 b) {
    wgmma_fence();
    wgmma_ss_n64_first<0, 0>(s, k_major(a), k_major(b));
#pragma unroll
    for (u32 kk = 1; kk < DF_D / 16; ++kk) {
        const u32 half = kk / 4, within = (kk % 4) * 32;
        wgmma_ss_n64<0, 0>(s, k_major(a + half * DF_KV_HALF + within),
                           k_major(b + half * DF_Q_HALF + within));
    }
    wgmma_commit();
}

// dV += P^T dO (or dK += dS^T Q) for one warpgroup: P^T's (dS^T's) 16-query steps from
// registers, the stage's rows of dO (Q) at `b` as the MN-major B operand.
__device__ __forceinline__ void issue_key_grads(float (&acc)[DF_KV_REGS],
                                                const u32 (&a)[DF_P_REGS], u32 b) {
    wgmma_fence();
#pragma unroll
    for (u32 kk = 0; kk < DF_BM / 16; ++kk) {
        const u64 rows = mn_major(b + kk * 16 * 128, DF_Q_HALF);
#if DF_D == 128
        wgmma_rs_n128(acc, a[4 * kk], a[4 * kk + 1], a[4 * kk + 2], a[4 * kk + 3], rows);
#else
        wgmma_rs_n64(acc, a[4 * kk], a[4 * kk + 1], a[4 * kk + 2], a[4 * kk + 3], rows);
#endif
    }
    wgmma_commit();
}

// dQ = dS K for one warpgroup's 64 columns of the head dim: dS from the stage's dS^T at `ds`
// (keys as rows: the MN-major A operand), K's half at `k_half` (keys as rows: MN-major B), over
// the block's 128 keys in steps of 16.
__device__ __forceinline__ void issue_query_grads(float (&dq)[DF_DQ_REGS], u32 ds, u32 k_half) {
    wgmma_fence();
    wgmma_ss_n64_first<1, 1>(dq, mn_major(ds, DF_DS_BYTES), mn_major(k_half, DF_KV_HALF));
#pragma unroll
    for (u32 kk = 1; kk < DF_BN / 16; ++kk) {
        wgmma_ss_n64<1, 1>(dq, mn_major(ds + kk * 16 * 128, DF_DS_BYTES),
                           mn_major(k_half + kk * 16 * 128, DF_KV_HALF));
    }
    wgmma_commit();
}

// ---- the probabilities and the score gradients ------------------------------------------------

__device__ __forceinline__ float2 load_shared_pair(u32 address) {
    float2 pair;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(pair.x), "=f"(pair.y) : "r"(address));
    return pair;
}

// The first column offset (within `column0 + 8 j + e % 2`, see `probabilities`) whose query row
// sees the key of a thread's fragment row: `sees_from` is the first query row that sees it,
// `key_in` whether the key is below the key count; DF_NO_COLUMN for a key no row sees.
__device__ __forceinline__ int first_visible_column(long long sees_from, bool key_in,
                                                    int column0) {
    if (!key_in) {
        return DF_NO_COLUMN;
    }
    return static_cast<int>(
        min(max(sees_from - column0, -1ll), static_cast<long long>(DF_NO_COLUMN)));
}

#if DF_BANDED
// The column offset (as `first_visible_column`) from which the query rows no longer see the key
// of a thread's fragment row: `sees_until` is the end of the rows that see it.
__device__ __forceinline__ int end_visible_column(long long sees_until, int column0) {
    return static_cast<int>(
        min(max(sees_until - column0, -1ll), static_cast<long long>(DF_NO_COLUMN)));
}
#endif

// The columns of a thread's fragment rows that see their keys: from `first[r]` on and (with a
// lower bound or documents) before `end[r]`.
struct VisibleColumns {
    int first[2];
#if DF_BANDED
    int end[2];
#endif
};

// P^T in place of S^T: 2^(s scale log2(e) - lse) for each (key row, query column), the lse of
// the stage's columns at `lse`; with MASKED, 0 where the column's query row does not see the
// row's key (element i of the fragment is column 8 (i / 4) + i % 2 past the thread's first,
// visible in `visible`'s range).
template <bool MASKED>
__device__ __forceinline__ void probabilities(float (&s)[DF_S_REGS], u32 lse, u32 quad,
                                              float scale_log2, const VisibleColumns& visible) {
#pragma unroll
    for (int j = 0; j < DF_S_REGS / 4; ++j) {
        const float2 lse_pair = load_shared_pair(lse + (8 * j + 2 * quad) * 4);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = 4 * j + e;
            float p = fast_exp2(fmaf(s[i], scale_log2, -(e % 2 ? lse_pair.y : lse_pair.x)));
            if (MASKED) {
                const int column = 8 * j + e % 2;
                bool hidden = column < visible.first[DF_ROW_OF(i)];
#if DF_BANDED
                hidden = hidden || column >= visible.end[DF_ROW_OF(i)];
#endif
                if (hidden) {
                    p = 0.0f;
                }
            }
            s[i] = p;
        }
    }
}

// dS^T in place of dP^T: P^T (dP^T - delta) for each (key row, query column), the deltas of the
// stage's columns at `delta`.
__device__ __forceinline__ void score_gradients(float (&dp)[DF_S_REGS],
                                                const float (&p)[DF_S_REGS], u32 delta, u32 quad) {
#pragma unroll
    for (int j = 0; j < DF_S_REGS / 4; ++j) {
        const float2 delta_pair = load_shared_pair(delta + (8 * j + 2 * quad) * 4);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = 4 * j + e;
            dp[i] = p[i] * (dp[i] - (e % 2 ? delta_pair.y : delta_pair.x));
        }
    }
}

// Adds a warpgroup's dQ fragment to its 64 x 64 block of the tile's f32 sum at `block`, in
// fragment order: elements 4j..4j+3 of thread `thread` at (j * 128 + thread) * 4, so that each
// warp adds 512 contiguous bytes per instruction (the dQ kernel of `backward_rows.cu` reads it
// back in this order).
__device__ __forceinline__ void add_query_grads(float* block, const float (&dq)[DF_DQ_REGS],
                                                u32 thread) {
#pragma unroll
    for (int j = 0; j < DF_DQ_REGS / 4; ++j) {
        reduce_add_4(block + (j * 128 + thread) * 4, dq[4 * j], dq[4 * j + 1], dq[4 * j + 2],
                     dq[4 * j + 3]);
    }
}

#if DISTFLASH_PRODUCER_ADDS
// Writes a warpgroup's dQ fragment to its f32 block in shared memory at `block`, in the order
// of `add_query_grads` (each warp 512 contiguous bytes per instruction, no bank conflict).
__device__ __forceinline__ void store_query_grads(u32 block, const float (&dq)[DF_DQ_REGS],
                                                  u32 thread) {
#pragma unroll
    for (int j = 0; j < DF_DQ_REGS / 4; ++j) {
        asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(block +
                                                                       (j * 128 + thread) * 16),
                     "f"(dq[4 * j]), "f"(dq[4 * j + 1]), "f"(dq[4 * j + 2]), "f"(dq[4 * j + 3])
                     : "memory");
    }
}
#endif

// ---- pipeline ---------------------------------------------------------------------------------

// The shared memory of one cube, from its first 1024-byte boundary: K, V, the stages of Q, dO
// and dS^T, the stages' log-sum-exps and deltas, then the barriers.
struct Layout {
    u32 k;
    u32 v;
    u32 q;
    u32 d_o;
    u32 ds;
    u32 lse;
    u32 delta;
#if DISTFLASH_PRODUCER_ADDS
    u32 dq;
    u32 dq_header;
#endif
    u32 kv_full;
    u32 q_full;
    u32 do_full;
    u32 empty;
#if DISTFLASH_PRODUCER_ADDS
    u32 dq_full;
    u32 dq_empty;
#endif
};

__device__ __forceinline__ Layout layout_from(u32 base) {
    Layout at;
    at.k = base;
    at.v = at.k + DF_KV_BYTES;
    at.q = at.v + DF_KV_BYTES;
    at.d_o = at.q + DF_STAGES * DF_Q_BYTES;
    at.ds = at.d_o + DF_STAGES * DF_Q_BYTES;
    at.lse = at.ds + DF_STAGES * DF_DS_BYTES;
    at.delta = at.lse + DF_STAGES * DF_ROW_BYTES;
#if DISTFLASH_PRODUCER_ADDS
    // Each dQ-computing warpgroup's dQ block and header (16-byte aligned, as the bulk copies
    // need), then, after the pipeline's barriers, its `dq_full` and `dq_empty` barriers.
    at.dq = at.delta + DF_STAGES * DF_ROW_BYTES;
    at.dq_header = at.dq + DF_DQ_WARPGROUPS * DF_DQ_BLOCK_BYTES;
    at.kv_full = at.dq_header + DF_DQ_WARPGROUPS * DF_DQ_HEADER_BYTES;
#else
    at.kv_full = at.delta + DF_STAGES * DF_ROW_BYTES;
#endif
    at.q_full = at.kv_full + 8;
    at.do_full = at.q_full + DF_STAGES * 8;
    at.empty = at.do_full + DF_STAGES * 8;
#if DISTFLASH_PRODUCER_ADDS
    at.dq_full = at.empty + DF_STAGES * 8;
    at.dq_empty = at.dq_full + DF_DQ_WARPGROUPS * 8;
#endif
    return at;
}

// Which query tiles one cube walks: for each query head of the group (with DISTFLASH_SPLIT, of
// its part of the group, from head `first_head`), `per_head` tiles from `first`; tiles from
// `unmasked_from` on (and, with a lower bound or documents, before `masked_from`) see every key
// of the block.
struct Walk {
    int first;
    int per_head;
    int count;
    int unmasked_from;
#if DF_BANDED
    int masked_from;
#endif
#if DISTFLASH_SPLIT
    int first_head;
#endif
};

__device__ __forceinline__ long long clamp_rows(long long row, u32 q_len) {
    return min(max(row, 0ll), static_cast<long long>(q_len));
}

// The query rows that see key `key` (below `kv_len`) of batch row `batch`, [from, until) within
// [0, q_len] (`until` q_len without a lower bound or documents), as `key_query_range` in
// `mask.rs`.
__device__ __forceinline__ void rows_seeing_key(const BackwardInfo& info, const u32* docs,
                                                u32 batch, long long key, long long& from,
                                                long long& until) {
    long long lo = 0, hi = info.q_len;
#if DISTFLASH_UPPER
    lo = key - info.upper;
#endif
#if DISTFLASH_LOWER
    hi = key - info.lower + 1;
#endif
#if DISTFLASH_DOCUMENTS
    u32 doc_start, doc_end;
    document_of(docs + batch * info.doc_stride, info.doc_count,
                static_cast<u32>(key) + info.kv_pos0, doc_start, doc_end);
    lo = max(lo, static_cast<long long>(doc_start) - info.q_pos0);
    hi = min(hi, static_cast<long long>(doc_end) - info.q_pos0);
#endif
    from = clamp_rows(lo, info.q_len);
    until = max(clamp_rows(hi, info.q_len), from);
    (void)batch;
    (void)docs;
}

__device__ __forceinline__ Walk block_walk(const BackwardInfo& info, const u32* docs, u32 batch,
                                           u32 key0) {
    Walk walk;
    walk.first = 0;
    walk.unmasked_from = 0;
    walk.per_head = static_cast<int>(info.q_tiles);
#if DF_BANDED
    // As `band_tiles` in `geometry.rs`: every tile from the first key's first row to the last
    // key's last row; unmasked the tiles between the last key's first row and the first key's
    // last row (which see every key of the block).
    const long long last_key = min(key0 + DF_BN, info.kv_len) - 1;
    long long first_from, first_until, last_from, last_until;
    rows_seeing_key(info, docs, batch, key0, first_from, first_until);
    rows_seeing_key(info, docs, batch, last_key, last_from, last_until);
    walk.first = static_cast<int>(first_from / DF_BM);
    const int end = last_until > first_from ? static_cast<int>((last_until + DF_BM - 1) / DF_BM)
                                            : walk.first;
    walk.unmasked_from = min(static_cast<int>((last_from + DF_BM - 1) / DF_BM), end);
    walk.masked_from = max(static_cast<int>(first_until / DF_BM), walk.unmasked_from);
    walk.per_head = end - walk.first;
    if (key0 + DF_BN > info.kv_len) {
        // Keys past the end are masked in every tile.
        walk.unmasked_from = end;
    }
#else
#if DISTFLASH_UPPER
    // The first query rows that see the block's first and last keys.
    const long long sees_first = max(static_cast<long long>(key0) - info.upper, 0ll);
    const long long sees_last = max(static_cast<long long>(key0) + DF_BN - 1 - info.upper, 0ll);
    const long long tiles = info.q_tiles;
    walk.first = static_cast<int>(min(sees_first / DF_BM, tiles));
    walk.unmasked_from = static_cast<int>(min((sees_last + DF_BM - 1) / DF_BM, tiles));
#endif
    if (key0 + DF_BN > info.kv_len) {
        // Keys past the end are masked in every tile.
        walk.unmasked_from = static_cast<int>(info.q_tiles);
    }
    walk.per_head = static_cast<int>(info.q_tiles) - walk.first;
    (void)docs;
    (void)batch;
#endif
    walk.count = walk.per_head * static_cast<int>(info.group_size);
    return walk;
}

// The query slice and tile of walk tile `t`: the cube's query heads in turn.
__device__ __forceinline__ void tile_of(const BackwardInfo& info, const Walk& walk, u32 kv_slice,
                                        int t, u32& q_slice, int& tile) {
    const int head = t / walk.per_head;
    tile = walk.first + (t - head * walk.per_head);
#if DISTFLASH_SPLIT
    const u32 group_head = static_cast<u32>(walk.first_head + head);
#else
    const u32 group_head = static_cast<u32>(head);
#endif
    q_slice = (kv_slice / info.kv_heads) * info.kv_heads * info.group_size +
              (kv_slice % info.kv_heads) * info.group_size + group_head;
}

// The stage and phase parity of walk tile `t` in a ring of DF_STAGES stages.
__device__ __forceinline__ u32 stage_of(int t) {
    return static_cast<u32>(t) % DF_STAGES;
}
__device__ __forceinline__ u32 parity_of(int t) {
    return (static_cast<u32>(t) / DF_STAGES) & 1;
}

#if DISTFLASH_DETERMINISTIC
// Whether the cube of key block `block` walks query tile `tile` (of every query head).
__device__ __forceinline__ bool walks_tile(const BackwardInfo& info, const u32* docs, u32 batch,
                                          u32 block, int tile) {
    const Walk walk = block_walk(info, docs, batch, block * DF_BN);
    return walk.first <= tile && tile < walk.first + walk.per_head;
}

// Ends the launch with an error (out of line: inlined, the trap costs the consumers spills).
__device__ __noinline__ void give_up_waiting() {
    asm volatile("trap;");
}

__device__ __forceinline__ u32 load_acquire(const u32* address) {
    u32 value;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
    return value;
}

__device__ __forceinline__ u64 global_nanoseconds() {
    u64 now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    return now;
}

// Waits until the counter at `turn` reads `position` (one thread; `seen`, an acquiring read of
// it already made), trapping past DF_ORDER_TIMEOUT_NS.
__device__ __forceinline__ void wait_for_turn(const u32* turn, u32 position, u32 seen) {
    if (seen == position) {
        return;
    }
    const u64 start = global_nanoseconds();
    while (load_acquire(turn) != position) {
        asm volatile("nanosleep.u32 64;");
        if (global_nanoseconds() - start > DF_ORDER_TIMEOUT_NS) {
            give_up_waiting();
        }
    }
}

// Counts the calling warpgroup's adds in (one thread, after the warpgroup's barrier): its adds
// happen before any add of the cube whose turn this makes. Nothing to count where `turn` is null.
__device__ __forceinline__ void end_turn(u32* turn) {
    if (turn == nullptr) {
        return;
    }
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(turn) : "memory");
}

#if DISTFLASH_PRODUCER_ADDS
// The ordered dQ adds of consumer warpgroup `wg` (one thread of the producer warpgroup): for
// each of the cube's `count` tiles, once the warpgroup's block is in its buffer (`dq_full`) and
// the blocks above this one have added theirs to the tile's sum, one bulk reduction adds the
// buffer to the sum; the buffer is released (`dq_empty`) once the copy engine has read it, and
// the block is counted in once the reduction is complete (its writes, made in the async proxy,
// fenced into the generic proxy before the release, as the next block's adds are fenced after
// its acquiring read).
__device__ __forceinline__ void add_query_grads_in_order(const Layout& at, float* dq_sum,
                                                         u32* dq_turns, u32 wg, int count) {
    const u32 buffer = at.dq + wg * DF_DQ_BLOCK_BYTES;
    const u32 header = at.dq_header + wg * DF_DQ_HEADER_BYTES;
    const u32 full = at.dq_full + 8 * wg, empty = at.dq_empty + 8 * wg;
    for (int t = 0; t < count; ++t) {
        barrier_wait(full, static_cast<u32>(t) & 1);
        u64 tile_index;
        u32 position;
        asm volatile("ld.shared.u64 %0, [%1];" : "=l"(tile_index) : "r"(header) : "memory");
        asm volatile("ld.shared.u32 %0, [%1];" : "=r"(position) : "r"(header + 8) : "memory");
        u32* turn = dq_turns + tile_index * DF_DQ_WARPGROUPS + wg;
        wait_for_turn(turn, position, load_acquire(turn));
        fence_global_for_copies();
        reduce_add_bytes(dq_sum + tile_index * DF_DQ_TILE + wg * (DF_BM * 64), buffer,
                         DF_DQ_BLOCK_BYTES);
        store_boxes_read();
        barrier_arrive(empty);
        reductions_done();
        fence_global_for_copies();
        end_turn(turn);
    }
}
#endif
#endif

#if DISTFLASH_ACCUMULATE
// Adds a warpgroup's fragment of 64 key rows (`acc`, times `factor`) to the f32 rows of `grads`
// from `key` (the thread's fragment row; then `key + 8`) of slice `kv_slice`, rows past the keys
// left alone: element pair i, i + 1 at row DF_ROW_OF(i), column 8 (i / 4) + 2 quad. Read, add,
// write where the cube owns the rows; with DISTFLASH_SPLIT, where the cubes of the block's other
// parts add to them too, one vector atomic per pair.
__device__ __forceinline__ void add_key_grads(float* grads, const float (&acc)[DF_KV_REGS],
                                              float factor, const BackwardInfo& info,
                                              u32 kv_slice, u32 key, u32 quad) {
#pragma unroll
    for (int i = 0; i < DF_KV_REGS; i += 2) {
        const u32 row = key + 8 * DF_ROW_OF(i);
        if (row < info.kv_len) {
            float* pair = grads + (static_cast<u64>(kv_slice) * info.kv_len + row) * DF_D +
                          8 * (i / 4) + 2 * quad;
#if DISTFLASH_SPLIT
            reduce_add_2(pair, acc[i] * factor, acc[i + 1] * factor);
#else
            float2* at = reinterpret_cast<float2*>(pair);
            const float2 sum = *at;
            *at = make_float2(fmaf(acc[i], factor, sum.x), fmaf(acc[i + 1], factor, sum.y));
#endif
        }
    }
}
#endif

// The parameters (see `hopper/backward.rs`): q, k, v, dO and, stored in the inputs' type, dK and
// dV through tensor maps, their buffers, the row kernels' buffers, and for a step the f32 dK and
// dV accumulators, then the scalars.
extern "C" __global__ void __launch_bounds__(DF_THREADS, 1)
    distflash_hopper_attention_backward(
        const __grid_constant__ TensorMap q_map, const __grid_constant__ TensorMap k_map,
        const __grid_constant__ TensorMap v_map, const __grid_constant__ TensorMap do_map,
#if !DISTFLASH_ACCUMULATE
        const __grid_constant__ TensorMap dk_map, const __grid_constant__ TensorMap dv_map,
#endif
        const void* q_buffer, const void* k_buffer, const void* v_buffer, const void* do_buffer,
#if !DISTFLASH_ACCUMULATE
        void* dk_buffer, void* dv_buffer,
#endif
        const float* lse_log2, const float* delta, float* dq_sum,
#if DISTFLASH_DETERMINISTIC
        u32* dq_turns,
#endif
#if DISTFLASH_ACCUMULATE
        float* dk_sum, float* dv_sum,
#endif
#if DISTFLASH_DOCUMENTS
        const u32* docs,
#endif
        const __grid_constant__ BackwardInfo info) {
#if !DISTFLASH_DOCUMENTS
    const u32* docs = nullptr;
#endif
    extern __shared__ __align__(1024) unsigned char shared[];
    // Tiles on 1024-byte boundaries (the host asks for the slack).
    const Layout at =
        layout_from((shared_address(shared) + DF_SWIZZLE_SPAN - 1) & ~(DF_SWIZZLE_SPAN - 1));

    const u32 blocks = (info.kv_len + DF_BN - 1) / DF_BN;
    u32 kv_slice, block;
#if DISTFLASH_SPLIT
    // The slices of the launch order are (key/value slice, part) pairs, a key/value slice's
    // parts side by side.
    const u32 parts = info.head_parts;
    u32 part_slice;
    grouped_cube(blockIdx.x, blocks, info.slice_group, info.kv_slices * parts, part_slice, block);
    kv_slice = part_slice / parts;
    const int part_heads = static_cast<int>(info.group_size / parts);
#else
    grouped_cube(blockIdx.x, blocks, info.slice_group, info.kv_slices, kv_slice, block);
#endif
#if DISTFLASH_DETERMINISTIC
    // Last block first: the blocks a cube waits on (see the ordered adds) start before it.
    block = blocks - 1 - block;
#endif
    const u32 key0 = block * DF_BN;
    const u32 batch = kv_slice / info.kv_heads;
#if DISTFLASH_SPLIT
    Walk walk = block_walk(info, docs, batch, key0);
    walk.first_head = static_cast<int>(part_slice % parts) * part_heads;
    walk.count = walk.per_head * part_heads;
#else
    const Walk walk = block_walk(info, docs, batch, key0);
#endif

    if (threadIdx.x == 0) {
        barrier_init(at.kv_full, 1);
        for (u32 s = 0; s < DF_STAGES; ++s) {
            barrier_init(at.q_full + 8 * s, 1);
            barrier_init(at.do_full + 8 * s, 1);
            barrier_init(at.empty + 8 * s, 8);
        }
#if DISTFLASH_PRODUCER_ADDS
        for (u32 w = 0; w < DF_DQ_WARPGROUPS; ++w) {
            barrier_init(at.dq_full + 8 * w, 128);
            barrier_init(at.dq_empty + 8 * w, 1);
        }
#endif
        publish_barrier_inits();
    }
    __syncthreads();

    const u32 warpgroup = threadIdx.x / 128;
    if (warpgroup == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
#if DISTFLASH_PRODUCER_ADDS
        // Lane 0 of warps 1 and 2: the ordered dQ adds of consumer warpgroups 0 and 1. The warp's
        // index is shown warp-uniform to the compiler (a shuffle, as CUTLASS does): computed
        // per thread, the branch costs the copy loop below its uniform registers and 44 bytes
        // of spills within the producer's 24 registers.
        const u32 producer_warp = __shfl_sync(0xffffffffu, threadIdx.x / 32, 0);
        if (producer_warp != 0) {
            if (producer_warp <= DF_DQ_WARPGROUPS && threadIdx.x % 32 == 0) {
                add_query_grads_in_order(at, dq_sum, dq_turns, producer_warp - 1, walk.count);
            }
            return;
        }
#endif
        if (threadIdx.x != 0 || walk.count == 0) {
            return;
        }
        prefetch_map(&q_map);
        prefetch_map(&k_map);
        prefetch_map(&v_map);
        prefetch_map(&do_map);
        barrier_expect_bytes(at.kv_full, 2 * DF_KV_BYTES);
        copy_halves(at.k, DF_KV_HALF, &k_map, at.kv_full, key0, kv_slice);
        copy_halves(at.v, DF_KV_HALF, &v_map, at.kv_full, key0, kv_slice);
        for (int t = 0; t < walk.count; ++t) {
            const u32 s = stage_of(t), free_parity = parity_of(t) ^ 1;
            u32 q_slice;
            int tile;
            tile_of(info, walk, kv_slice, t, q_slice, tile);
            const u32 row0 = static_cast<u32>(tile) * DF_BM;
            const u64 rows = static_cast<u64>(q_slice) * info.q_tiles * DF_BM + row0;
            barrier_wait(at.empty + 8 * s, free_parity);
            // Q with its log-sum-exps, then dO with its deltas, each on its own barrier.
            const u32 q_full = at.q_full + 8 * s, do_full = at.do_full + 8 * s;
            barrier_expect_bytes(q_full, DF_Q_BYTES + DF_ROW_BYTES);
            copy_halves(at.q + s * DF_Q_BYTES, DF_Q_HALF, &q_map, q_full, row0, q_slice);
            copy_bytes(at.lse + s * DF_ROW_BYTES, lse_log2 + rows, DF_ROW_BYTES, q_full);
            barrier_expect_bytes(do_full, DF_Q_BYTES + DF_ROW_BYTES);
            copy_halves(at.d_o + s * DF_Q_BYTES, DF_Q_HALF, &do_map, do_full, row0, q_slice);
            copy_bytes(at.delta + s * DF_ROW_BYTES, delta + rows, DF_ROW_BYTES, do_full);
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;");
    const u32 wg = warpgroup - 1;
    const u32 thread = threadIdx.x % 128;
    const u32 warp = thread / 32;
    const u32 lane = thread % 32;
    const u32 quad = lane % 4;
    // The thread's fragment rows within the warpgroup's 64 keys: `local` and `local + 8`.
    const u32 local = warp * 16 + lane / 4;
    // The byte offset of the warpgroup's rows of K and V within each half.
    const u32 key_rows = wg * 64 * 128;
    const float scale_log2 = __uint_as_float(info.scale_log2_bits);

    // For each of the thread's keys: whether it is below the key count, and the first query row
    // that sees it (and, with a lower bound or documents, the end of those rows).
    bool key_in[2];
    long long sees_from[2];
#if DF_BANDED
    long long sees_until[2];
#endif
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const long long key = key0 + wg * 64 + local + 8 * r;
        key_in[r] = key < info.kv_len;
#if DF_BANDED
        // Keys past the end take the last one's rows (they are hidden by `key_in`).
        rows_seeing_key(info, docs, batch, min(key, static_cast<long long>(info.kv_len) - 1),
                        sees_from[r], sees_until[r]);
#elif DISTFLASH_UPPER
        sees_from[r] = key - info.upper;
#else
        sees_from[r] = 0;
#endif
    }

    float dk[DF_KV_REGS], dv[DF_KV_REGS];
#pragma unroll
    for (int i = 0; i < DF_KV_REGS; ++i) {
        dk[i] = 0.0f;
        dv[i] = 0.0f;
    }
    // Written by each tile's first products (their values never pass from one tile to the next).
    float s[DF_S_REGS], dp[DF_S_REGS];
    u32 p[DF_P_REGS], ds[DF_P_REGS];

    if (walk.count > 0) {
        barrier_wait(at.kv_full, 0);
    }
#if DISTFLASH_DETERMINISTIC
    u32 last_walker = block;
#endif
#if DISTFLASH_DETERMINISTIC && !DISTFLASH_PRODUCER_ADDS
    // The counter of the tile whose dQ this warpgroup added last, counted in (by thread 0) once
    // the next tile's score products are issued, so that the fence's round trip runs under them;
    // the last one after the walk. Null when none waits.
    u32* pending_turn = nullptr;
#endif
#pragma unroll 1
    for (int t = 0; t < walk.count; ++t) {
        const u32 stage = stage_of(t), parity = parity_of(t);
        u32 q_slice;
        int tile;
        tile_of(info, walk, kv_slice, t, q_slice, tile);
        const u32 q_rows = at.q + stage * DF_Q_BYTES;
        const u32 do_rows = at.d_o + stage * DF_Q_BYTES;
        const u32 ds_tile = at.ds + stage * DF_DS_BYTES;
#if DISTFLASH_DETERMINISTIC
        // The blocks above this one that walk the tile add their dQ first: `last_walker` is the
        // last of the run (rising with the tile; from this block again at each head). Found
        // here, where few registers are live.
        if (tile == walk.first) {
            last_walker = block;
        }
        while (last_walker + 1 < blocks && walks_tile(info, docs, batch, last_walker + 1, tile)) {
            ++last_walker;
        }
#endif

        barrier_wait(at.q_full + 8 * stage, parity);
        issue_transposed_scores(s, at.k + key_rows, q_rows);
        barrier_wait(at.do_full + 8 * stage, parity);
        issue_transposed_scores(dp, at.v + key_rows, do_rows);
#if DISTFLASH_DETERMINISTIC && !DISTFLASH_PRODUCER_ADDS
        if (thread == 0) {
            end_turn(pending_turn);
        }
        pending_turn = nullptr;
#endif

        wgmma_wait<1>();
        fence_registers(s);
        const u32 lse = at.lse + stage * DF_ROW_BYTES;
#if DF_BANDED
        const bool masked = tile < walk.unmasked_from || tile >= walk.masked_from;
#else
        const bool masked = tile < walk.unmasked_from;
#endif
        VisibleColumns visible;
        if (masked) {
            const int column0 = tile * DF_BM + 2 * static_cast<int>(quad);
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                visible.first[r] = first_visible_column(sees_from[r], key_in[r], column0);
#if DF_BANDED
                visible.end[r] = end_visible_column(sees_until[r], column0);
#endif
            }
            probabilities<true>(s, lse, quad, scale_log2, visible);
        } else {
            probabilities<false>(s, lse, quad, scale_log2, visible);
        }
        wgmma_wait<0>();
        fence_registers(dp);
        score_gradients(dp, s, at.delta + stage * DF_ROW_BYTES, quad);
        pack_fragment(s, p);
        pack_fragment(dp, ds);

        fence_registers(p);
        fence_registers(ds);
        fence_registers(dv);
        fence_registers(dk);
        issue_key_grads(dv, p, do_rows);
        issue_key_grads(dk, ds, q_rows);
        // dS^T into this warpgroup's rows of the stage's dS^T, for both warpgroups' dQ.
        store_rows_swizzled(ds, ds_tile + key_rows, 0, local, quad);
        fence_shared_for_copies();
        named_sync(DF_DS_BARRIER, 256);
        // Written by the first product (never read before), and read only where computed: no
        // value of dq lives from one tile to the next.
        float dq[DF_DQ_REGS];
        const bool computes_dq = DF_DQ_WARPGROUPS == 2 || wg == 0;
        const u64 tile_index = static_cast<u64>(q_slice) * info.q_tiles + tile;
#if DISTFLASH_PRODUCER_ADDS
        // The warpgroup's dQ buffer, free once the producer has read the last tile's block
        // (mostly long before), and its header, while dQ's registers are not yet live: waited on
        // with them live, the consumers spill.
        if (computes_dq) {
            barrier_wait(at.dq_empty + 8 * wg, (static_cast<u32>(t) & 1) ^ 1);
            if (thread == 0) {
                const u32 header = at.dq_header + wg * DF_DQ_HEADER_BYTES;
                asm volatile("st.shared.u64 [%0], %1;" ::"r"(header), "l"(tile_index) : "memory");
                asm volatile("st.shared.u32 [%0], %1;" ::"r"(header + 8), "r"(last_walker - block)
                             : "memory");
            }
        }
#endif
        if (computes_dq) {
            issue_query_grads(dq, ds_tile, at.k + wg * DF_KV_HALF);
        }
#if DISTFLASH_DETERMINISTIC && !DISTFLASH_PRODUCER_ADDS
        // The tile's counter, read while the dQ product runs: mostly the turn has come by then.
        u32* turn = dq_turns + tile_index * DF_DQ_WARPGROUPS + wg;
        u32 seen = 0;
        if (computes_dq && thread == 0) {
            seen = load_acquire(turn);
        }
#endif
        wgmma_wait<0>();
        fence_registers(dv);
        fence_registers(dk);
        fence_registers(p);
        fence_registers(ds);
        if (lane == 0) {
            barrier_arrive(at.empty + 8 * stage);
        }
        if (computes_dq) {
            fence_registers(dq);
#if !DISTFLASH_PRODUCER_ADDS
            float* block_sum = dq_sum + tile_index * DF_DQ_TILE + wg * (DF_BM * 64);
#endif
#if DISTFLASH_PRODUCER_ADDS
            // Into the warpgroup's buffer (free: see above) for the producer's ordered adds; the
            // consumers go on to the next tile.
            store_query_grads(at.dq + wg * DF_DQ_BLOCK_BYTES, dq, thread);
            fence_shared_for_copies();
            barrier_arrive(at.dq_full + 8 * wg);
#elif DISTFLASH_DETERMINISTIC
            if (thread == 0) {
                wait_for_turn(turn, last_walker - block, seen);
            }
            named_sync(DF_ORDER_BARRIER + wg, 128);
            add_query_grads(block_sum, dq, thread);
            named_sync(DF_ORDER_BARRIER + wg, 128);
            pending_turn = turn;
#else
            add_query_grads(block_sum, dq, thread);
#endif
        }
    }

#if DISTFLASH_DETERMINISTIC && !DISTFLASH_PRODUCER_ADDS
    if (thread == 0) {
        end_turn(pending_turn);
    }
#endif

    const float scale = __uint_as_float(info.scale_bits);
#if DISTFLASH_ACCUMULATE
    // A step: dK scaled and dV added to the accumulators (nothing where no query sees the block).
    if (walk.count > 0) {
        const u32 key = key0 + wg * 64 + local;
        add_key_grads(dk_sum, dk, scale, info, kv_slice, key, quad);
        add_key_grads(dv_sum, dv, 1.0f, info, kv_slice, key, quad);
    }
#else
    // The epilogue: dK scaled, dK and dV into the warpgroup's rows of K's and V's shared memory
    // (once both warpgroups are done with them), stored by the copy engine.
    named_sync(DF_DONE_BARRIER, 256);
#pragma unroll
    for (int i = 0; i < DF_KV_REGS; ++i) {
        dk[i] *= scale;
    }
    u32 packed[DF_KV_REGS / 2];
    pack_fragment(dv, packed);
    store_rows_swizzled(packed, at.v + key_rows, DF_KV_HALF, local, quad);
    pack_fragment(dk, packed);
    store_rows_swizzled(packed, at.k + key_rows, DF_KV_HALF, local, quad);
    fence_shared_for_copies();
    named_sync(DF_STORE_BARRIER + wg, 128);
    if (thread == 0 && key0 + wg * 64 < info.kv_len) {
        store_halves(&dk_map, at.k + key_rows, DF_KV_HALF, key0 + wg * 64, kv_slice);
        store_halves(&dv_map, at.v + key_rows, DF_KV_HALF, key0 + wg * 64, kv_slice);
        store_boxes_read();
    }
#endif
}
