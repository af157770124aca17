/* Grouped and non-blocking all-reduces take the hierarchical algorithm on a multi-host comm,
 * like blocking ones: 4 forked ranks on 2 emulated hosts (QCCL_HOSTID), QCCL_ALGO unset
 * (auto picks the hierarchical algorithm for 2 hosts of 2 ranks). QCCL_DEBUG=TRACE with
 * QCCL_DEBUG_SUBSYS=COLL logs the route of every all-reduce; ffi/tests/c_abi.rs checks that
 * the calls of counts 1001 (grouped), 1003 (non-blocking) and 1002 (blocking) were
 * "hierarchical" on every rank. Results are checked against a float64 reference, and every
 * rank's results must be bit-identical. */
#include "common.h"

#define NR 4

static double value(int rank, size_t i) {
    return 0.001 * (double)((i * 7 + (size_t)rank * 13) % 101) - 0.05 * rank + 1e-4 * (double)i;
}

/* Checks a float32 sum (or avg) against the float64 reduction of the (float-rounded) inputs. */
static void check_f32(const char* what, const float* y, size_t n, int avg) {
    for (size_t i = 0; i < n; i++) {
        double want = 0;
        for (int r = 0; r < NR; r++) want += (float)value(r, i);
        if (avg) want /= NR;
        if (fabs(y[i] - want) > 1e-5 * (fabs(want) + 1))
            FAIL("%s: [%zu] = %.9g, float64 reference %.9g", what, i, y[i], want);
    }
}

/* Every rank must hold the same bits: gather them all and compare with rank 0's. */
static void check_identical(const char* what, const void* buf, size_t bytes, qcclComm_t comm) {
    unsigned char* all = (unsigned char*)xmalloc(bytes * NR);
    CHECK(qcclAllGather(buf, all, bytes, qcclUint8, comm, NULL));
    for (int r = 1; r < NR; r++)
        if (memcmp(all, all + (size_t)r * bytes, bytes) != 0)
            FAIL("%s: rank %d's result differs from rank 0's", what, r);
    free(all);
}

static int body(int rank, int nranks, qcclUniqueId id) {
    (void)nranks;
    setenv("QCCL_HOSTID", rank < 2 ? "host-a" : "host-b", 1);
    qcclComm_t comm;
    CHECK(qcclCommInitRank(&comm, NR, id, rank));

    /* Grouped, as the comm's first all-reduce: out of place float32 sum and an in-place
     * float64 avg in one group. */
    enum { NG = 1001, NA = 1003, NB = 1002, ND = 5 };
    float* xs = (float*)xmalloc(NG * sizeof(float));
    float* ys = (float*)xmalloc(NG * sizeof(float));
    for (size_t i = 0; i < NG; i++) xs[i] = (float)value(rank, i);
    poison(ys, NG * sizeof(float));
    double d[ND];
    for (int i = 0; i < ND; i++) d[i] = rank + 0.25 * i;
    CHECK(qcclGroupStart());
    CHECK(qcclAllReduce(xs, ys, NG, qcclFloat32, qcclSum, comm, NULL));
    CHECK(qcclAllReduce(d, d, ND, qcclFloat64, qcclAvg, comm, NULL));
    CHECK(qcclGroupEnd());
    check_f32("grouped", ys, NG, 0);
    check_identical("grouped", ys, NG * sizeof(float), comm);
    for (int i = 0; i < ND; i++)
        if (fabs(d[i] - (1.5 + 0.25 * i)) > 1e-12) FAIL("grouped avg: [%d] = %g", i, d[i]);

    /* Non-blocking, in place. */
    float* za = (float*)xmalloc(NA * sizeof(float));
    for (size_t i = 0; i < NA; i++) za[i] = (float)value(rank, i);
    qcclRequest_t req;
    CHECK(qcclIAllReduce(za, za, NA, qcclFloat32, qcclSum, comm, &req));
    CHECK(qcclWait(req));
    check_f32("non-blocking", za, NA, 0);
    check_identical("non-blocking", za, NA * sizeof(float), comm);

    /* Blocking, avg, for comparison. */
    float* zb = (float*)xmalloc(NB * sizeof(float));
    for (size_t i = 0; i < NB; i++) zb[i] = (float)value(rank, i);
    CHECK(qcclAllReduce(zb, zb, NB, qcclFloat32, qcclAvg, comm, NULL));
    check_f32("blocking", zb, NB, 1);
    check_identical("blocking", zb, NB * sizeof(float), comm);

    free(xs);
    free(ys);
    free(za);
    free(zb);
    CHECK(qcclCommDestroy(comm));
    return 0;
}

int main(void) {
    setenv("QCCL_DEBUG", "TRACE", 1);
    setenv("QCCL_DEBUG_SUBSYS", "COLL", 1);
    unsetenv("QCCL_ALGO");
    unsetenv("QCCL_COMPRESSION");
    int failed = run_ranks(NR, body);
    printf("grouped and non-blocking hierarchical all-reduce on %d processes (2 hosts): %s\n", NR,
           failed ? "FAILED" : "ok");
    return failed;
}
