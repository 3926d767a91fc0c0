// What the Hopper attention kernels (forward and backward) share on top of `ptx.cuh`: the 16-bit
// operand type of the variant, shared-memory matrix descriptors of 64-column swizzled tiles, the
// warpgroup MMA forms with A in registers, register fences for the asynchronous products, `exp2`,
// packing to 16 bits, named barriers, the cubes' launch order, bulk copies of 64-column halves,
// the store of an accumulator fragment into a swizzled tile, and the search of a position's
// document. The host prepends it after `ptx.cuh` (and after the variant's switches, which select
// DISTFLASH_F16) to each attention kernel's source.

#ifndef DISTFLASH_F16
#define DISTFLASH_F16 0
#endif
#ifndef DISTFLASH_HEAD_DIM
#define DISTFLASH_HEAD_DIM 128
#endif
// The mask's parts (see `hopper/band.rs`): an upper and a lower bound per row, documents; and
// whether a row's visible range may start after the first key (a query's) or end before the last
// row (a key's).
#ifndef DISTFLASH_UPPER
#define DISTFLASH_UPPER 0
#endif
#ifndef DISTFLASH_LOWER
#define DISTFLASH_LOWER 0
#endif
#ifndef DISTFLASH_DOCUMENTS
#define DISTFLASH_DOCUMENTS 0
#endif
#define DF_BANDED (DISTFLASH_LOWER || DISTFLASH_DOCUMENTS)

#if DISTFLASH_F16
#define DF_AB "f16"
#define DF_CVT "cvt.rn.f16x2.f32"
#else
#define DF_AB "bf16"
#define DF_CVT "cvt.rn.bf16x2.f32"
#endif

// -inf, spelled without a header.
#define DF_NEG_INF __int_as_float(0xff800000)

// ---- shared-memory operands -------------------------------------------------------------------

// A K-major tile (rows of 64 elements, 128 bytes, the copy engine's 128-byte swizzle): the leading
// offset is unused, 8-row groups lie 1024 bytes apart.
__device__ __forceinline__ u64 k_major(u32 address) {
    return descriptor(address, 16, DF_SWIZZLE_SPAN);
}

// An MN-major tile (its rows run along the product's K; 64 elements of M or N a row, 128 bytes,
// swizzled): 64-element chunks of M or N lie `chunk_bytes` apart, 8-row groups 1024 bytes apart.
__device__ __forceinline__ u64 mn_major(u32 address, u32 chunk_bytes) {
    return descriptor(address, chunk_bytes, DF_SWIZZLE_SPAN);
}

// ---- warpgroup MMA ----------------------------------------------------------------------------

#define DF_F4(x, i) "+f"(x[i]), "+f"(x[i + 1]), "+f"(x[i + 2]), "+f"(x[i + 3])
#define DF_F16(x, i) DF_F4(x, i), DF_F4(x, i + 4), DF_F4(x, i + 8), DF_F4(x, i + 12)
#define DF_F32(x) DF_F16(x, 0), DF_F16(x, 16)
#define DF_F64(x) DF_F16(x, 0), DF_F16(x, 16), DF_F16(x, 32), DF_F16(x, 48)
#define DF_R4(x, i) "+r"(x[i]), "+r"(x[i + 1]), "+r"(x[i + 2]), "+r"(x[i + 3])
#define DF_R16(x, i) DF_R4(x, i), DF_R4(x, i + 4), DF_R4(x, i + 8), DF_R4(x, i + 12)

// The accumulators of a `wgmma` string, 32 or 64 of them from operand %0, and the opening that
// sets its accumulate predicate `keep` to `x != 0` (`x` an operand or a literal).
#define DF_ACC32                                                                             \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "               \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define DF_ACC64                                                                             \
    DF_ACC32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, "  \
             "%47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define DF_WGMMA_KEEP(x) "{\n.reg .pred keep;\nsetp.ne.b32 keep, " x ", 0;\n"

// Keeps the compiler from moving reads or writes of registers across this point: the
// asynchronous products read and write them behind its back.
__device__ __forceinline__ void fence_registers(float (&x)[64]) {
    asm volatile("" : DF_F64(x) : : "memory");
}
__device__ __forceinline__ void fence_registers(float (&x)[32]) {
    asm volatile("" : DF_F32(x) : : "memory");
}
__device__ __forceinline__ void fence_registers(u32 (&x)[32]) {
    asm volatile("" : DF_R16(x, 0), DF_R16(x, 16) : : "memory");
}
__device__ __forceinline__ void fence_registers(u32 (&x)[16]) {
    asm volatile("" : DF_R16(x, 0) : : "memory");
}

// o += A[64 x 16] B[16 x 128], A in registers (four 16-bit pairs per thread, the accumulator
// fragment's layout), B MN-major in shared memory.
__device__ __forceinline__ void wgmma_rs_n128(float (&o)[64], u32 a0, u32 a1, u32 a2, u32 a3,
                                              u64 b) {
    asm volatile(DF_WGMMA_KEEP("1") "wgmma.mma_async.sync.aligned.m64n128k16.f32." DF_AB
                                    "." DF_AB " {" DF_ACC64
                                    "}, {%64, %65, %66, %67}, %68, keep, 1, 1, 1;\n}\n"
                 : DF_F64(o)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b));
}

// o += A[64 x 16] B[16 x 64], as `wgmma_rs_n128` for 64 columns.
__device__ __forceinline__ void wgmma_rs_n64(float (&o)[32], u32 a0, u32 a1, u32 a2, u32 a3,
                                             u64 b) {
    asm volatile(DF_WGMMA_KEEP("1") "wgmma.mma_async.sync.aligned.m64n64k16.f32." DF_AB
                                    "." DF_AB " {" DF_ACC32
                                    "}, {%32, %33, %34, %35}, %36, keep, 1, 1, 1;\n}\n"
                 : DF_F32(o)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b));
}

// Accumulator element `i` of a 64-row fragment (8-column blocks) is in row `local + 8 r` with
// `r = (i / 2) % 2` and column 8 (i / 4) + 2 (lane % 4) + i % 2, where `local = warp * 16 +
// lane / 4` within the warpgroup.
#define DF_ROW_OF(i) (((i) / 2) % 2)

// ---- arithmetic -------------------------------------------------------------------------------

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Two f32 values as one register of 16-bit values, the first in the low half.
__device__ __forceinline__ u32 pack(float low, float high) {
    u32 packed;
    asm(DF_CVT " %0, %1, %2;" : "=r"(packed) : "f"(high), "f"(low));
    return packed;
}

// An accumulator fragment packed to 16 bits in place of its layout: `packed[j]` holds elements
// 2j and 2j + 1 (one row's two adjacent columns). For the scores of a product this is the A
// fragment of the next product from registers.
template <int REGS>
__device__ __forceinline__ void pack_fragment(const float (&x)[REGS], u32 (&packed)[REGS / 2]) {
#pragma unroll
    for (int j = 0; j < REGS / 2; ++j) {
        packed[j] = pack(x[2 * j], x[2 * j + 1]);
    }
}

// ---- named barriers ---------------------------------------------------------------------------

__device__ __forceinline__ void named_sync(u32 id, u32 threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(u32 id, u32 threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ---- launch order ----------------------------------------------------------------------------

// The slice and rank of cube `cube` of a one-dimensional grid of `slices x blocks` cubes: the
// slices in groups of `slice_group` (the last may be narrower), each group's cubes rank by rank,
// one cube per slice of the group at each rank. Each kernel maps ranks to its blocks, heaviest
// first.
__device__ __forceinline__ void grouped_cube(u32 cube, u32 blocks, u32 slice_group, u32 slices,
                                             u32& slice, u32& rank) {
    const u32 per_group = slice_group * blocks;
    const u32 group = cube / per_group;
    const u32 first = group * slice_group;
    const u32 width = min(slice_group, slices - first);
    const u32 within = cube - group * per_group;
    slice = first + within % width;
    rank = within / width;
}

// ---- bulk copies of 64-column halves ----------------------------------------------------------

// Has the copy engine fetch the map's box from row `row` of slice `slice` as its
// DISTFLASH_HEAD_DIM / 64 halves of 64 columns, `half_bytes` apart from `dst`, completing on `bar`.
__device__ __forceinline__ void copy_halves(u32 dst, u32 half_bytes, const TensorMap* map,
                                            u32 bar, u32 row, u32 slice) {
    for (u32 h = 0; h < DISTFLASH_HEAD_DIM / 64; ++h) {
        copy_box_3d(dst + h * half_bytes, map, bar, 64 * h, row, slice);
    }
}

// Has the copy engine store the map's box at row `row` of slice `slice` from its halves of 64
// columns, `half_bytes` apart from `src` (a bulk group of the calling thread).
__device__ __forceinline__ void store_halves(const TensorMap* map, u32 src, u32 half_bytes,
                                             u32 row, u32 slice) {
    for (u32 h = 0; h < DISTFLASH_HEAD_DIM / 64; ++h) {
        store_box_3d(map, src + h * half_bytes, 64 * h, row, slice);
    }
}

// ---- fragments to shared memory ---------------------------------------------------------------

// Writes a warpgroup's fragment of 64 rows, packed to 16 bits (`packed[j]` holds accumulator
// elements 2j and 2j + 1), into a tile at `base` as the copy engine and the descriptors read it:
// rows of 128 bytes (64 columns), the 16-byte chunk c of row R at chunk c ^ (R % 8), and the
// 64-column halves `half_bytes` apart (`base` on a 1024-byte boundary).
template <int PACKED>
__device__ __forceinline__ void store_rows_swizzled(const u32 (&packed)[PACKED], u32 base,
                                                    u32 half_bytes, u32 local, u32 quad) {
#pragma unroll
    for (int j = 0; j < PACKED; ++j) {
        const u32 block = j / 2, row = local + 8 * DF_ROW_OF(2 * j);
        const u32 address = base + (block / 8) * half_bytes + row * 128 +
                            (((block % 8) ^ (row % 8)) * 16) + quad * 4;
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(address), "r"(packed[j]) : "memory");
    }
}

// ---- documents --------------------------------------------------------------------------------

// The document [start, end) (absolute positions) of absolute position `pos` in one batch row's
// `count` bounds at `bounds`: a binary search (as `document_of` in `mask.rs`). `pos` lies before
// the row's last bound.
__device__ __forceinline__ void document_of(const u32* bounds, u32 count, u32 pos, u32& start,
                                            u32& end) {
    // Invariant: bounds[lo] <= pos < bounds[hi].
    u32 lo = 0, hi = count - 1;
    while (hi - lo > 1) {
        const u32 mid = (lo + hi) / 2;
        if (bounds[mid] <= pos) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    start = bounds[lo];
    end = bounds[hi];
}
