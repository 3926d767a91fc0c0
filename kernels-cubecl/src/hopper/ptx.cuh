// The PTX building blocks every Hopper (sm_90a) kernel of this crate is made of: integer types,
// the tensor map parameter, mbarriers, bulk copies (TMA, of tensors and of plain bytes) in and out
// of shared memory, vector atomic adds, shared-memory matrix descriptors and the warpgroup MMA
// fences. The host prepends this file to each kernel's source (after the variant's switches), so
// the kernels share one copy; like the kernels it includes no header (NVRTC's include paths differ
// by machine).

typedef unsigned int u32;
typedef unsigned long long u64;

// The driver's CUtensorMap: 128 opaque bytes, 64-byte aligned.
struct __align__(64) TensorMap {
    u64 opaque[16];
};

// The 128-byte swizzle repeats every 8 rows of 128 bytes: swizzled tiles start on 1024-byte
// boundaries.
#define DF_SWIZZLE_SPAN 1024

__device__ __forceinline__ u32 shared_address(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// ---- mbarriers --------------------------------------------------------------------------------

__device__ __forceinline__ void barrier_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void barrier_expect_bytes(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void barrier_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// Makes the calling thread's barrier initialisations visible to the cube's other threads (after
// the next __syncthreads()) and to the copy engine.
__device__ __forceinline__ void publish_barrier_inits() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Waits until the barrier's phase with this parity has completed.
__device__ __forceinline__ void barrier_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// ---- bulk tensor copies -----------------------------------------------------------------------

// Copies the box at (inner, outer) of the map's tensor into shared memory at `dst`, completing
// its bytes on `bar`.
__device__ __forceinline__ void copy_box(u32 dst, const TensorMap* map, u32 bar, u32 inner,
                                         u32 outer) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4}], [%2];" ::"r"(dst),
        "l"(reinterpret_cast<u64>(map)), "r"(bar), "r"(inner), "r"(outer)
        : "memory");
}

// Copies the box at (x, y, z) (innermost first) of the map's three-dimensional tensor into
// shared memory at `dst`, completing its bytes on `bar`. Elements outside the tensor arrive as
// zeros, and the barrier still counts the whole box.
__device__ __forceinline__ void copy_box_3d(u32 dst, const TensorMap* map, u32 bar, u32 x, u32 y,
                                            u32 z) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(dst),
        "l"(reinterpret_cast<u64>(map)), "r"(bar), "r"(x), "r"(y), "r"(z)
        : "memory");
}

// Copies `bytes` (a multiple of 16) from global memory at `src` into shared memory at `dst`, both
// on 16-byte boundaries, completing them on `bar`.
__device__ __forceinline__ void copy_bytes(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            dst),
        "l"(reinterpret_cast<u64>(src)), "r"(bytes), "r"(bar)
        : "memory");
}

// Stores the box at (x, y, z) of the map's three-dimensional tensor from shared memory at `src`;
// elements outside the tensor are not written. Completes as a bulk group of the calling thread
// (see `store_boxes_read`).
__device__ __forceinline__ void store_box_3d(const TensorMap* map, u32 src, u32 x, u32 y, u32 z) {
    asm volatile(
        "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(
            reinterpret_cast<u64>(map)),
        "r"(src), "r"(x), "r"(y), "r"(z)
        : "memory");
}

// Commits the calling thread's bulk stores and waits until they have read their shared memory.
__device__ __forceinline__ void store_boxes_read() {
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}

// The two halves of `store_boxes_read`, for a thread with other work between them: commits the
// calling thread's bulk stores as one group ...
__device__ __forceinline__ void store_boxes_commit() {
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// ... and waits until every group it committed has read its shared memory.
__device__ __forceinline__ void store_boxes_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}

// Makes this thread's ordinary writes to shared memory visible to the copy engine.
__device__ __forceinline__ void fence_shared_for_copies() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Adds four f32 values to global memory at `address` (16-byte aligned) atomically, without
// waiting for the result.
__device__ __forceinline__ void reduce_add_4(float* address, float a, float b, float c, float d) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(address), "f"(a), "f"(b),
                 "f"(c), "f"(d)
                 : "memory");
}

// Adds two f32 values to global memory at `address` (8-byte aligned) atomically, without
// waiting for the result.
__device__ __forceinline__ void reduce_add_2(float* address, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(address), "f"(a), "f"(b)
                 : "memory");
}

// Adds `bytes` (a multiple of 16) of f32 values at shared address `src` to those at `dst` with
// the copy engine (element by element, f32 adds rounded to nearest even), in the current bulk
// group: `store_boxes_read` waits until the engine has read them, `reductions_done` until the
// adds are complete.
__device__ __forceinline__ void reduce_add_bytes(float* dst, u32 src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(
                     dst),
                 "r"(src), "r"(bytes)
                 : "memory");
}

// Waits until every committed bulk group of the calling thread is complete, its writes done.
__device__ __forceinline__ void reductions_done() {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// Orders the calling thread's global memory accesses through the copy engine (the async proxy)
// with its ordinary ones (the generic proxy), both ways.
__device__ __forceinline__ void fence_global_for_copies() {
    asm volatile("fence.proxy.async.global;" ::: "memory");
}

__device__ __forceinline__ void prefetch_map(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<u64>(map)) : "memory");
}

// ---- warpgroup MMA ----------------------------------------------------------------------------

// A shared-memory matrix descriptor with the 128-byte swizzle: start address, leading and
// stride byte offsets, each in 16-byte units.
__device__ __forceinline__ u64 descriptor(u32 address, u32 leading, u32 stride) {
    return static_cast<u64>((address & 0x3FFFF) >> 4) |
           (static_cast<u64>((leading & 0x3FFFF) >> 4) << 16) |
           (static_cast<u64>((stride & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

template <int PENDING>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(PENDING) : "memory");
}
