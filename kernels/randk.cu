/* randk: k = k_of(density, n) indices, one per stratum, as src/codec/randk.rs draws them:
 * stratum t of k covers [t*n/k, (t+1)*n/k) and keeps start + draw(K, t) % len (draw.cuh), so
 * the indices ascend by construction and every thread computes its own pair.
 *
 * Entries (sequential mode, any grid; k = 0 happens only for n = 0):
 *   qccl_randk_encode(x, payload, n, k, key): a thread per stratum;
 *   qccl_randk_encode_ef(x, res, w_out, payload, n, k, key): error feedback in one pass, a
 *     thread per element: w = x + res; res = 0 + w, minus w where the element is sent (the
 *     Rust EF wrapper's bits); the thread of a stratum's kept element writes its pair. w_out
 *     may alias x, or be null. */
#include "sparse.cuh"
#include "draw.cuh"

extern "C" __global__ void qccl_randk_encode(const float *x, uint8_t *payload, sp_u64 n,
                                             sp_u64 k, sp_u64 key) {
    QCCL_GRID_STRIDE(t, k) {
        sp_u64 i = qccl_randk_index(key, n, k, t);
        sp_put(payload, k, t, (uint32_t)i, x[i]);
    }
}

/* The stratum holding element i (k < n): the largest t with t*n/k <= i, i.e.
 * t*n < (i+1)*k. Products stay below n*k < 2^64 for n <= 2^32. */
QCCL_DEVICE sp_u64 randk_stratum(sp_u64 n, sp_u64 k, sp_u64 i) {
    return k == n ? i : ((i + 1) * k - 1) / n;
}

extern "C" __global__ void qccl_randk_encode_ef(const float *x, float *res, float *w_out,
                                                uint8_t *payload, sp_u64 n, sp_u64 k,
                                                sp_u64 key) {
    QCCL_GRID_STRIDE(i, n) {
        float w = x[i] + res[i];
        float e = 0.0f + w;
        sp_u64 t = k ? randk_stratum(n, k, i) : 0;
        if (k && qccl_randk_index(key, n, k, t) == i) {
            sp_put(payload, k, t, (uint32_t)i, w);
            e = e - w;
        }
        res[i] = e;
        if (w_out)
            w_out[i] = w;
    }
}
