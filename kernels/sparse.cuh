/* Shared by the sparsifying kernels (topk.cu, mstopk.cu, randk.cu, sparse.cu): the magnitude
 * key, the selection state kept in device memory between launches, and the ordered compaction
 * that writes the payload of src/codec/sparse.rs:
 *
 *     k x u32 index (little endian, strictly increasing) | k x f32 value (little endian)
 *
 * A selection is described by two key thresholds and a window: every element with key >= TA
 * (class A) is kept, and of the elements with TB <= key < TA (class B), in index order, those of
 * rank WLO <= rank < WHI. topk: A = key > t, B = key == t, window [0, ties wanted). mstopk:
 * A = key >= thres1, B = thres2 <= key < thres1, window [offset, offset + k - k1).
 *
 * The compaction is three launches over segments of SPARSE_SEG elements, a warp per segment:
 * qccl_sparse_count (per-segment class counts), qccl_sparse_scan (one block of SPARSE_SCAN
 * threads: exclusive prefix sums), qccl_sparse_write (each segment writes its pairs at their
 * final positions). The payload pointer needs no alignment (bytewise stores).
 *
 * Chunks hold fewer than 2^32 elements (the radix histogram counts in u32; the Rust codec's
 * limit, sparse::MAX_ELEMS, is 2^32 itself: a GPU host refuses that one size as unsupported).
 *
 * The compaction and the radix histogram (a block's threads share it in __shared__ memory) run
 * in the shim's FIBER mode; the rest in sequential mode. */
#pragma once
#include "common.cuh"

/* Elements per compaction segment. */
#define SPARSE_SEG 4096ull

/* The selection state, an array of unsigned long long in device memory (SPARSE_STATE words,
 * zeroed by nobody: the init kernels write every word they later read). */
enum {
    SP_TA = 0,     /* class A: key >= TA */
    SP_TB = 1,     /* class B: TB <= key < TA */
    SP_WLO = 2,    /* window of B ranks kept: [WLO, WHI) */
    SP_WHI = 3,
    SP_K = 4,      /* pairs to write */
    SP_RADIX = 5,  /* 1: the radix select (topk) runs; 0: its launches do nothing */
    SP_PREFIX = 6, /* radix select: key bits fixed so far */
    SP_WANT = 7,   /* radix select: elements still to take at or below the prefix */
    SP_MEAN = 8,   /* mstopk: f64 bits of the mean magnitude */
    SP_SPAN = 9,   /* mstopk: f64 bits of max - mean */
    SP_L = 10,     /* mstopk: f64 bits of the bisection bounds */
    SP_R = 11,
    SP_K1 = 12,
    SP_T1 = 13,
    SP_K2 = 14,
    SP_T2 = 15,
    SP_DONE = 16,  /* mstopk: 1 once the search is over (or the input falls back to topk) */
    SP_TREE = 17,  /* mstopk: keys of the next samplings' thresholds (MSTOPK_NODES, heap order) */
    SP_TCOUNT = 24, /* mstopk: their counts, which the counting launches add to (atomics) */
    SPARSE_STATE = 31
};

typedef unsigned long long sp_u64;

/* The magnitude key of src/codec/sparse.rs: the bits without the sign (NaN above infinity). */
QCCL_DEVICE uint32_t sp_key(float v) { return qccl_f32_bits(v) & 0x7fffffffu; }

QCCL_DEVICE void sp_store_u32(uint8_t *p, uint32_t u) {
    p[0] = (uint8_t)u;
    p[1] = (uint8_t)(u >> 8);
    p[2] = (uint8_t)(u >> 16);
    p[3] = (uint8_t)(u >> 24);
}

QCCL_DEVICE uint32_t sp_load_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Writes pair `pos` of a k-pair payload. */
QCCL_DEVICE void sp_put(uint8_t *payload, sp_u64 k, sp_u64 pos, uint32_t idx,
                        float v) {
    sp_store_u32(payload + 4 * pos, idx);
    sp_store_u32(payload + 4 * k + 4 * pos, qccl_f32_bits(v));
}

/* ---- radix select of the k-th largest key (topk, and mstopk's non-finite fallback) ---------
 * SP_RADIX_PASSES passes over the 31-bit key from the top, digits of 11, 10 and 10 bits: hist
 * counts the digit of every key whose higher bits match the prefix; digit walks the bins down,
 * taking whole bins while they hold fewer than the elements still wanted. After the last pass
 * the prefix is the k-th largest key t and WANT the number of elements equal to t to keep (the
 * first ones in index order: topk's tie rule). Three passes read x three times, not four as
 * 8-bit digits would; the wider first digit (exponent and 3 mantissa bits) also spreads a
 * gradient's keys over more bins, so fewer threads add to the same shared counter. */
#define SP_RADIX_PASSES 3
#define SP_RADIX_BINS 2048u

/* The digit of pass p: bits [shift, shift + width) of the key. */
QCCL_DEVICE unsigned sp_radix_shift(int pass) { return pass == 0 ? 20u : (pass == 1 ? 10u : 0u); }
QCCL_DEVICE unsigned sp_radix_width(int pass) { return pass == 0 ? 11u : 10u; }

QCCL_DEVICE void sp_radix_init(sp_u64 *st, sp_u64 k, int on, unsigned *hist) {
    st[SP_RADIX] = on;
    st[SP_PREFIX] = 0;
    st[SP_WANT] = k;
    st[SP_K] = k;
    for (unsigned b = 0; b < SP_RADIX_BINS; b++)
        hist[b] = 0;
}

/* FIBER mode (__syncthreads): each block counts into a shared histogram, then adds its
 * non-zero bins to the global one, so the global atomics are a few per block rather than
 * one per element (the top digits of float keys crowd into a few bins). */
QCCL_DEVICE void sp_radix_hist(const float *x, sp_u64 n, int pass, const sp_u64 *st,
                               unsigned *hist) {
    __shared__ unsigned local[SP_RADIX_BINS];
    if (!st[SP_RADIX])
        return; /* uniform over the grid: no thread reaches a barrier */
    for (unsigned b = threadIdx.x; b < SP_RADIX_BINS; b += blockDim.x)
        local[b] = 0;
    __syncthreads();
    unsigned shift = sp_radix_shift(pass), top = shift + sp_radix_width(pass);
    unsigned mask = (1u << sp_radix_width(pass)) - 1u;
    sp_u64 prefix = st[SP_PREFIX];
    QCCL_GRID_STRIDE(i, n) {
        sp_u64 key = sp_key(x[i]);
        if ((key >> top) == (prefix >> top))
            atomicAdd(&local[(key >> shift) & mask], 1u);
    }
    __syncthreads();
    for (unsigned b = threadIdx.x; b < SP_RADIX_BINS; b += blockDim.x)
        if (local[b])
            atomicAdd(&hist[b], local[b]);
}

QCCL_DEVICE void sp_radix_digit(int pass, sp_u64 *st, unsigned *hist) {
    if (!st[SP_RADIX] || qccl_tid() != 0)
        return;
    sp_u64 want = st[SP_WANT];
    int b = (1 << sp_radix_width(pass)) - 1;
    for (; b > 0; b--) {
        if (hist[b] >= want)
            break;
        want -= hist[b];
    }
    for (unsigned j = 0; j < SP_RADIX_BINS; j++)
        hist[j] = 0;
    st[SP_PREFIX] |= (sp_u64)b << sp_radix_shift(pass);
    st[SP_WANT] = want;
    if (pass == SP_RADIX_PASSES - 1) {
        sp_u64 t = st[SP_PREFIX];
        st[SP_TA] = t + 1;
        st[SP_TB] = t;
        st[SP_WLO] = 0;
        st[SP_WHI] = want;
    }
}

/* ---- the compaction ---------------------------------------------------------------------
 * A warp per segment of SPARSE_SEG elements, lane j owning the run of SPARSE_RUN elements at
 * j * SPARSE_RUN: lanes count their runs alone and meet only to combine counts (shuffles) and
 * to load their runs through shared memory (sp_tile), so a segment costs a few dozen warp
 * exchanges whatever its contents. The three kernels are FIBER mode and need whole warps
 * (blockDim a multiple of 32, at most 32 * SPARSE_TILE_WARPS). */

#define SPARSE_RUN 128ull

QCCL_DEVICE sp_u64 sp_segments(sp_u64 n) { return (n + SPARSE_SEG - 1) / SPARSE_SEG; }

/* This thread's warp in the grid, and the grid's warp count. */
QCCL_DEVICE sp_u64 sp_warp() { return qccl_tid() / 32; }
QCCL_DEVICE sp_u64 sp_warps() { return qccl_nthreads() / 32; }

/* This lane's run of segment s: [*lo, *hi). */
QCCL_DEVICE void sp_run(sp_u64 s, sp_u64 n, sp_u64 *lo, sp_u64 *hi) {
    sp_u64 a = s * SPARSE_SEG + (threadIdx.x & 31) * SPARSE_RUN, b = a + SPARSE_RUN;
    *lo = a < n ? a : n;
    *hi = b < n ? b : n;
}

/* Lanes read their runs through shared memory, a tile of 32 elements of every run at a
 * time: the warp loads each run's 32 with one coalesced load (element per lane), then each
 * lane reads its own run's from shared memory. Read straight from x, the lanes' loads would
 * sit SPARSE_RUN elements apart, 32 cache lines per load. A warp's tile is 32 x 33 floats (the
 * pad keeps a lane's reads off its neighbours' banks): blocks of at most SPARSE_TILE_WARPS
 * warps. */
#define SPARSE_TILE_WARPS 8u

/* Tile t of segment s: this lane's run's elements at t * 32 .. t * 32 + 32 of the run (zero
 * past n; the caller stops at its run's end). Every lane of the warp calls it in step. */
QCCL_DEVICE const float *sp_tile(float (*tiles)[32][33], const float *x, sp_u64 s, sp_u64 n,
                                 unsigned t) {
    unsigned lane = threadIdx.x & 31u;
    float (*tile)[33] = tiles[(threadIdx.x / 32u) % SPARSE_TILE_WARPS];
    __syncwarp(0xffffffffu); /* the previous tile is read */
    for (unsigned r = 0; r < 32; r++) {
        sp_u64 i = s * SPARSE_SEG + r * SPARSE_RUN + t * 32 + lane;
        tile[r][lane] = i < n ? x[i] : 0.0f;
    }
    __syncwarp(0xffffffffu);
    return tile[lane];
}

/* Class A and class B elements of this lane's run [lo, hi) of segment s. */
QCCL_DEVICE void sp_run_counts(float (*tiles)[32][33], const float *x, sp_u64 s, sp_u64 n,
                               sp_u64 lo, sp_u64 hi, sp_u64 ta, sp_u64 tb, sp_u64 *a,
                               sp_u64 *b) {
    sp_u64 ca = 0, cb = 0;
    for (unsigned t = 0; t < SPARSE_RUN / 32; t++) {
        const float *v = sp_tile(tiles, x, s, n, t);
        for (unsigned c = 0; c < 32 && lo + t * 32 + c < hi; c++) {
            sp_u64 key = sp_key(v[c]);
            ca += key >= ta;
            cb += key >= tb && key < ta;
        }
    }
    *a = ca;
    *b = cb;
}

/* counts[2s], counts[2s+1]: class A and class B elements of segment s. */
QCCL_DEVICE void sp_count(const float *x, sp_u64 n, const sp_u64 *st, sp_u64 *counts) {
    __shared__ float tiles[SPARSE_TILE_WARPS][32][33];
    sp_u64 ta = st[SP_TA], tb = st[SP_TB];
    for (sp_u64 s = sp_warp(); s < sp_segments(n); s += sp_warps()) {
        sp_u64 lo, hi, a, b;
        sp_run(s, n, &lo, &hi);
        sp_run_counts(tiles, x, s, n, lo, hi, ta, tb, &a, &b);
        for (int d = 16; d > 0; d >>= 1) {
            a += __shfl_xor_sync(0xffffffffu, a, d);
            b += __shfl_xor_sync(0xffffffffu, b, d);
        }
        if ((threadIdx.x & 31) == 0) {
            counts[2 * s] = a;
            counts[2 * s + 1] = b;
        }
    }
}

/* Exclusive prefix sums of the counts, in place: one block (blocks after the first return),
 * its first P = min(blockDim, SPARSE_SCAN) threads each summing a contiguous run of segments,
 * then a scan of the runs' sums in shared memory. Any block size works; 256 is the intent. */
#define SPARSE_SCAN 256
QCCL_DEVICE void sp_scan(sp_u64 n, sp_u64 *counts) {
    __shared__ sp_u64 sa[SPARSE_SCAN], sb[SPARSE_SCAN];
    if (blockIdx.x != 0)
        return; /* uniform over the block */
    unsigned t = threadIdx.x, p = blockDim.x < SPARSE_SCAN ? blockDim.x : SPARSE_SCAN;
    int active = t < p;
    sp_u64 nseg = sp_segments(n), per = (nseg + p - 1) / p;
    sp_u64 lo = 0, hi = 0, a = 0, b = 0;
    if (active) {
        lo = t * per < nseg ? t * per : nseg;
        hi = lo + per < nseg ? lo + per : nseg;
        for (sp_u64 s = lo; s < hi; s++) {
            a += counts[2 * s];
            b += counts[2 * s + 1];
        }
        sa[t] = a;
        sb[t] = b;
    }
    __syncthreads();
    /* Inclusive Hillis-Steele scan of the run sums. */
    for (unsigned d = 1; d < p; d <<= 1) {
        sp_u64 pa = 0, pb = 0;
        if (active && t >= d) {
            pa = sa[t - d];
            pb = sb[t - d];
        }
        __syncthreads();
        if (active) {
            sa[t] += pa;
            sb[t] += pb;
        }
        __syncthreads();
    }
    if (!active)
        return;
    a = sa[t] - a;
    b = sb[t] - b;
    for (sp_u64 s = lo; s < hi; s++) {
        sp_u64 ca = counts[2 * s], cb = counts[2 * s + 1];
        counts[2 * s] = a;
        counts[2 * s + 1] = b;
        a += ca;
        b += cb;
    }
}

/* Each segment writes its kept pairs: an element's position is the A elements before it plus
 * the B elements before it that fall in the window. A lane's totals before its run are the
 * segment's (from the scan) plus the earlier lanes' (a shuffle scan). */
QCCL_DEVICE void sp_write(const float *x, sp_u64 n, const sp_u64 *st, const sp_u64 *counts,
                          uint8_t *payload) {
    __shared__ float tiles[SPARSE_TILE_WARPS][32][33];
    sp_u64 ta = st[SP_TA], tb = st[SP_TB], wlo = st[SP_WLO], whi = st[SP_WHI], k = st[SP_K];
    unsigned lane = threadIdx.x & 31;
    for (sp_u64 s = sp_warp(); s < sp_segments(n); s += sp_warps()) {
        sp_u64 lo, hi, ca, cb;
        sp_run(s, n, &lo, &hi);
        sp_run_counts(tiles, x, s, n, lo, hi, ta, tb, &ca, &cb);
        sp_u64 a = ca, b = cb; /* inclusive scans over the lanes */
        for (unsigned d = 1; d < 32; d <<= 1) {
            sp_u64 pa = __shfl_up_sync(0xffffffffu, a, d), pb = __shfl_up_sync(0xffffffffu, b, d);
            if (lane >= d) {
                a += pa;
                b += pb;
            }
        }
        a = counts[2 * s] + a - ca;
        b = counts[2 * s + 1] + b - cb;
        for (unsigned t = 0; t < SPARSE_RUN / 32; t++) {
            const float *v = sp_tile(tiles, x, s, n, t);
            for (unsigned c = 0; c < 32 && lo + t * 32 + c < hi; c++) {
                sp_u64 i = lo + t * 32 + c, key = sp_key(v[c]);
                if (key >= ta) {
                    sp_u64 inb = b < wlo ? 0 : (b < whi ? b - wlo : whi - wlo);
                    sp_put(payload, k, a + inb, (uint32_t)i, v[c]);
                    a++;
                } else if (key >= tb) {
                    if (b >= wlo && b < whi)
                        sp_put(payload, k, a + (b - wlo), (uint32_t)i, v[c]);
                    b++;
                }
            }
        }
    }
}
