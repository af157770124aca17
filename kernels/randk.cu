/* randk: k = k_of(density, n) indices, one per stratum, as src/codec/randk.rs draws them:
 * stratum t of k covers [t*n/k, (t+1)*n/k) and keeps start + draw(K, t) % len (draw.cuh), so
 * the indices ascend by construction and every thread computes its own pair.
 *
 * Entries (sequential mode, any grid; k = 0 happens only for n = 0):
 *   qccl_randk_encode(x, payload, n, k, key): a thread per stratum;
 *   qccl_randk_encode_ef(x, res, payload, n, k, key): a thread per stratum, the pair of
 *     w = x + res (before either changes); then, for error feedback as the Rust EF wrapper's
 *     bits, sparse.cu's qccl_sparse_compensate(x, res, w_out, n) (res = 0 + w; w_out may be
 *     null or alias x) and qccl_sparse_ef_sub(payload, res, k) (res -= w where sent). The
 *     element pass needs no stratum arithmetic: finding an element's stratum and its kept
 *     index is four 64-bit divisions, more than the rest of an element's work on a GPU. */
#include "sparse.cuh"
#include "draw.cuh"

extern "C" __global__ void qccl_randk_encode(const float *x, uint8_t *payload, sp_u64 n,
                                             sp_u64 k, sp_u64 key) {
    QCCL_GRID_STRIDE(t, k) {
        sp_u64 i = qccl_randk_index(key, n, k, t);
        sp_put(payload, k, t, (uint32_t)i, x[i]);
    }
}

extern "C" __global__ void qccl_randk_encode_ef(const float *x, const float *res,
                                                uint8_t *payload, sp_u64 n, sp_u64 k,
                                                sp_u64 key) {
    QCCL_GRID_STRIDE(t, k) {
        sp_u64 i = qccl_randk_index(key, n, k, t);
        sp_put(payload, k, t, (uint32_t)i, qccl_add(x[i], res[i]));
    }
}
