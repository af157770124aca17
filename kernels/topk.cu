/* topk: the k elements of largest magnitude, exactly those of src/codec/topk.rs (ties at the
 * k-th magnitude go to the lower indices; NaN above every number). The k-th largest key t comes
 * from a three-pass radix select (sparse.cuh); the payload is then everything above t plus the
 * first ties, written by the shared compaction.
 *
 * Launch sequence for n elements, k = k_of(density, n) > 0 (k = 0: the payload is empty, launch
 * nothing), st = SPARSE_STATE words, hist = 2048 u32 (SP_RADIX_BINS), counts = 2 * ceil(n / 4096) u64:
 *   qccl_topk_init(st, hist, k)                     one thread
 *   for pass 0..2 (SP_RADIX_PASSES):
 *     qccl_topk_hist(x, st, hist, n, pass)          fibers (a __shared__ histogram), any grid
 *     qccl_topk_digit(st, hist, pass)               one thread
 *   qccl_sparse_count, qccl_sparse_scan, qccl_sparse_write (sparse.cu)
 * One-thread kernels run in sequential mode. With error feedback, x is the w of qccl_sparse_compensate. */
#include "sparse.cuh"

extern "C" __global__ void qccl_topk_init(sp_u64 *st, unsigned *hist, sp_u64 k) {
    if (qccl_tid() == 0)
        sp_radix_init(st, k, 1, hist);
}

extern "C" __global__ void qccl_topk_hist(const float *x, const sp_u64 *st, unsigned *hist,
                                          sp_u64 n, int pass) {
    sp_radix_hist(x, n, pass, st, hist);
}

extern "C" __global__ void qccl_topk_digit(sp_u64 *st, unsigned *hist, int pass) {
    sp_radix_digit(pass, st, hist);
}
