/* The sparse payload's shared kernels (src/codec/sparse.rs): the ordered compaction that writes
 * a selection (see sparse.cuh), decode-add (scatter-add), the decoder's index check, and the two
 * halves of error feedback around a selection. The compaction kernels are FIBER mode (warps:
 * blockDim a multiple of 32; qccl_sparse_scan exactly one block of SPARSE_SCAN threads); the
 * others sequential-mode safe, any grid.
 *
 * Error feedback for a sparsifier, bit for bit the Rust EF wrapper (compensate, then
 * residual += w, then residual -= the k sent values):
 *   qccl_sparse_compensate: w = x + res, res = 0 + w (one pass; w may alias x);
 *   the codec's selection and qccl_sparse_write run on w;
 *   qccl_sparse_ef_sub: res[idx] -= value for the k pairs (O(k), as the Rust decode_sub). */
#include "sparse.cuh"

extern "C" __global__ void qccl_sparse_count(const float *x, sp_u64 n, const sp_u64 *st,
                                             sp_u64 *counts) {
    sp_count(x, n, st, counts);
}

extern "C" __global__ void qccl_sparse_scan(sp_u64 n, sp_u64 *counts) { sp_scan(n, counts); }

extern "C" __global__ void qccl_sparse_write(const float *x, sp_u64 n, const sp_u64 *st,
                                             const sp_u64 *counts, unsigned char *payload) {
    sp_write(x, n, st, counts, payload);
}

/* Sets *bad to 1 unless every index is below n and above the previous one (the Rust decoder's
 * check, run before anything is written). */
extern "C" __global__ void qccl_sparse_check(const unsigned char *payload, sp_u64 k, sp_u64 n,
                                             int *bad) {
    QCCL_GRID_STRIDE(j, k) {
        uint32_t i = sp_load_u32(payload + 4 * j);
        if (i >= n || (j > 0 && sp_load_u32(payload + 4 * (j - 1)) >= i))
            *bad = 1;
    }
}

/* out[idx] += value (add != 0) or out[idx] = value; with add == 0 the host zeroes out first.
 * Checked indices are distinct, so no two threads touch one element. */
extern "C" __global__ void qccl_sparse_decode(const unsigned char *payload, sp_u64 k,
                                              float *out, int add) {
    QCCL_GRID_STRIDE(j, k) {
        uint32_t i = sp_load_u32(payload + 4 * j);
        float v = qccl_f32_from(sp_load_u32(payload + 4 * k + 4 * j));
        out[i] = add ? out[i] + v : v;
    }
}

extern "C" __global__ void qccl_sparse_compensate(const float *x, float *res, float *w,
                                                  sp_u64 n) {
    QCCL_GRID_STRIDE(i, n) {
        float v = x[i] + res[i];
        w[i] = v;
        res[i] = 0.0f + v;
    }
}

extern "C" __global__ void qccl_sparse_ef_sub(const unsigned char *payload, sp_u64 k,
                                              float *res) {
    QCCL_GRID_STRIDE(j, k) {
        uint32_t i = sp_load_u32(payload + 4 * j);
        res[i] -= qccl_f32_from(sp_load_u32(payload + 4 * k + 4 * j));
    }
}
