/* randk: k = k_of(density, n) indices, one per stratum, as src/codec/randk.rs draws them:
 * stratum t of k covers [t*n/k, (t+1)*n/k) and keeps start + draw(K, t) % len (draw.cuh), so
 * the indices ascend by construction and every thread computes its own pair.
 *
 * Launch: qccl_randk_encode(x, payload, n, k, key), any grid, a thread per stratum (sequential
 * mode safe); nothing for k = 0. With error feedback: qccl_sparse_compensate first (x is then
 * its w), qccl_sparse_ef_sub after (sparse.cu). */
#include "sparse.cuh"
#include "draw.cuh"

extern "C" __global__ void qccl_randk_encode(const float *x, uint8_t *payload, sp_u64 n,
                                             sp_u64 k, sp_u64 key) {
    QCCL_GRID_STRIDE(t, k) {
        sp_u64 i = qccl_randk_index(key, n, k, t);
        sp_put(payload, k, t, (uint32_t)i, x[i]);
    }
}
