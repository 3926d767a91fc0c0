// Hopper (sm_90a) attention forward, FlashAttention-3's design: O = softmax(scale Q K^T) V and
// the f32 log-sum-exp of every query row (or, for a step, the running state (o, m, l) of the
// stat-carrying contract, see ARCHITECTURE.md), with `wgmma` (asynchronous warpgroup MMA) for both
// products, the bulk tensor copy engine (TMA) staging Q, K and V in shared memory, and one
// producer warpgroup feeding two consumer warpgroups.
//
// CUDA C++ with inline PTX, no headers: compiled by NVRTC for sm_90a and launched through
// CubeCL's CUDA runtime (`hopper/source_task.rs`). The host (`hopper/forward.rs`) prepends the
// variant's switches, the PTX building blocks (`ptx.cuh`) and what the attention kernels share
// (`attention.cuh`). The switches:
//   DISTFLASH_HEAD_DIM       64 or 128
//   DISTFLASH_F16            0: q, k, v and O are bf16; 1: f16
//   DISTFLASH_UPPER          1: query row i sees key j only if j <= i + upper (causal: the shift
//                            q_offset - kv_offset; a window adds the keys after the diagonal)
//   DISTFLASH_LOWER          1: ... and only if j >= i + lower (a sliding window)
//   DISTFLASH_DOCUMENTS      1: ... and only if i and j lie in one document (a table argument)
//   DISTFLASH_INTRA_OVERLAP  1: a warpgroup's softmax of tile t runs under its P V of tile t - 1
//   DISTFLASH_PINGPONG       1: the two consumer warpgroups take turns to issue their products
//   DISTFLASH_STATE_IN       1: start from the running state (o, m, l) instead of the empty one
//   DISTFLASH_STATE_OUT      1: write the running state (o, m, l) instead of O and lse
// (both 0: a whole attention; OUT alone: a first step; both: a step; IN alone: a last step),
//   DISTFLASH_PERSISTENT     1: a persistent grid (a whole attention only; see below)
// and refuses what the kernel does not cover (other head dims and types). Every mask is a band
// (`kernels-cubecl/src/mask.rs`): row i sees the keys [lo(i), hi(i)), both ends non-decreasing in i.
//
// Tensors are row-major: q and O [B * Hq, Sq, D], k and v [B * Hkv, Skv, D], lse [B * Hq, Sq] in
// f32, the state's o [B * Hq, Sq, D], m and l [B * Hq, Sq] in f32 (m in natural units, the
// exact running max; o and l against it), q, k, v and O seen through three-dimensional tensor maps whose boxes are 64 columns (128 bytes, the
// 128-byte swizzle) of 128 rows (q, k, v) or 64 rows (O) of one (batch, head) slice: rows past a
// slice's length arrive as zeros and are never stored.
//
// A cube (CTA) of 384 threads takes 128 query rows of one slice and walks the key tiles of 128
// keys its rows' band reaches (none outside it) from the last to the first, so that the masked
// tiles of the band's trailing edge (the causal diagonal, a partial last tile) come first, then
// the tiles every row sees whole, unmasked, then those of its leading edge (a window's far end,
// a document's start), masked. Cubes start in launch order: the slices
// in groups whose keys and values fit in L2 together, and within a group the blocks by rank,
// heaviest (the last causal block) first, each rank over the group's slices (see `cube_work`).
// - Warpgroup 0 (producer) keeps 24 registers; one thread has the copy engine fetch Q once and
//   each tile's K and V into two stages each, on `full` barriers, reusing a stage once its
//   consumers arrive on its `empty` barrier.
// - Warpgroups 1 and 2 (consumers) take 240 registers each and own rows 0-63 and 64-127: per
//   tile S = Q K^T (`wgmma.m64n128k16`, both operands in shared memory, 64 f32 per thread), the
//   online softmax in registers (row maxima in base-2 units, the scale folded into one FMA before
//   `ex2`, a stale row max kept until a row passes it by more than 2^8), then O += P V with P
//   from registers (`wgmma` with A in registers: the accumulator fragment of S is the A fragment
//   of P once packed to 16 bits).
// - A step's prologue loads each thread's rows of the state (o as its accumulator fragment, m in
//   base-2 units as the rows' max, l as the quad's first partial sum) while Q arrives.
// - The epilogue divides by the row sums, writes O into the warpgroup's rows of Q's shared memory
//   (Q is no longer read) and has the copy engine store them; lse goes out from registers. A
//   step's epilogue instead rescales o and l to the exact running max and writes o, m and l from
//   registers (a row no key of the call reaches keeps its m bit for bit).
//
// With DISTFLASH_PERSISTENT (a whole attention only) the grid holds one cube per multiprocessor,
// and each cube walks work items, (slice, block) pairs numbered as the cubes of the grid above
// (`cube_work`): its first is its own index, each next one claimed from a counter in global
// memory (zero at launch) once the producer has issued the current item's copies, so the items
// start in launch order on whichever cube is free first, as the hardware schedules the cubes of
// the grid above. Q takes two buffers: the producer copies the next item's Q (with its item
// number, on the buffer's `full` barrier) and then its first K and V tiles while the consumers
// finish the current item's last P V and store its O; a buffer goes back to the producer (its
// `empty` barrier, one arrival per consumer warpgroup) once O's store has read it, which the
// warpgroup's first thread waits for under the next item's first scores. The rings of K and V
// stages and the consumers' turns run on across items; an item number past the last ends the
// walk.

#ifndef DISTFLASH_HEAD_DIM
#define DISTFLASH_HEAD_DIM 128
#endif
#ifndef DISTFLASH_F16
#define DISTFLASH_F16 0
#endif
#ifndef DISTFLASH_INTRA_OVERLAP
#define DISTFLASH_INTRA_OVERLAP 1
#endif
#ifndef DISTFLASH_PINGPONG
#define DISTFLASH_PINGPONG 1
#endif
#ifndef DISTFLASH_STATE_IN
#define DISTFLASH_STATE_IN 0
#endif
#ifndef DISTFLASH_STATE_OUT
#define DISTFLASH_STATE_OUT 0
#endif
#ifndef DISTFLASH_PERSISTENT
#define DISTFLASH_PERSISTENT 0
#endif
#if DISTFLASH_PERSISTENT && (DISTFLASH_STATE_IN || DISTFLASH_STATE_OUT)
#error "the persistent grid runs a whole attention only"
#endif

// The scalars, as CubeCL packs fourteen u32 scalars (56 bytes).
struct ForwardInfo {
    u32 q_len;
    u32 kv_len;
    u32 q_heads;
    // Query heads per key/value head.
    u32 group_size;
    // Query row i sees key j only if j <= i + upper (DISTFLASH_UPPER) and j >= i + lower
    // (DISTFLASH_LOWER).
    int upper;
    int lower;
    // The score scale times log2(e), as f32 bits.
    u32 scale_log2_bits;
    // (batch, head) slices per launch group (see `cube_work`).
    u32 slice_group;
    u32 slices;
    // The documents (DISTFLASH_DOCUMENTS): absolute positions of query row 0 and key row 0,
    // entries between two batch rows' bounds (0 when shared) and bounds per batch row.
    u32 q_pos0;
    u32 kv_pos0;
    u32 doc_stride;
    u32 doc_count;
    u32 unused;
};

#define DF_D DISTFLASH_HEAD_DIM
#define DF_BM 128
#define DF_BN 128
#define DF_HALVES (DF_D / 64)
#define DF_STAGES 2
// Q tiles in shared memory: a second one lets a persistent cube copy its next item's queries.
#define DF_Q_BUFFERS (DISTFLASH_PERSISTENT ? 2 : 1)
#define DF_THREADS 384
// Bytes of one 64-column half of the Q tile and of one stage's K or V tile (rows of 128 bytes).
#define DF_Q_HALF (DF_BM * 128)
#define DF_KV_HALF (DF_BN * 128)
#define DF_Q_BYTES (DF_HALVES * DF_Q_HALF)
#define DF_KV_BYTES (DF_HALVES * DF_KV_HALF)
// Per consumer thread: S's accumulators, O's, and P packed two values a register.
#define DF_S_REGS (DF_BN / 2)
#define DF_O_REGS (DF_D / 2)
#define DF_P_REGS (DF_BN / 4)
// How far (base 2) a row's max may pass the max its weights are taken against before the warp
// rescales its output: weights stay below 2^8.
#define DF_LAZY_SLACK 8.0f
// Named barriers: 1 and 2 give consumer warpgroup 0 and 1 their turn to issue products; 3 and 4
// gather one warpgroup before its output store.
#define DF_TURN_BARRIER 1
#define DF_STORE_BARRIER 3

// ---- warpgroup MMA ----------------------------------------------------------------------------

// s (+)= A[64 x 16] B[16 x 128]^T, both K-major in shared memory; `accumulate` 0 overwrites s.
__device__ __forceinline__ void wgmma_ss_n128(float (&s)[64], u64 a, u64 b, u32 accumulate) {
    asm volatile(DF_WGMMA_KEEP("%66") "wgmma.mma_async.sync.aligned.m64n128k16.f32." DF_AB
                                      "." DF_AB " {" DF_ACC64 "}, %64, %65, keep, 1, 1, 0, 0;\n}\n"
                 : DF_F64(s)
        : "l"(a), "l"(b), "r"(accumulate));
}

// S = Q K^T for one warpgroup: its 64 rows of Q (`q`: their first half's address) against the
// stage's 128 keys (`k`), over the head dim in steps of 16 (4 per 64-column half).
__device__ __forceinline__ void issue_scores(float (&s)[DF_S_REGS], u32 q, u32 k) {
    wgmma_fence();
#pragma unroll
    for (u32 kk = 0; kk < DF_D / 16; ++kk) {
        const u32 half_offset = (kk / 4), within = (kk % 4) * 32;
        wgmma_ss_n128(s, k_major(q + half_offset * DF_Q_HALF + within),
                      k_major(k + half_offset * DF_KV_HALF + within), kk > 0 ? 1u : 0u);
    }
    wgmma_commit();
}

// O += P V for one warpgroup: P's 16-key steps from registers, V's rows of the stage at `v`.
__device__ __forceinline__ void issue_values(float (&o)[DF_O_REGS], const u32 (&p)[DF_P_REGS],
                                             u32 v) {
    wgmma_fence();
#pragma unroll
    for (u32 kk = 0; kk < DF_BN / 16; ++kk) {
        const u64 b = mn_major(v + kk * 16 * 128, DF_KV_HALF);
#if DF_D == 128
        wgmma_rs_n128(o, p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3], b);
#else
        wgmma_rs_n64(o, p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3], b);
#endif
    }
    wgmma_commit();
}

// ---- the online softmax -----------------------------------------------------------------------

// The running statistics of the two rows a consumer thread holds (`r` = 0: its fragment row
// lane / 4, `r` = 1: that row + 8), identical in the four threads of a quad: the max the weights
// are taken against (base 2, `-inf` before any visible key), the thread's partial row sum, and the
// keys the row sees, [key_start, key_end) (key_start with a lower bound only); with
// DISTFLASH_STATE_OUT also the exact running max (base 2).
struct Rows {
    float max[2];
    float sum[2];
    int key_end[2];
#if DF_BANDED
    int key_start[2];
#endif
#if DISTFLASH_STATE_OUT
    float seen[2];
#endif
};

// Turns the scores of one tile (keys from `key0`) into weights in place: masks keys outside each
// row's range (MASKED only), moves the rows' maxima, and adds the weights to the row sums.
// Returns whether the warp moved its maxima (then `factor` holds each row's rescale factor for
// the output and the sums are already rescaled).
template <bool MASKED>
__device__ __forceinline__ bool softmax_tile(float (&s)[DF_S_REGS], Rows& rows, int key0,
                                             u32 quad, float scale_log2, float (&factor)[2]) {
    if (MASKED) {
        // The row's range in the thread's columns of the tile.
        int visible[2];
#if DF_BANDED
        int hidden_below[2];
#endif
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            visible[r] = rows.key_end[r] - key0 - 2 * static_cast<int>(quad);
#if DF_BANDED
            hidden_below[r] = rows.key_start[r] - key0 - 2 * static_cast<int>(quad);
#endif
        }
#pragma unroll
        for (int i = 0; i < DF_S_REGS; ++i) {
            const int column = 8 * (i / 4) + i % 2;
            bool hidden = column >= visible[DF_ROW_OF(i)];
#if DF_BANDED
            hidden = hidden || column < hidden_below[DF_ROW_OF(i)];
#endif
            if (hidden) {
                s[i] = DF_NEG_INF;
            }
        }
    }
    float tile_max[2] = {DF_NEG_INF, DF_NEG_INF};
#pragma unroll
    for (int i = 0; i < DF_S_REGS; ++i) {
        tile_max[DF_ROW_OF(i)] = fmaxf(tile_max[DF_ROW_OF(i)], s[i]);
    }
    bool moved = false;
    float next_max[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
        // The scale is positive: the max of scaled scores is the scaled max.
        next_max[r] = fmaxf(rows.max[r], tile_max[r] * scale_log2);
        moved = moved || next_max[r] > rows.max[r] + DF_LAZY_SLACK;
#if DISTFLASH_STATE_OUT
        rows.seen[r] = fmaxf(rows.seen[r], next_max[r]);
#endif
    }
    const bool rescale = __any_sync(0xffffffffu, moved);
    if (rescale) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            // Equal maxima (two empty rows included) give exactly 1, never -inf - -inf.
            factor[r] =
                next_max[r] == rows.max[r] ? 1.0f : fast_exp2(rows.max[r] - next_max[r]);
            rows.sum[r] *= factor[r];
            rows.max[r] = next_max[r];
        }
    }
    // A row that has seen no key weighs its (masked) scores against 0: 2^-inf = 0.
    float bias[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        bias[r] = rows.max[r] == DF_NEG_INF ? 0.0f : -rows.max[r];
    }
#pragma unroll
    for (int i = 0; i < DF_S_REGS; ++i) {
        const float weight = fast_exp2(fmaf(s[i], scale_log2, bias[DF_ROW_OF(i)]));
        s[i] = weight;
        rows.sum[DF_ROW_OF(i)] += weight;
    }
    return rescale;
}

__device__ __forceinline__ void rescale_output(float (&o)[DF_O_REGS], const float (&factor)[2]) {
#pragma unroll
    for (int i = 0; i < DF_O_REGS; ++i) {
        o[i] *= factor[DF_ROW_OF(i)];
    }
}

// ---- pipeline ---------------------------------------------------------------------------------

// The shared memory of one cube, from its first 1024-byte boundary: Q (DF_Q_BUFFERS tiles), two
// stages of K and of V, then the barriers (with DISTFLASH_PERSISTENT also each Q buffer's `empty`
// barrier and item number).
struct Layout {
    u32 q;
    u32 k;
    u32 v;
    u32 q_full;
    u32 k_full;
    u32 k_empty;
    u32 v_full;
    u32 v_empty;
#if DISTFLASH_PERSISTENT
    u32 q_empty;
    u32 work;
#endif
};

__device__ __forceinline__ Layout layout_from(u32 base) {
    Layout at;
    at.q = base;
    at.k = at.q + DF_Q_BUFFERS * DF_Q_BYTES;
    at.v = at.k + DF_STAGES * DF_KV_BYTES;
    at.q_full = at.v + DF_STAGES * DF_KV_BYTES;
    at.k_full = at.q_full + DF_Q_BUFFERS * 8;
    at.k_empty = at.k_full + DF_STAGES * 8;
    at.v_full = at.k_empty + DF_STAGES * 8;
    at.v_empty = at.v_full + DF_STAGES * 8;
#if DISTFLASH_PERSISTENT
    at.q_empty = at.v_empty + DF_STAGES * 8;
    at.work = at.q_empty + DF_Q_BUFFERS * 8;
#endif
    return at;
}

// Which key tiles one cube walks: `count` tiles of DF_BN keys, taken from tile `last` down; the
// first `masked` of the walk (the trailing edge, the highest tiles) and those from `masked_from`
// on (the leading edge, with a lower bound only) compare keys against each row's range.
struct Walk {
    int count;
    int last;
    int masked;
#if DF_BANDED
    int masked_from;
#endif
};

__device__ __forceinline__ long long clamp_keys(long long end, u32 kv_len) {
    return min(max(end, 0ll), static_cast<long long>(kv_len));
}

// The keys query row `row` (below `q_len`) of batch row `batch` sees, [start, end) within
// [0, kv_len] (`start` 0 without a lower bound; empty when equal), as `row_key_range` in
// `mask.rs`.
__device__ __forceinline__ void row_keys(const ForwardInfo& info, const u32* docs, u32 batch,
                                         long long row, int& start, int& end) {
    long long lo = 0, hi = info.kv_len;
#if DISTFLASH_UPPER
    hi = row + info.upper + 1;
#endif
#if DISTFLASH_LOWER
    lo = row + info.lower;
#endif
#if DISTFLASH_DOCUMENTS
    u32 doc_start, doc_end;
    document_of(docs + batch * info.doc_stride, info.doc_count,
                static_cast<u32>(row) + info.q_pos0, doc_start, doc_end);
    lo = max(lo, static_cast<long long>(doc_start) - info.kv_pos0);
    hi = min(hi, static_cast<long long>(doc_end) - info.kv_pos0);
#endif
    start = static_cast<int>(clamp_keys(lo, info.kv_len));
    end = static_cast<int>(max(clamp_keys(hi, info.kv_len), static_cast<long long>(start)));
    (void)batch;
    (void)docs;
}

// The walk of the block of query rows from `block_start` (as `band_tiles` in `geometry.rs`):
// every tile from its first row's start to its last row's end, unmasked the tiles between the
// last row's start and the first row's end (which every row sees whole).
__device__ __forceinline__ Walk block_walk(const ForwardInfo& info, const u32* docs, u32 batch,
                                           u32 block_start) {
    const long long last = min(block_start + DF_BM, info.q_len) - 1;
    int first_start, first_end, last_start, last_end;
    row_keys(info, docs, batch, block_start, first_start, first_end);
    row_keys(info, docs, batch, last, last_start, last_end);
    const int first = first_start / DF_BN;
    // Every row's keys lie in [first_start, last_end): none when that is empty.
    const int end = last_end > first_start ? (last_end + DF_BN - 1) / DF_BN : first;
    const int lead_end = min((last_start + DF_BN - 1) / DF_BN, end);
    const int trail_start = max(first_end / DF_BN, lead_end);
    Walk walk;
    walk.count = end - first;
    walk.last = end - 1;
    walk.masked = end - trail_start;
#if DF_BANDED
    walk.masked_from = end - lead_end;
#endif
    return walk;
}

// The stage and phase parity of the walk's tile `t` in a ring of DF_STAGES stages.
__device__ __forceinline__ u32 stage_of(int t) {
    return static_cast<u32>(t) % DF_STAGES;
}
__device__ __forceinline__ u32 parity_of(int t) {
    return (static_cast<u32>(t) / DF_STAGES) & 1;
}

// One lane of each warp hands a stage back (the `empty` barriers count the consumers' 8 warps).
__device__ __forceinline__ void release(u32 empty, int t, u32 lane) {
    if (lane == 0) {
        barrier_arrive(empty + 8 * stage_of(t));
    }
}

// With DISTFLASH_PINGPONG, consumer warpgroup `wg` waits for its turn to issue products...
__device__ __forceinline__ void await_turn(u32 wg) {
#if DISTFLASH_PINGPONG
    named_sync(DF_TURN_BARRIER + wg, 256);
#endif
}
// ... and gives the turn to the other one once its own are issued.
__device__ __forceinline__ void pass_turn(u32 wg) {
#if DISTFLASH_PINGPONG
    named_arrive(DF_TURN_BARRIER + (wg ^ 1), 256);
#endif
}

// The (slice, block) of cube `cube` (see `grouped_cube`): each group's blocks from the last to
// the first.
__device__ __forceinline__ void cube_work(const ForwardInfo& info, u32 cube, u32 blocks,
                                          u32& slice, u32& block) {
    u32 rank;
    grouped_cube(cube, blocks, info.slice_group, info.slices, slice, rank);
    block = blocks - 1 - rank;
}

// One cube's work (a persistent cube's item): 128 query rows of one slice.
struct Item {
    u32 slice;
    u32 block_start;
    u32 kv_slice;
    u32 batch;
    Walk walk;
};

// The item of cube (or item number) `work`.
__device__ __forceinline__ Item item_of(const ForwardInfo& info, const u32* docs, u32 work,
                                        u32 blocks) {
    Item item;
    u32 block;
    cube_work(info, work, blocks, item.slice, block);
    item.block_start = block * DF_BM;
    item.kv_slice = (item.slice / info.q_heads) * (info.q_heads / info.group_size) +
                    (item.slice % info.q_heads) / info.group_size;
    item.batch = item.slice / info.q_heads;
    item.walk = block_walk(info, docs, item.batch, item.block_start);
    return item;
}

// The producer's copies of an item's K and V tiles, walk tile `t` into the ring's tile
// `base + t` (`base`: the tiles of the cube's earlier items); every calling thread waits for
// the stages, the `leader` alone has them filled.
__device__ __forceinline__ void load_tiles(const Layout& at, const Walk& walk, int base,
                                           u32 kv_slice, const TensorMap* k_map,
                                           const TensorMap* v_map, bool leader) {
    for (int t = 0; t < walk.count; ++t) {
        const u32 s = stage_of(base + t), free_parity = parity_of(base + t) ^ 1;
        const u32 key0 = static_cast<u32>(walk.last - t) * DF_BN;
        barrier_wait(at.k_empty + 8 * s, free_parity);
        if (leader) {
            barrier_expect_bytes(at.k_full + 8 * s, DF_KV_BYTES);
            copy_halves(at.k + s * DF_KV_BYTES, DF_KV_HALF, k_map, at.k_full + 8 * s, key0,
                        kv_slice);
        }
        barrier_wait(at.v_empty + 8 * s, free_parity);
        if (leader) {
            barrier_expect_bytes(at.v_full + 8 * s, DF_KV_BYTES);
            copy_halves(at.v + s * DF_KV_BYTES, DF_KV_HALF, v_map, at.v_full + 8 * s, key0,
                        kv_slice);
        }
    }
}

#if DISTFLASH_PERSISTENT
__device__ __forceinline__ void store_shared_u32(u32 address, u32 value) {
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(address), "r"(value) : "memory");
}
__device__ __forceinline__ u32 load_shared_u32(u32 address) {
    u32 value;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(value) : "r"(address) : "memory");
    return value;
}

// The producer warp's next item number, claimed by its `leader` (past the grid's first items, in
// order, by whichever cube asks first) and broadcast to the warp: warp-uniform, so that the
// compiler keeps the producer's item in uniform registers (24 registers a thread do not hold it).
__device__ __forceinline__ u32 claim_item(u32* counter, bool leader) {
    u32 claimed = 0;
    if (leader) {
        asm volatile("atom.relaxed.gpu.global.add.u32 %0, [%1], 1;"
                     : "=r"(claimed)
                     : "l"(counter)
                     : "memory");
    }
    return gridDim.x + __shfl_sync(0xffffffffu, claimed, 0);
}

// Item `j` of the cube (j > 0) hands the Q buffer of item j - 1 back to the producer once the
// warpgroup's store of that item's O has read it (one arrival per warpgroup, by the thread that
// stored).
__device__ __forceinline__ void hand_back_q(const Layout& at, u32 j, u32 thread) {
    if (j > 0 && thread == 0) {
        store_boxes_wait_read();
        barrier_arrive(at.q_empty + 8 * ((j - 1) % DF_Q_BUFFERS));
    }
}
#endif

// The softmax of walk tile `t` (the tile of keys from (count - 1 - t) DF_BN), with the mask
// where the walk says so; returns whether the warp moved its maxima (see `softmax_tile`).
__device__ __forceinline__ bool softmax_of(float (&s)[DF_S_REGS], Rows& rows, const Walk& walk,
                                           int t, u32 quad, float scale_log2,
                                           float (&factor)[2]) {
    const int key0 = (walk.last - t) * DF_BN;
#if DF_BANDED
    const bool masked = t < walk.masked || t >= walk.masked_from;
#else
    const bool masked = t < walk.masked;
#endif
    return masked ? softmax_tile<true>(s, rows, key0, quad, scale_log2, factor)
                           : softmax_tile<false>(s, rows, key0, quad, scale_log2, factor);
}

// O += P V with walk tile `t`'s values, waited for; their stage handed back.
__device__ __forceinline__ void values_of(float (&o)[DF_O_REGS], u32 (&p)[DF_P_REGS],
                                          const Layout& at, int t, u32 lane) {
    barrier_wait(at.v_full + 8 * stage_of(t), parity_of(t));
    fence_registers(o);
    fence_registers(p);
    issue_values(o, p, at.v + stage_of(t) * DF_KV_BYTES);
    wgmma_wait<0>();
    fence_registers(o);
    release(at.v_empty, t, lane);
}

// ---- the running state ------------------------------------------------------------------------

#define DF_LOG2_E 1.44269504088896341f
#define DF_LN_2 0.69314718055994531f

// A consumer thread's rows of the state: `first` (the slice's first row, slice * q_len), the
// thread's fragment row `row0` (then `row0 + 8`), and which exist.
struct StateRows {
    u64 first;
    u32 row0;
    bool exists[2];
};

// Accumulator element `i` (even) and `i + 1` of o: the f32 pair at row DF_ROW_OF(i), column
// 8 (i / 4) + 2 quad of the thread's rows.
__device__ __forceinline__ u64 state_pair(const StateRows& at, int i, u32 quad) {
    return (at.first + at.row0 + 8 * DF_ROW_OF(i)) * DF_D + 8 * (i / 4) + 2 * quad;
}

#if DISTFLASH_STATE_IN
// Starts the thread's rows from the state: o as the accumulator fragment, m (kept in `m_in`, in
// natural units) in base 2 as the rows' max, l as the partial sum of the quad's first thread (the
// quad's partial sums add up to it). Rows past the queries start empty.
__device__ __forceinline__ void load_state(const float* state_o, const float* state_m,
                                           const float* state_l, const StateRows& at, u32 quad,
                                           float (&o)[DF_O_REGS], Rows& rows, float (&m_in)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const u64 row = at.first + at.row0 + 8 * r;
        m_in[r] = at.exists[r] ? state_m[row] : DF_NEG_INF;
        rows.max[r] = m_in[r] * DF_LOG2_E;
        rows.sum[r] = at.exists[r] && quad == 0 ? state_l[row] : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < DF_O_REGS; i += 2) {
        float2 pair = make_float2(0.0f, 0.0f);
        if (at.exists[DF_ROW_OF(i)]) {
            pair = *reinterpret_cast<const float2*>(state_o + state_pair(at, i, quad));
        }
        o[i] = pair.x;
        o[i + 1] = pair.y;
    }
}
#endif

#if DISTFLASH_STATE_OUT
// Writes the thread's rows of the state: o and the quads' sum l rescaled from the max the weights
// were taken against to the exact running max, which is m (natural units; `m_in` bit for bit where
// the max never moved from `start`, its base-2 value at the start).
__device__ __forceinline__ void store_state(float* state_o, float* state_m, float* state_l,
                                            const StateRows& at, u32 quad, float (&o)[DF_O_REGS],
                                            const Rows& rows, const float (&m_in)[2],
                                            const float (&start)[2]) {
    float factor[2], m_out[2], l_out[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float sum = rows.sum[r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        // Equal maxima (two -inf included) give exactly 1.
        factor[r] = rows.seen[r] == rows.max[r] ? 1.0f : fast_exp2(rows.max[r] - rows.seen[r]);
        l_out[r] = sum * factor[r];
        m_out[r] = rows.seen[r] == start[r] ? m_in[r] : rows.seen[r] * DF_LN_2;
    }
    rescale_output(o, factor);
#pragma unroll
    for (int i = 0; i < DF_O_REGS; i += 2) {
        if (at.exists[DF_ROW_OF(i)]) {
            *reinterpret_cast<float2*>(state_o + state_pair(at, i, quad)) =
                make_float2(o[i], o[i + 1]);
        }
    }
    if (quad == 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            if (at.exists[r]) {
                const u64 row = at.first + at.row0 + 8 * r;
                state_m[row] = m_out[r];
                state_l[row] = l_out[r];
            }
        }
    }
}
#endif

// The parameters (see `hopper/forward.rs`): q, k, v and, for a finished output, O through tensor
// maps, their buffers, lse (finished output) and the state (a step's), the documents' table, the
// item counter (a persistent grid's), the scalars.
extern "C" __global__ void __launch_bounds__(DF_THREADS, 1)
    distflash_hopper_attention_forward(
        const __grid_constant__ TensorMap q_map, const __grid_constant__ TensorMap k_map,
        const __grid_constant__ TensorMap v_map,
#if !DISTFLASH_STATE_OUT
        const __grid_constant__ TensorMap o_map,
#endif
        const void* q_buffer, const void* k_buffer, const void* v_buffer,
#if !DISTFLASH_STATE_OUT
        void* o_buffer, float* lse,
#endif
#if DISTFLASH_STATE_IN || DISTFLASH_STATE_OUT
        float* state_o, float* state_m, float* state_l,
#endif
#if DISTFLASH_DOCUMENTS
        const u32* docs,
#endif
#if DISTFLASH_PERSISTENT
        u32* work_counter,
#endif
        const __grid_constant__ ForwardInfo info) {
#if !DISTFLASH_DOCUMENTS
    const u32* docs = nullptr;
#endif
    extern __shared__ __align__(1024) unsigned char shared[];
    // Tiles on 1024-byte boundaries (the host asks for the slack).
    const Layout at =
        layout_from((shared_address(shared) + DF_SWIZZLE_SPAN - 1) & ~(DF_SWIZZLE_SPAN - 1));

    const u32 blocks = (info.q_len + DF_BM - 1) / DF_BM;
#if DISTFLASH_PERSISTENT
    // Item numbers from `items` on end the walk.
    const u32 items = info.slices * blocks;
#else
    const Item item = item_of(info, docs, blockIdx.x, blocks);
    const u32 slice = item.slice, block_start = item.block_start, batch = item.batch;
    const Walk walk = item.walk;
#endif

    if (threadIdx.x == 0) {
        for (u32 b = 0; b < DF_Q_BUFFERS; ++b) {
            barrier_init(at.q_full + 8 * b, 1);
#if DISTFLASH_PERSISTENT
            barrier_init(at.q_empty + 8 * b, 2);
#endif
        }
        for (u32 s = 0; s < DF_STAGES; ++s) {
            barrier_init(at.k_full + 8 * s, 1);
            barrier_init(at.v_full + 8 * s, 1);
            barrier_init(at.k_empty + 8 * s, 8);
            barrier_init(at.v_empty + 8 * s, 8);
        }
        publish_barrier_inits();
    }
    __syncthreads();

    const u32 warpgroup = threadIdx.x / 128;
    if (warpgroup == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
#if DISTFLASH_PERSISTENT
        // The producer's first warp walks the items, its first thread (the leader) has the copy
        // engine fill the buffers.
        if (threadIdx.x >= 32) {
            return;
        }
        const bool leader = threadIdx.x == 0;
        if (leader) {
            prefetch_map(&q_map);
            prefetch_map(&k_map);
            prefetch_map(&v_map);
        }
        // Item `j` of the cube takes Q buffer j % 2; its tiles follow the earlier items' in the
        // ring of stages.
        int base = 0;
        u32 j = 0;
        for (u32 work = blockIdx.x; work < items; ++j) {
            const u32 qb = j % DF_Q_BUFFERS;
            barrier_wait(at.q_empty + 8 * qb, ((j / DF_Q_BUFFERS) & 1) ^ 1);
            const Item next = item_of(info, docs, work, blocks);
            if (leader) {
                store_shared_u32(at.work + 4 * qb, work);
                barrier_expect_bytes(at.q_full + 8 * qb, DF_Q_BYTES);
                copy_halves(at.q + qb * DF_Q_BYTES, DF_Q_HALF, &q_map, at.q_full + 8 * qb,
                            next.block_start, next.slice);
            }
            load_tiles(at, next.walk, base, next.kv_slice, &k_map, &v_map, leader);
            base += next.walk.count;
            work = claim_item(work_counter, leader);
        }
        // The end: an item number past the last, in the next buffer once it is free.
        const u32 qb = j % DF_Q_BUFFERS;
        barrier_wait(at.q_empty + 8 * qb, ((j / DF_Q_BUFFERS) & 1) ^ 1);
        if (leader) {
            store_shared_u32(at.work + 4 * qb, items);
            barrier_arrive(at.q_full + 8 * qb);
        }
#else
        if (threadIdx.x != 0) {
            return;
        }
        prefetch_map(&q_map);
        prefetch_map(&k_map);
        prefetch_map(&v_map);
        barrier_expect_bytes(at.q_full, DF_Q_BYTES);
        copy_halves(at.q, DF_Q_HALF, &q_map, at.q_full, block_start, slice);
        load_tiles(at, walk, 0, item.kv_slice, &k_map, &v_map, true);
#endif
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;");
    const u32 wg = warpgroup - 1;
    const u32 thread = threadIdx.x % 128;
    const u32 warp = thread / 32;
    const u32 lane = thread % 32;
    const u32 quad = lane % 4;
    // The thread's fragment rows within the warpgroup's 64: `local` and `local + 8`.
    const u32 local = warp * 16 + lane / 4;
    const float scale_log2 = __uint_as_float(info.scale_log2_bits);

#if DISTFLASH_PERSISTENT
    float s[DF_S_REGS];
#pragma unroll
    for (int i = 0; i < DF_S_REGS; ++i) {
        s[i] = 0.0f;
    }
    u32 p[DF_P_REGS];
    float factor[2];
#if DISTFLASH_PINGPONG
    // Warpgroup 0 issues first; the turns run on from item to item.
    if (wg == 1) {
        named_arrive(DF_TURN_BARRIER, 256);
    }
#endif
    // The ring tile of the item's first walk tile.
    int base = 0;
    for (u32 j = 0;; ++j) {
        const u32 qb = j % DF_Q_BUFFERS;
        barrier_wait(at.q_full + 8 * qb, (j / DF_Q_BUFFERS) & 1);
        const u32 work = load_shared_u32(at.work + 4 * qb);
        if (work >= items) {
            break;
        }
        const Item item = item_of(info, docs, work, blocks);
        const u32 slice = item.slice, block_start = item.block_start, batch = item.batch;
        const Walk walk = item.walk;
        const u32 q_rows = at.q + qb * DF_Q_BYTES + wg * 64 * 128;
#else
    {
        const int base = 0;
#endif
        Rows rows;
        // Each row's m as the state held it (natural units) and its max in base 2 at the start.
        float m_in[2], start[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            rows.max[r] = DF_NEG_INF;
            rows.sum[r] = 0.0f;
            // Rows past the queries take the last one's keys (never stored).
            const long long row = min(block_start + wg * 64 + local + 8 * r, info.q_len - 1);
            int key_start;
            row_keys(info, docs, batch, row, key_start, rows.key_end[r]);
#if DF_BANDED
            rows.key_start[r] = key_start;
#endif
            m_in[r] = DF_NEG_INF;
        }
        float o[DF_O_REGS];
#pragma unroll
        for (int i = 0; i < DF_O_REGS; ++i) {
            o[i] = 0.0f;
        }
        StateRows state_rows;
        state_rows.first = static_cast<u64>(slice) * info.q_len;
        state_rows.row0 = block_start + wg * 64 + local;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            state_rows.exists[r] = state_rows.row0 + 8 * r < info.q_len;
        }
#if DISTFLASH_STATE_IN
        load_state(state_o, state_m, state_l, state_rows, quad, o, rows, m_in);
#endif
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            start[r] = rows.max[r];
#if DISTFLASH_STATE_OUT
            rows.seen[r] = rows.max[r];
#endif
        }
#if !DISTFLASH_PERSISTENT
        float s[DF_S_REGS];
#pragma unroll
        for (int i = 0; i < DF_S_REGS; ++i) {
            s[i] = 0.0f;
        }
        u32 p[DF_P_REGS];
        float factor[2];
        const u32 q_rows = at.q + wg * 64 * 128;

#if DISTFLASH_PINGPONG
        // Warpgroup 0 issues first.
        if (wg == 1) {
            named_arrive(DF_TURN_BARRIER, 256);
        }
#endif
        barrier_wait(at.q_full, 0);
#else
        if (walk.count == 0) {
            hand_back_q(at, j, thread);
        }
#endif

#if DISTFLASH_INTRA_OVERLAP
        if (walk.count > 0) {
            // The first tile: its scores alone.
            barrier_wait(at.k_full + 8 * stage_of(base), parity_of(base));
            issue_scores(s, q_rows, at.k + stage_of(base) * DF_KV_BYTES);
#if DISTFLASH_PERSISTENT
            hand_back_q(at, j, thread);
#endif
            wgmma_wait<0>();
            fence_registers(s);
            release(at.k_empty, base, lane);
            // The output is still 0 unless a state came in: then it may need rescaling.
            if (softmax_of(s, rows, walk, 0, quad, scale_log2, factor) && DISTFLASH_STATE_IN) {
                rescale_output(o, factor);
            }
            pack_fragment(s, p);
            // Then S of tile t under P V of tile t - 1 (ring tiles `base + t`, `base + t - 1`).
#pragma unroll 1
            for (int t = 1; t < walk.count; ++t) {
                const int tile = base + t;
                barrier_wait(at.k_full + 8 * stage_of(tile), parity_of(tile));
                await_turn(wg);
                issue_scores(s, q_rows, at.k + stage_of(tile) * DF_KV_BYTES);
                barrier_wait(at.v_full + 8 * stage_of(tile - 1), parity_of(tile - 1));
                fence_registers(p);
                issue_values(o, p, at.v + stage_of(tile - 1) * DF_KV_BYTES);
                pass_turn(wg);
                wgmma_wait<1>();
                fence_registers(s);
                release(at.k_empty, tile, lane);
                const bool rescale = softmax_of(s, rows, walk, t, quad, scale_log2, factor);
                wgmma_wait<0>();
                fence_registers(o);
                fence_registers(p);
                release(at.v_empty, tile - 1, lane);
                if (rescale) {
                    rescale_output(o, factor);
                }
                pack_fragment(s, p);
            }
            values_of(o, p, at, base + walk.count - 1, lane);
        }
#else
#pragma unroll 1
        for (int t = 0; t < walk.count; ++t) {
            const int tile = base + t;
            barrier_wait(at.k_full + 8 * stage_of(tile), parity_of(tile));
            await_turn(wg);
            issue_scores(s, q_rows, at.k + stage_of(tile) * DF_KV_BYTES);
            pass_turn(wg);
#if DISTFLASH_PERSISTENT
            if (t == 0) {
                hand_back_q(at, j, thread);
            }
#endif
            wgmma_wait<0>();
            fence_registers(s);
            release(at.k_empty, tile, lane);
            if (softmax_of(s, rows, walk, t, quad, scale_log2, factor)) {
                rescale_output(o, factor);
            }
            pack_fragment(s, p);
            values_of(o, p, at, tile, lane);
        }
#endif
#if DISTFLASH_PINGPONG && !DISTFLASH_PERSISTENT
        // Warpgroup 0 takes the turn warpgroup 1 passed after its last products (or, with no
        // tile, at the start), so that every phase of both turn barriers completes.
        if (wg == 0) {
            named_sync(DF_TURN_BARRIER, 256);
        }
#endif

#if DISTFLASH_STATE_OUT
        store_state(state_o, state_m, state_l, state_rows, quad, o, rows, m_in, start);
#else
        // The epilogue: the quads' row sums, O / sum and lse = max + log2(sum), in natural units.
        float inverse[2], row_lse[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float sum = rows.sum[r];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            inverse[r] = sum > 0.0f ? 1.0f / sum : 0.0f;
            row_lse[r] = sum > 0.0f ? rows.max[r] * DF_LN_2 + logf(sum) : DF_NEG_INF;
        }
        rescale_output(o, inverse);
        // O into the warpgroup's rows of Q's shared memory (Q is no longer read), as the copy
        // engine reads it.
        u32 packed[DF_O_REGS / 2];
        pack_fragment(o, packed);
        store_rows_swizzled(packed, q_rows, DF_Q_HALF, local, quad);
        fence_shared_for_copies();
        named_sync(DF_STORE_BARRIER + wg, 128);
        if (thread == 0) {
            store_halves(&o_map, q_rows, DF_Q_HALF, block_start + wg * 64, slice);
#if DISTFLASH_PERSISTENT
            // Waited for under the next item's first scores (`hand_back_q`) or at the end.
            store_boxes_commit();
#else
            store_boxes_read();
#endif
        }
        if (quad == 0) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const u32 row = block_start + wg * 64 + local + 8 * r;
                if (row < info.q_len) {
                    lse[static_cast<u64>(slice) * info.q_len + row] = row_lse[r];
                }
            }
        }
#endif
#if DISTFLASH_PERSISTENT
        base += walk.count;
#endif
    }
#if DISTFLASH_PERSISTENT
    // The last item's store reads its Q buffer before the cube ends.
    if (thread == 0) {
        store_boxes_wait_read();
    }
#if DISTFLASH_PINGPONG
    // Warpgroup 0 takes the turn warpgroup 1 passed after its last products (or, with no tile,
    // at the start), so that every phase of both turn barriers completes.
    if (wg == 0) {
        named_sync(DF_TURN_BARRIER, 256);
    }
#endif
#endif
}
