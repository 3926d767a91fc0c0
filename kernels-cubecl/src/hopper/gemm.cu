// Hopper (sm_90a) bf16 matrix product C[M, N] = A[M, K] * op(B), f32 accumulation, written as
// bf16 or f32: asynchronous warpgroup MMA (`wgmma`) on operands that the bulk tensor copy engine
// (TMA) stages in shared memory, one producer warpgroup feeding two consumer warpgroups.
//
// CUDA C++ with inline PTX, no headers: compiled by NVRTC for sm_90a and launched through
// CubeCL's CUDA runtime (`hopper/source_task.rs`), on CubeCL's stream and buffers. The host
// (`hopper/gemm.rs`) prepends the variant's switches, then the PTX building blocks (`ptx.cuh`):
//   DISTFLASH_B_MN_MAJOR 0: B is [N, K] row-major (C = A B^T); 1: B is [K, N] row-major (C = A B)
//   DISTFLASH_C_F32      0: C is bf16; 1: C is f32
// and refuses shapes that are not multiples of the tile (M % 128, N % 256, K % 64).
//
// The parameters come in CubeCL's launch order: the tensor maps (passed by value, encoded by
// CubeCL from the host's `TensorMapMeta`), the buffers behind them, the plain buffers, and the
// scalars as one struct passed by value.
//
// A cube (CTA) of 384 threads is persistent: it walks tiles `blockIdx.x, + gridDim.x, ...` of
// 128 x 256 outputs, in groups of GROUP_M tile rows so that the tiles under way at one time
// share rows of A and columns of B in L2.
// - Warpgroup 0 (producer) keeps 40 registers; one thread waits for a free stage, then asks the
//   copy engine for the stage's A tile (128 x 64) and B tile (256 x 64) with the 128-byte swizzle,
//   which completes on the stage's `full` barrier.
// - Warpgroups 1 and 2 (consumers) take 232 registers each and own rows 0-63 and 64-127 of the
//   tile: per stage four `wgmma.m64n256k16` read both operands from shared memory into 128 f32
//   accumulators per thread; a stage is handed back (its `empty` barrier) once the next stage's
//   products are issued and the previous ones are done. Each tile ends with a store of the
//   accumulators from registers.

#ifndef DISTFLASH_B_MN_MAJOR
#define DISTFLASH_B_MN_MAJOR 0
#endif
#ifndef DISTFLASH_C_F32
#define DISTFLASH_C_F32 0
#endif

// The scalars, as CubeCL packs four u32 scalars (16 bytes).
struct GemmInfo {
    u32 m;
    u32 n;
    u32 k;
    u32 unused;
};

#define DF_BM 128
#define DF_BN 256
#define DF_BK 64
#define DF_STAGES 4
#define DF_CONSUMERS 2
#define DF_THREADS (128 * (DF_CONSUMERS + 1))
#define DF_GROUP_M 16
// Bytes of one stage's A tile (128 rows of 128 bytes) and B tile (256 rows of 128 bytes).
#define DF_A_STAGE (DF_BM * DF_BK * 2)
#define DF_B_STAGE (DF_BN * DF_BK * 2)

// ---- warpgroup MMA (the building blocks are in ptx.cuh) ----------------------------------

// K-major (rows of 64 elements, 128 bytes): the leading offset is unused, 8-row groups lie
// 1024 bytes apart.
__device__ __forceinline__ u64 k_major(u32 address) {
    return descriptor(address, 16, DF_SWIZZLE_SPAN);
}

// MN-major B: 64-column blocks (boxes of DF_BK rows of 128 bytes) lie DF_BK * 128 bytes apart,
// 8-row groups of K 1024 bytes apart.
__device__ __forceinline__ u64 mn_major(u32 address) {
    return descriptor(address, DF_BK * 128, DF_SWIZZLE_SPAN);
}

#define DF_ACC4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define DF_ACC16(i) DF_ACC4(i), DF_ACC4(i + 4), DF_ACC4(i + 8), DF_ACC4(i + 12)
#define DF_ACC128                                                                              \
    DF_ACC16(0), DF_ACC16(16), DF_ACC16(32), DF_ACC16(48), DF_ACC16(64), DF_ACC16(80),        \
        DF_ACC16(96), DF_ACC16(112)

// Keeps the compiler from moving reads or writes of the accumulators across this point (the
// asynchronous products write them behind its back).
__device__ __forceinline__ void fence_accumulators(float (&d)[128]) {
    asm volatile("" : DF_ACC128 : : "memory");
}

// d (+)= A[64 x 16] * B[16 x 256]; `accumulate` 0 overwrites d.
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], u64 a, u64 b, u32 accumulate) {
    asm volatile(
        "{\n"
        ".reg .pred keep;\n"
        "setp.ne.b32 keep, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, "
        "%111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, "
        "%125, %126, %127}, %128, %129, keep, 1, 1, 0, %131;\n"
        "}\n"
        : DF_ACC128
        : "l"(a), "l"(b), "r"(accumulate), "n"(DISTFLASH_B_MN_MAJOR));
}

// ---- the kernel -------------------------------------------------------------------------------

// Tile `tile` of the walk: tile rows in groups of DF_GROUP_M, each group column by column.
__device__ __forceinline__ void tile_position(u32 tile, u32 tiles_m, u32 tiles_n, u32& tm,
                                              u32& tn) {
    const u32 per_group = DF_GROUP_M * tiles_n;
    const u32 group = tile / per_group;
    const u32 first = group * DF_GROUP_M;
    const u32 rows = min(DF_GROUP_M, tiles_m - first);
    const u32 within = tile - group * per_group;
    tm = first + within % rows;
    tn = within / rows;
}

extern "C" __global__ void __launch_bounds__(DF_THREADS, 1)
    distflash_hopper_gemm(const __grid_constant__ TensorMap a_map,
                          const __grid_constant__ TensorMap b_map, const void* a_buffer,
                          const void* b_buffer, void* c, const __grid_constant__ GemmInfo info) {
    extern __shared__ __align__(1024) unsigned char shared[];
    // Stage tiles on 1024-byte boundaries (the host asks for the slack).
    const u32 base = (shared_address(shared) + DF_SWIZZLE_SPAN - 1) & ~(DF_SWIZZLE_SPAN - 1);
    const u32 a_tiles = base;
    const u32 b_tiles = a_tiles + DF_STAGES * DF_A_STAGE;
    const u32 full = b_tiles + DF_STAGES * DF_B_STAGE;  // DF_STAGES barriers of 8 bytes
    const u32 empty = full + DF_STAGES * 8;

    const u32 tiles_m = info.m / DF_BM;
    const u32 tiles_n = info.n / DF_BN;
    const u32 tiles = tiles_m * tiles_n;
    const u32 k_blocks = info.k / DF_BK;

    if (threadIdx.x == 0) {
        for (u32 s = 0; s < DF_STAGES; ++s) {
            barrier_init(full + 8 * s, 1);
            barrier_init(empty + 8 * s, DF_CONSUMERS * 4);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();

    const u32 warpgroup = threadIdx.x / 128;
    if (warpgroup == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x != 0) {
            return;
        }
        prefetch_map(&a_map);
        prefetch_map(&b_map);
        u32 it = 0;
        for (u32 tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
            u32 tm, tn;
            tile_position(tile, tiles_m, tiles_n, tm, tn);
            for (u32 kb = 0; kb < k_blocks; ++kb, ++it) {
                const u32 s = it % DF_STAGES;
                barrier_wait(empty + 8 * s, ((it / DF_STAGES) & 1) ^ 1);
                const u32 bar = full + 8 * s;
                barrier_expect_bytes(bar, DF_A_STAGE + DF_B_STAGE);
                copy_box(a_tiles + s * DF_A_STAGE, &a_map, bar, kb * DF_BK, tm * DF_BM);
#if DISTFLASH_B_MN_MAJOR
                // Four boxes of 64 columns x 64 rows of K.
                for (u32 j = 0; j < DF_BN / 64; ++j) {
                    copy_box(b_tiles + s * DF_B_STAGE + j * (DF_BK * 128), &b_map, bar,
                             tn * DF_BN + j * 64, kb * DF_BK);
                }
#else
                copy_box(b_tiles + s * DF_B_STAGE, &b_map, bar, kb * DF_BK, tn * DF_BN);
#endif
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const u32 consumer = warpgroup - 1;
    const u32 thread = threadIdx.x % 128;
    const u32 warp = thread / 32;
    const u32 lane = thread % 32;
    float d[128];
    u32 it = 0;
    for (u32 tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        u32 tm, tn;
        tile_position(tile, tiles_m, tiles_n, tm, tn);
        fence_accumulators(d);
        for (u32 kb = 0; kb < k_blocks; ++kb, ++it) {
            const u32 s = it % DF_STAGES;
            barrier_wait(full + 8 * s, (it / DF_STAGES) & 1);
            const u32 a = a_tiles + s * DF_A_STAGE + consumer * (64 * 128);
            const u32 b = b_tiles + s * DF_B_STAGE;
            wgmma_fence();
#pragma unroll
            for (u32 kk = 0; kk < DF_BK / 16; ++kk) {
#if DISTFLASH_B_MN_MAJOR
                const u64 b_desc = mn_major(b + kk * (16 * 128));
#else
                const u64 b_desc = k_major(b + kk * 32);
#endif
                wgmma_m64n256k16(d, k_major(a + kk * 32), b_desc, (kb > 0 || kk > 0) ? 1u : 0u);
            }
            wgmma_commit();
            // The previous stage's products are done: hand its tiles back.
            wgmma_wait<1>();
            if (kb > 0 && lane == 0) {
                barrier_arrive(empty + 8 * ((it - 1) % DF_STAGES));
            }
        }
        wgmma_wait<0>();
        fence_accumulators(d);
        if (lane == 0) {
            barrier_arrive(empty + 8 * ((it - 1) % DF_STAGES));
        }

        // Accumulator fragment: n8 block j holds rows (r, r + 8), columns 8j + 2 (lane % 4) + {0, 1}.
        const u64 n = info.n;
        const u64 row = static_cast<u64>(tm) * DF_BM + consumer * 64 + warp * 16 + lane / 4;
        const u64 col = static_cast<u64>(tn) * DF_BN + 2 * (lane % 4);
#pragma unroll
        for (u32 j = 0; j < DF_BN / 8; ++j) {
            const u64 at = row * n + col + 8 * j;
#if DISTFLASH_C_F32
            float2* out = reinterpret_cast<float2*>(c);
            out[at / 2] = make_float2(d[4 * j], d[4 * j + 1]);
            out[(at + 8 * n) / 2] = make_float2(d[4 * j + 2], d[4 * j + 3]);
#else
            u32 lo, hi;
            asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(lo) : "f"(d[4 * j + 1]), "f"(d[4 * j]));
            asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(hi) : "f"(d[4 * j + 3]), "f"(d[4 * j + 2]));
            u32* out = reinterpret_cast<u32*>(c);
            out[at / 2] = lo;
            out[(at + 8 * n) / 2] = hi;
#endif
        }
    }
}
