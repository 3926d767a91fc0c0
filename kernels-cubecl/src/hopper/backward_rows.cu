// The row kernels of the Hopper attention backward, around `attention_backward.cu`:
// - `distflash_hopper_backward_prepare` (before), one warp per query row of every slice padded
//   to whole tiles of 64 rows: delta = rowsum(dO * O) in f32 and the log-sum-exp in base 2
//   (lse log2(e); FLT_MAX for a row that saw no key, lse = -inf, so that its probabilities are
//   exactly 0), both [B * Hq, Tq * 64] f32, and for padding rows a delta of 0 and FLT_MAX; it
//   also zeroes the row's share of the f32 dQ sum [B * Hq, Tq, 64 * D].
// - `distflash_hopper_backward_dq` (after), one thread per vector of four values of the f32 dQ
//   sum, read in the sum's fragment order (see `add_query_grads` in `attention_backward.cu`) so
//   that a warp reads 512 contiguous bytes: the values times the score scale, written as the
//   inputs' 16-bit type into dQ [B * Hq, Sq, D] (two pairs, 8 rows apart).
// - For a backward step, whose delta is given ([B * Hq, Sq] f32) and whose dQ is an f32
//   accumulator: `distflash_hopper_backward_prepare_step` (before) pads the given delta as the
//   prepare kernel writes its own, and `distflash_hopper_backward_dq_add` (after) adds the
//   scaled sum to the accumulator.
// - For a whole attention whose main kernel split the GQA groups' query heads over several cubes
//   (DISTFLASH_SPLIT there), which added dK (scaled) and dV to zeroed f32 sums [B * Hkv, Skv, D]:
//   `distflash_hopper_backward_kv_convert` (after), one thread per pair of dK and of dV values,
//   writes them in the inputs' 16-bit type.
//
// CUDA C++ with inline PTX, no headers: the host (`hopper/backward.rs`) prepends the variant's
// switches (DISTFLASH_HEAD_DIM 64 or 128, DISTFLASH_F16), `ptx.cuh` and `attention.cuh`.

#ifndef DISTFLASH_HEAD_DIM
#define DISTFLASH_HEAD_DIM 128
#endif

// The scalars, as CubeCL packs four u32 scalars (16 bytes).
struct RowsInfo {
    u32 q_len;
    // Tiles of 64 query rows per slice, the last padded.
    u32 q_tiles;
    // (batch, query head) slices.
    u32 slices;
    // The score scale, as f32 bits (the dQ kernel's factor).
    u32 scale_bits;
};

#define DF_D DISTFLASH_HEAD_DIM
#define DF_BM 64
// Threads per cube of both kernels; the prepare kernel's rows per cube (one per warp).
#define DF_ROW_UNITS 256
#define DF_ROWS_PER_CUBE (DF_ROW_UNITS / 32)
#define DF_FLT_MAX 3.402823466e38f
#define DF_LOG2_E 1.44269504088896341f
// Below this a log-sum-exp means "no key seen" (as the other kernels' `lse_log2` reads it).
#define DF_FINITE_FLOOR -3.0e38f

// The two 16-bit values of a register as f32, the low one first.
__device__ __forceinline__ float2 unpack(u32 pair) {
#if DISTFLASH_F16
    float low, high;
    asm("{\n"
        ".reg .b16 l, h;\n"
        "mov.b32 {l, h}, %2;\n"
        "cvt.f32.f16 %0, l;\n"
        "cvt.f32.f16 %1, h;\n"
        "}\n"
        : "=f"(low), "=f"(high)
        : "r"(pair));
    return make_float2(low, high);
#else
    return make_float2(__uint_as_float(pair << 16), __uint_as_float(pair & 0xffff0000u));
#endif
}

// The padded row of the calling warp: its index over all slices, its slice, its index within the
// slice; whether it exists. Its lanes zero its share of the dQ sum.
struct PaddedRow {
    u64 row;
    u64 slice;
    u64 i;
};

__device__ __forceinline__ bool padded_row(const RowsInfo& info, float* dq_sum, PaddedRow& at) {
    const u32 lane = threadIdx.x % 32;
    const u64 padded = static_cast<u64>(info.q_tiles) * DF_BM;
    at.row = static_cast<u64>(blockIdx.x) * DF_ROWS_PER_CUBE + threadIdx.x / 32;
    if (at.row >= info.slices * padded) {
        return false;
    }
    at.slice = at.row / padded;
    at.i = at.row % padded;
    if (lane < DF_D / 4) {
        reinterpret_cast<float4*>(dq_sum + at.row * DF_D)[lane] =
            make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    return true;
}

// The base-2 log-sum-exp of a query row from its natural one: FLT_MAX where it saw no key.
__device__ __forceinline__ float lse_in_base_2(float natural) {
    return natural >= DF_FINITE_FLOOR ? natural * DF_LOG2_E : DF_FLT_MAX;
}

extern "C" __global__ void __launch_bounds__(DF_ROW_UNITS)
    distflash_hopper_backward_prepare(const u32* out, const u32* grad_out, const float* lse,
                                      float* lse_log2, float* delta, float* dq_sum,
                                      const __grid_constant__ RowsInfo info) {
    const u32 lane = threadIdx.x % 32;
    PaddedRow at;
    if (!padded_row(info, dq_sum, at)) {
        return;
    }
    const u64 slice = at.slice, i = at.i;
    float sum = 0.0f;
    float row_lse = DF_FLT_MAX;
    if (i < info.q_len) {
        const u64 first = (slice * info.q_len + i) * (DF_D / 2);
#pragma unroll
        for (u32 pair = lane; pair < DF_D / 2; pair += 32) {
            const float2 o = unpack(out[first + pair]);
            const float2 g = unpack(grad_out[first + pair]);
            sum = fmaf(o.x, g.x, fmaf(o.y, g.y, sum));
        }
#pragma unroll
        for (u32 offset = 16; offset > 0; offset /= 2) {
            sum += __shfl_xor_sync(0xffffffffu, sum, offset);
        }
        row_lse = lse_in_base_2(lse[slice * info.q_len + i]);
    }
    if (lane == 0) {
        lse_log2[at.row] = row_lse;
        delta[at.row] = sum;
    }
}

extern "C" __global__ void __launch_bounds__(DF_ROW_UNITS)
    distflash_hopper_backward_prepare_step(const float* lse, const float* given_delta,
                                           float* lse_log2, float* delta, float* dq_sum,
                                           const __grid_constant__ RowsInfo info) {
    PaddedRow at;
    if (!padded_row(info, dq_sum, at) || threadIdx.x % 32 != 0) {
        return;
    }
    const bool query = at.i < info.q_len;
    const u64 row = at.slice * info.q_len + at.i;
    lse_log2[at.row] = query ? lse_in_base_2(lse[row]) : DF_FLT_MAX;
    delta[at.row] = query ? given_delta[row] : 0.0f;
}

// Four values of the dQ sum, scaled: what one thread of a warpgroup added as one vector (see
// `add_query_grads` in `attention_backward.cu`), columns `column` and `column + 1` of query row
// `i` of slice `slice` (`upper`) and of row `i + 8` (`lower`).
struct ScaledQuad {
    u64 slice;
    u32 i;
    u32 column;
    float2 upper;
    float2 lower;
};

// The scaled values of the dQ sum's vector `quad` [B * Hq, Tq, 64 * D / 4] (consecutive threads
// read consecutive vectors); false past the last.
__device__ __forceinline__ bool scaled_quad(const float* dq_sum, const RowsInfo& info, u64 quad,
                                            ScaledQuad& at) {
    const u32 per_tile = DF_BM * DF_D / 4, per_half = DF_BM * 64 / 4;
    if (quad >= static_cast<u64>(info.slices) * info.q_tiles * per_tile) {
        return false;
    }
    const u64 tile = quad / per_tile;
    const u32 within = static_cast<u32>(quad % per_tile);
    // The fragment's thread and its group of 8 columns in its warpgroup's 64 (the half).
    const u32 thread = within % 128, group = (within % per_half) / 128;
    at.column = (within / per_half) * 64 + group * 8 + (thread % 4) * 2;
    at.slice = tile / info.q_tiles;
    at.i = static_cast<u32>(tile % info.q_tiles) * DF_BM + (thread / 32) * 16 + (thread % 32) / 4;
    const float4 sum = reinterpret_cast<const float4*>(dq_sum)[quad];
    const float scale = __uint_as_float(info.scale_bits);
    at.upper = make_float2(sum.x * scale, sum.y * scale);
    at.lower = make_float2(sum.z * scale, sum.w * scale);
    return true;
}

// The index in dQ [B * Hq, Sq, D] of the pair of values at `column` of row `i` of `slice`.
__device__ __forceinline__ u64 query_pair(const RowsInfo& info, u64 slice, u32 i, u32 column) {
    return (slice * info.q_len + i) * (DF_D / 2) + column / 2;
}

extern "C" __global__ void __launch_bounds__(DF_ROW_UNITS)
    distflash_hopper_backward_dq(const float* dq_sum, u32* dq,
                                 const __grid_constant__ RowsInfo info) {
    ScaledQuad at;
    if (!scaled_quad(dq_sum, info, static_cast<u64>(blockIdx.x) * DF_ROW_UNITS + threadIdx.x, at)) {
        return;
    }
    if (at.i < info.q_len) {
        dq[query_pair(info, at.slice, at.i, at.column)] = pack(at.upper.x, at.upper.y);
    }
    if (at.i + 8 < info.q_len) {
        dq[query_pair(info, at.slice, at.i + 8, at.column)] = pack(at.lower.x, at.lower.y);
    }
}

// Adds `value` to the f32 pair `at`.
__device__ __forceinline__ void add_pair(float2* at, float2 value) {
    const float2 sum = *at;
    *at = make_float2(sum.x + value.x, sum.y + value.y);
}

extern "C" __global__ void __launch_bounds__(DF_ROW_UNITS)
    distflash_hopper_backward_dq_add(const float* dq_sum, float* dq,
                                     const __grid_constant__ RowsInfo info) {
    ScaledQuad at;
    if (!scaled_quad(dq_sum, info, static_cast<u64>(blockIdx.x) * DF_ROW_UNITS + threadIdx.x, at)) {
        return;
    }
    float2* pairs = reinterpret_cast<float2*>(dq);
    if (at.i < info.q_len) {
        add_pair(pairs + query_pair(info, at.slice, at.i, at.column), at.upper);
    }
    if (at.i + 8 < info.q_len) {
        add_pair(pairs + query_pair(info, at.slice, at.i + 8, at.column), at.lower);
    }
}

// A split backward's dK and dV sums (f32, dK already scaled) in the inputs' type: one thread per
// pair of values of each. `info.q_len` holds the key rows per slice and `info.slices` the
// key/value slices (`backward_plan::key_row_scalars`).
extern "C" __global__ void __launch_bounds__(DF_ROW_UNITS)
    distflash_hopper_backward_kv_convert(const float* dk_sum, const float* dv_sum, u32* dk,
                                         u32* dv, const __grid_constant__ RowsInfo info) {
    const u64 pair = static_cast<u64>(blockIdx.x) * DF_ROW_UNITS + threadIdx.x;
    if (pair >= static_cast<u64>(info.slices) * info.q_len * (DF_D / 2)) {
        return;
    }
    const float2 k = reinterpret_cast<const float2*>(dk_sum)[pair];
    const float2 v = reinterpret_cast<const float2*>(dv_sum)[pair];
    dk[pair] = pack(k.x, k.y);
    dv[pair] = pack(v.x, v.y);
}
