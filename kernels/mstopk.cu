/* mstopk: MSTopK's threshold search (Algorithm 1 of Shi et al.), selecting exactly the elements
 * src/codec/mstopk.rs selects: the k1 elements at or above thres1, then the run of k - k1
 * elements, at a random offset, of those in [thres2, thres1) in index order. The search runs as
 * printed: one count of |x| >= thres over the chunk per sampling (the Rust codec's shortcuts
 * skip only samplings whose outcome is already decided), stopping once k1 = k; the counts of
 * three samplings come from one pass over x (MSTOPK_LEVELS).
 *
 * The mean is computed exactly as the Rust codec does, since it places every threshold:
 * |x| summed in 16 f32 lanes per part of 16384 elements (element 16m + j of a part in lane j),
 * each part's lanes summed in f64, parts summed in f64 in order. An input whose mean or maximum
 * is not finite is selected by exact top-k (the radix select of sparse.cuh, switched on here).
 *
 * Launch sequence for n elements and k = k_of(density, n) > 0 (k = 0: launch nothing),
 * st = SPARSE_STATE words, part = 16 * ceil(n / 16384) floats twice, hist = 2048 u32:
 *   qccl_mstopk_partials(x, psum, pmax, n)          sequential, any grid (a thread per lane)
 *   qccl_mstopk_init(psum, pmax, st, hist, n, k)    one thread
 *   ceil(samplings / 3) times (the samplings' thresholds three levels at a time):
 *     qccl_mstopk_count(x, st, n)                   fibers (warp sums), whole warps
 *     qccl_mstopk_step(st, levels)                  one thread; levels = 3, the last time
 *                                                   what is left of the samplings
 *   for pass 0..2 (no-ops unless the input fell back to top-k):
 *     qccl_mstopk_hist(x, st, hist, n, pass)        fibers, any grid
 *     qccl_mstopk_digit(st, hist, pass)             one thread
 *   qccl_mstopk_finish(st, key)                     one thread
 *   qccl_sparse_count, qccl_sparse_scan, qccl_sparse_write (sparse.cu)
 * One-thread kernels run in sequential mode. With error feedback, x is the w of
 * qccl_sparse_compensate. */
#include "sparse.cuh"
#include "draw.cuh"

#define MSTOPK_PART 16384ull
#define MSTOPK_LANES 16ull

/* No sampling counted between 1 and k yet: thres1 selects nothing (keys are below 2^31). */
#define MSTOPK_NO_T1 0xffffffffull

QCCL_DEVICE sp_u64 mstopk_parts(sp_u64 n) { return (n + MSTOPK_PART - 1) / MSTOPK_PART; }

/* Each count pass counts the thresholds of the next MSTOPK_LEVELS samplings at once: the
 * bisection's next ratio depends only on whether a count is at most k, so those samplings'
 * thresholds are the MSTOPK_NODES nodes of a binary tree (heap order: node i's child 2i + 1
 * follows a count <= k, which sets r to its ratio; 2i + 2 the others, which set l). Each node's
 * ratio comes from its (l, r) by the same f64 steps as one sampling at a time, so the search
 * visits the same thresholds and ends the same; it reads x a third as many times. */
#define MSTOPK_LEVELS 3u
#define MSTOPK_NODES 7u

/* The ratio between l and r, and its threshold as the key of the f32 threshold. */
QCCL_DEVICE double mstopk_ratio(double l, double r) { return l + (r - l) / 2.0; }

QCCL_DEVICE sp_u64 mstopk_thres(const sp_u64 *st, double ratio) {
    double mean = qccl_f64_from(st[SP_MEAN]), span = qccl_f64_from(st[SP_SPAN]);
    return sp_key((float)(mean + ratio * span));
}

/* The tree of thresholds from the state's bounds, its counts zeroed. */
QCCL_DEVICE void mstopk_tree(sp_u64 *st) {
    double l[MSTOPK_NODES], r[MSTOPK_NODES];
    l[0] = qccl_f64_from(st[SP_L]);
    r[0] = qccl_f64_from(st[SP_R]);
    for (unsigned i = 0; i < MSTOPK_NODES; i++) {
        double m = mstopk_ratio(l[i], r[i]);
        st[SP_TREE + i] = mstopk_thres(st, m);
        st[SP_TCOUNT + i] = 0;
        if (2 * i + 2 < MSTOPK_NODES) {
            l[2 * i + 1] = l[i];
            r[2 * i + 1] = m;
            l[2 * i + 2] = m;
            r[2 * i + 2] = r[i];
        }
    }
}

extern "C" __global__ void qccl_mstopk_partials(const float *x, float *psum, float *pmax,
                                                sp_u64 n) {
    QCCL_GRID_STRIDE(t, mstopk_parts(n) * MSTOPK_LANES) {
        sp_u64 p = t / MSTOPK_LANES, j = t % MSTOPK_LANES;
        sp_u64 end = (p + 1) * MSTOPK_PART < n ? (p + 1) * MSTOPK_PART : n;
        float s = 0.0f, m = 0.0f;
        for (sp_u64 i = p * MSTOPK_PART + j; i < end; i += MSTOPK_LANES) {
            float a = qccl_f32_from(qccl_f32_bits(x[i]) & 0x7fffffffu);
            s += a;
            m = a > m ? a : m;
        }
        psum[t] = s;
        pmax[t] = m;
    }
}

extern "C" __global__ void qccl_mstopk_init(const float *psum, const float *pmax, sp_u64 *st,
                                            unsigned *hist, sp_u64 n, sp_u64 k) {
    if (qccl_tid() != 0)
        return;
    double total = 0.0;
    float umax = 0.0f;
    for (sp_u64 p = 0; p < mstopk_parts(n); p++) {
        double s = 0.0;
        for (sp_u64 j = 0; j < MSTOPK_LANES; j++) {
            s += (double)psum[p * MSTOPK_LANES + j];
            float m = pmax[p * MSTOPK_LANES + j];
            umax = m > umax ? m : umax;
        }
        total += s;
    }
    double mean = total / (double)(n > 0 ? n : 1);
    double u = (double)umax;
    int finite = (qccl_f64_bits(mean) & 0x7ff0000000000000ull) != 0x7ff0000000000000ull &&
                 (qccl_f32_bits(umax) & 0x7f800000u) != 0x7f800000u;
    sp_radix_init(st, k, !finite && k < n, hist);
    st[SP_DONE] = 0;
    if (k >= n) {
        /* Everything: no search, no draw. */
        st[SP_TA] = 0;
        st[SP_TB] = 0;
        st[SP_WLO] = 0;
        st[SP_WHI] = 0;
        st[SP_DONE] = 2;
        return;
    }
    if (!finite) {
        st[SP_DONE] = 2;
        return;
    }
    mean = mean < u ? mean : u;
    st[SP_MEAN] = qccl_f64_bits(mean);
    st[SP_SPAN] = qccl_f64_bits(u - mean);
    st[SP_L] = qccl_f64_bits(0.0);
    st[SP_R] = qccl_f64_bits(1.0);
    st[SP_K1] = 0;
    st[SP_T1] = MSTOPK_NO_T1;
    st[SP_K2] = n;
    st[SP_T2] = 0;
    mstopk_tree(st);
}

/* FIBER mode (warp shuffles): counts |x| >= each node's threshold; each warp sums its
 * threads' counts, and its lane 0 adds the sums to the state's counters: one atomic per warp
 * and node. Launch with whole warps (blockDim a multiple of 32). */
extern "C" __global__ void qccl_mstopk_count(const float *x, sp_u64 *st, sp_u64 n) {
    if (st[SP_DONE])
        return; /* uniform over the grid */
    sp_u64 t[MSTOPK_NODES];
    unsigned c[MSTOPK_NODES];
    for (unsigned j = 0; j < MSTOPK_NODES; j++) {
        t[j] = st[SP_TREE + j];
        c[j] = 0;
    }
    QCCL_GRID_STRIDE(i, n) {
        sp_u64 key = sp_key(x[i]);
        for (unsigned j = 0; j < MSTOPK_NODES; j++)
            c[j] += key >= t[j];
    }
    for (unsigned j = 0; j < MSTOPK_NODES; j++) {
        sp_u64 w = c[j];
        for (int d = 16; d > 0; d >>= 1)
            w += __shfl_xor_sync(0xffffffffu, w, d);
        if ((threadIdx.x & 31) == 0 && w)
            atomicAdd(&st[SP_TCOUNT + j], w);
    }
}

/* Lines 11-23 of Algorithm 1 for the next `levels` samplings (at most MSTOPK_LEVELS), down
 * the tree the counts just made, then the next tree. */
extern "C" __global__ void qccl_mstopk_step(sp_u64 *st, unsigned levels) {
    if (qccl_tid() != 0 || st[SP_DONE])
        return;
    sp_u64 k = st[SP_K];
    unsigned node = 0;
    for (unsigned lv = 0; lv < levels && lv < MSTOPK_LEVELS; lv++) {
        sp_u64 nnz = st[SP_TCOUNT + node], thres = st[SP_TREE + node];
        double ratio = mstopk_ratio(qccl_f64_from(st[SP_L]), qccl_f64_from(st[SP_R]));
        if (nnz <= k) {
            st[SP_R] = qccl_f64_bits(ratio);
            if (nnz > st[SP_K1]) {
                st[SP_K1] = nnz;
                st[SP_T1] = thres;
            }
            node = 2 * node + 1;
        } else {
            st[SP_L] = qccl_f64_bits(ratio);
            if (nnz < st[SP_K2]) {
                st[SP_K2] = nnz;
                st[SP_T2] = thres;
            }
            node = 2 * node + 2;
        }
        if (st[SP_K1] == k) {
            st[SP_DONE] = 1; /* the selection can no longer change */
            return;
        }
    }
    mstopk_tree(st);
}

extern "C" __global__ void qccl_mstopk_hist(const float *x, const sp_u64 *st, unsigned *hist,
                                            sp_u64 n, int pass) {
    sp_radix_hist(x, n, pass, st, hist);
}

extern "C" __global__ void qccl_mstopk_digit(sp_u64 *st, unsigned *hist, int pass) {
    sp_radix_digit(pass, st, hist);
}

/* Lines 25-28: all of [thres1, inf), then k - k1 of [thres2, thres1) from a random offset,
 * drawn as the Rust codec draws it: draw(key, 0) % (k2 - k1 - (k - k1) + 1). */
extern "C" __global__ void qccl_mstopk_finish(sp_u64 *st, sp_u64 key) {
    if (qccl_tid() != 0 || st[SP_DONE] == 2)
        return;
    sp_u64 k = st[SP_K], k1 = st[SP_K1], need = k - k1;
    sp_u64 start = need > 0 ? qccl_draw(key, 0) % (st[SP_K2] - k1 - need + 1) : 0;
    st[SP_TA] = st[SP_T1];
    st[SP_TB] = st[SP_T2];
    st[SP_WLO] = start;
    st[SP_WHI] = start + need;
}
