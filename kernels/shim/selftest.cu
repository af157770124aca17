// Kernels that exercise the shim's fiber mode (tests/kernels_shim.rs checks their results):
// block reductions through warp shuffles and __shared__, votes on partial warps, segmented
// scans, atomics, and the shim's refusals. Valid CUDA, but not part of the library.
#include "../common.cuh"

// out[block] = wrapping sum of x over the block's grid-stride elements. Block: a multiple of 32.
extern "C" __global__ void qccl_selftest_block_sum(const uint32_t* x, uint64_t n, uint32_t* out) {
    __shared__ uint32_t warp_sums[32];
    uint32_t s = 0;
    for (uint64_t i = qccl_tid(); i < n; i += qccl_nthreads()) s += x[i];
    for (int d = 16; d > 0; d /= 2) s += __shfl_xor_sync(0xffffffffu, s, d);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = s;
    __syncthreads();
    if (threadIdx.x < 32) {
        uint32_t v = threadIdx.x < blockDim.x / 32 ? warp_sums[threadIdx.x] : 0;
        for (int d = 16; d > 0; d /= 2) v += __shfl_down_sync(0xffffffffu, v, d);
        if (threadIdx.x == 0) out[blockIdx.x] = v;
    }
}

// For each warp w of the grid (blocks of any size, so the last warp of a block may be
// partial): ballot[w] = bits of (x[i] & 1); all[w], any[w] from __all_sync/__any_sync of it.
// Lanes past n vote 0.
extern "C" __global__ void qccl_selftest_votes(const uint32_t* x, uint64_t n, uint32_t* ballot,
                                               uint32_t* all, uint32_t* any) {
    unsigned warp = threadIdx.x / 32;
    unsigned lanes = blockDim.x - warp * 32 < 32 ? blockDim.x - warp * 32 : 32;
    unsigned mask = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u;
    uint64_t i = qccl_tid();
    int p = i < n ? (int)(x[i] & 1u) : 0;
    unsigned b = __ballot_sync(mask, p);
    int a = __all_sync(mask, p);
    int y = __any_sync(mask, p);
    uint64_t w = (uint64_t)blockIdx.x * ((blockDim.x + 31) / 32) + warp;
    if (threadIdx.x % 32 == 0) {
        ballot[w] = b;
        all[w] = (uint32_t)a;
        any[w] = (uint32_t)y;
    }
}

// Inclusive scan of x within sections of `width` lanes (__shfl_up_sync); one element a thread.
extern "C" __global__ void qccl_selftest_scan(const uint32_t* x, uint64_t n, uint32_t* out,
                                              int width) {
    uint64_t i = qccl_tid();
    uint32_t v = i < n ? x[i] : 0;
    for (int d = 1; d < width; d *= 2) {
        uint32_t u = __shfl_up_sync(0xffffffffu, v, d, width);
        if ((int)(threadIdx.x % width) >= d) v += u;
        __syncwarp();
    }
    if (i < n) out[i] = v;
}

// acc[0] += x, acc[1] = max, acc[2] = min, acc[3] |= x (unsigned); facc[0] += float(x & 255).
extern "C" __global__ void qccl_selftest_atomics(const uint32_t* x, uint64_t n, uint32_t* acc,
                                                 float* facc) {
    QCCL_GRID_STRIDE(i, n) {
        atomicAdd(&acc[0], x[i]);
        atomicMax(&acc[1], x[i]);
        atomicMin(&acc[2], x[i]);
        atomicOr(&acc[3], x[i]);
        atomicAdd(&facc[0], (float)(x[i] & 255u));
    }
}

// Every thread writes its slot of a __shared__ array, then reads its neighbour's:
// out[block * blockDim + t] = block * 1000 + (t + 1) % blockDim.
extern "C" __global__ void qccl_selftest_shared(uint32_t* out) {
    __shared__ uint32_t slots[1024];
    slots[threadIdx.x] = blockIdx.x * 1000 + threadIdx.x;
    __syncthreads();
    uint32_t v = slots[(threadIdx.x + 1) % blockDim.x];
    __syncthreads();  // no block may overwrite slots while this one still reads them
    out[blockIdx.x * blockDim.x + threadIdx.x] = v;
}

// A __syncthreads that thread 0 never reaches: the shim must abort, not hang.
extern "C" __global__ void qccl_selftest_bad_barrier(uint32_t* out) {
    if (threadIdx.x == 0) return;
    __syncthreads();
    out[threadIdx.x] = 1;
}

// Lanes 0 and 1 call one vote with different masks: the shim must abort, not pair them.
extern "C" __global__ void qccl_selftest_bad_mask(uint32_t* out) {
    unsigned mask = threadIdx.x == 0 ? 0x3u : 0xffffffffu;
    out[threadIdx.x] = __ballot_sync(mask, 1);
}
