/* The sparse payload's shared kernels (src/codec/sparse.rs): the ordered compaction that writes
 * a selection (see sparse.cuh), decode-add (scatter-add), the decoder's index check, and the two
 * halves of error feedback around a selection. Arguments as kernels/README.md orders them;
 * n is the chunk's element count, k its pairs, st the selection state (sparse.cuh):
 *   qccl_sparse_count(x, st, counts, n)      fibers, a warp per segment, whole warps
 *   qccl_sparse_scan(counts, n)              fibers, one block (256 threads: SPARSE_SCAN)
 *   qccl_sparse_write(x, st, counts, payload, n)   fibers, as count
 *   qccl_sparse_check(payload, bad, n, k)    sequential, any grid: *bad = 1 refuses the chunk
 *   qccl_sparse_zero(out, n)                 sequential, any grid (decode's clearing)
 *   qccl_sparse_decode / _add(payload, out, n, k)  sequential, any grid
 *   qccl_sparse_compensate(x, res, w, n)     sequential, any grid
 *   qccl_sparse_fold(x, res, n), qccl_sparse_settle(res, n)   sequential, any grid
 *   qccl_sparse_ef_sub(payload, res, k)      sequential, any grid
 *
 * Decoding needs no host round trip between check and decode: decode skips every index >= n,
 * so a payload the check refuses (the caller then fails the call) writes nothing out of bounds.
 *
 * Error feedback for a sparsifier, bit for bit the Rust EF wrapper (compensate, then
 * residual += w, then residual -= the k sent values):
 *   qccl_sparse_compensate: w = x + res, res = 0 + w (one pass; w may alias x, or be null
 *   where the selection read w before: random-k's pairs);
 *   the codec's selection and qccl_sparse_write run on w;
 *   qccl_sparse_ef_sub: res[idx] -= value for the k pairs (O(k), as the Rust decode_sub).
 * With nowhere to keep w but the residual: qccl_sparse_fold (res = x + res, i.e. w), the
 * selection and write on res, qccl_sparse_settle (res = 0 + res), then qccl_sparse_ef_sub. */
#include "sparse.cuh"

extern "C" __global__ void qccl_sparse_count(const float *x, const sp_u64 *st, sp_u64 *counts,
                                             sp_u64 n) {
    sp_count(x, n, st, counts);
}

extern "C" __global__ void qccl_sparse_scan(sp_u64 *counts, sp_u64 n) { sp_scan(n, counts); }

extern "C" __global__ void qccl_sparse_write(const float *x, const sp_u64 *st,
                                             const sp_u64 *counts, uint8_t *payload, sp_u64 n) {
    sp_write(x, n, st, counts, payload);
}

/* Sets *bad to 1 unless every index is below n and above the previous one (the Rust decoder's
 * check, run before anything is written). */
extern "C" __global__ void qccl_sparse_check(const uint8_t *payload, int *bad, sp_u64 n,
                                             sp_u64 k) {
    QCCL_GRID_STRIDE(j, k) {
        uint32_t i = sp_load_u32(payload + 4 * j);
        if (i >= n || (j > 0 && sp_load_u32(payload + 4 * (j - 1)) >= i))
            *bad = 1;
    }
}

/* out[i] = 0 for i < n: decode's clearing, where the host has no memset to enqueue. */
extern "C" __global__ void qccl_sparse_zero(float *out, sp_u64 n) {
    QCCL_GRID_STRIDE(i, n) { out[i] = 0.0f; }
}

/* out[idx] = value (decode: out cleared first, qccl_sparse_zero) or out[idx] += value
 * (decode_add). Checked indices are distinct: no two threads share an element. Indices >= n
 * are skipped, so an unchecked payload cannot write out of bounds (the check refuses it). */
template <bool ADD>
QCCL_DEVICE void sp_decode(const uint8_t *payload, float *out, sp_u64 n, sp_u64 k) {
    QCCL_GRID_STRIDE(j, k) {
        uint32_t i = sp_load_u32(payload + 4 * j);
        if (i >= n)
            continue;
        float v = qccl_f32_from(sp_load_u32(payload + 4 * k + 4 * j));
        out[i] = ADD ? qccl_add(out[i], v) : v;
    }
}

extern "C" __global__ void qccl_sparse_decode(const uint8_t *payload, float *out, sp_u64 n,
                                              sp_u64 k) {
    sp_decode<false>(payload, out, n, k);
}

extern "C" __global__ void qccl_sparse_decode_add(const uint8_t *payload, float *out, sp_u64 n,
                                                  sp_u64 k) {
    sp_decode<true>(payload, out, n, k);
}

extern "C" __global__ void qccl_sparse_compensate(const float *x, float *res, float *w,
                                                  sp_u64 n) {
    QCCL_GRID_STRIDE(i, n) {
        float v = qccl_add(x[i], res[i]);
        if (w)
            w[i] = v;
        res[i] = qccl_add(0.0f, v);
    }
}

/* res = x + res: w kept in the residual while the selection reads it. */
extern "C" __global__ void qccl_sparse_fold(const float *x, float *res, sp_u64 n) {
    QCCL_GRID_STRIDE(i, n) { res[i] = qccl_add(x[i], res[i]); }
}

/* res = 0 + res: after qccl_sparse_fold and the write, the residual compensate leaves (0 + w;
 * -0 becomes +0). */
extern "C" __global__ void qccl_sparse_settle(float *res, sp_u64 n) {
    QCCL_GRID_STRIDE(i, n) { res[i] = qccl_add(0.0f, res[i]); }
}

extern "C" __global__ void qccl_sparse_ef_sub(const uint8_t *payload, float *res, sp_u64 k) {
    QCCL_GRID_STRIDE(j, k) {
        uint32_t i = sp_load_u32(payload + 4 * j);
        res[i] = qccl_sub(res[i], qccl_f32_from(sp_load_u32(payload + 4 * k + 4 * j)));
    }
}
