/* Buffer registration through the C ABI (qcclCommRegister / qcclCommDeregister, NCCL's
 * ncclCommRegister): forked ranks register buffers, check the handle rules (the same pages
 * give the same handle, counted; one deregistration too many is qcclInvalidArgument), the
 * argument errors (each named by qcclGetLastError), and that collectives on registered
 * buffers stay correct: reused with new data every step, in and out of place, and after a
 * buffer was deregistered, freed and a new one registered (possibly at the same address).
 *
 * usage: register NRANKS [ib]   (ib: the RDMA link over the emulated fabric between ranks) */
#include "common.h"

#define PAGE 4096
#define STEPS 3

static double value(int rank, int step, size_t i) {
    return (double)((i * 7 + (size_t)rank * 5 + (size_t)step * 3) % 61) - 30.0;
}

static void* page_alloc(size_t bytes) {
    void* p = NULL;
    if (posix_memalign(&p, PAGE, bytes ? bytes : 1) != 0) FAIL("posix_memalign(%zu)", bytes);
    return p;
}

/* Argument errors and the handle rules; the comm stays usable afterwards. */
static void handle_rules(qcclComm_t comm) {
    char* a = (char*)page_alloc(2 * PAGE);
    char* b = (char*)page_alloc(PAGE);
    void *h1 = NULL, *h2 = NULL, *h3 = NULL, *hb = NULL;

    CHECK(qcclCommRegister(comm, a, 100, &h1));
    if (h1 == NULL) FAIL("qcclCommRegister set a NULL handle");
    /* The same buffer again, and other bytes of the same page: the same handle, counted. */
    CHECK(qcclCommRegister(comm, a, 100, &h2));
    CHECK(qcclCommRegister(comm, a + 8, 200, &h3));
    if (h2 != h1 || h3 != h1) FAIL("same pages, handles %p %p %p", h1, h2, h3);
    /* Other pages: another handle. */
    CHECK(qcclCommRegister(comm, b, PAGE, &hb));
    if (hb == NULL || hb == h1) FAIL("another buffer got handle %p (first %p)", hb, h1);
    /* A range reaching into the second page is a different range. */
    void* h4 = NULL;
    CHECK(qcclCommRegister(comm, a, PAGE + 1, &h4));
    if (h4 == h1 || h4 == hb) FAIL("two pages got handle %p", h4);
    CHECK(qcclCommDeregister(comm, h4));

    /* Three registrations of `a`: three deregistrations, then a fourth is refused. */
    CHECK(qcclCommDeregister(comm, h1));
    CHECK(qcclCommDeregister(comm, h1));
    CHECK(qcclCommDeregister(comm, h1));
    EXPECT_ERR(qcclCommDeregister(comm, h1), qcclInvalidArgument, comm, "not a registration of this comm");
    CHECK(qcclCommDeregister(comm, hb));
    EXPECT_ERR(qcclCommDeregister(comm, hb), qcclInvalidArgument, comm, "already deregistered");
    /* A number never handed out. */
    EXPECT_ERR(qcclCommDeregister(comm, (void*)(uintptr_t)0x7777), qcclInvalidArgument, comm,
               "not a registration of this comm");

    /* Bad arguments: each named; a failed register leaves *handle NULL. */
    void* h = (void*)&h;
    EXPECT_ERR(qcclCommRegister(comm, NULL, 64, &h), qcclInvalidArgument, comm, "buff is NULL");
    if (h != NULL) FAIL("a failed qcclCommRegister left *handle set");
    EXPECT_ERR(qcclCommRegister(comm, a, 0, &h), qcclInvalidArgument, comm, "size is 0");
    EXPECT_ERR(qcclCommRegister(comm, a, 64, NULL), qcclInvalidArgument, comm, "handle is NULL");
    EXPECT_ERR(qcclCommDeregister(comm, NULL), qcclInvalidArgument, comm, "handle is NULL");
    EXPECT_ERR(qcclCommRegister(NULL, a, 64, &h), qcclInvalidArgument, NULL, "comm is NULL");
    EXPECT_ERR(qcclCommDeregister(NULL, h1), qcclInvalidArgument, NULL, "comm is NULL");
    qcclComm_t bogus = (qcclComm_t)&bogus;
    EXPECT_ERR(qcclCommRegister(bogus, a, 64, &h), qcclInvalidUsage, NULL, "not a live communicator");
    /* The failures above were local: nothing is left registered and the comm is healthy. */
    qcclResult_t async = qcclInternalError;
    CHECK(qcclCommGetAsyncError(comm, &async));
    if (async != qcclSuccess) FAIL("an argument error failed the comm: %s", qcclGetLastError(comm));
    free(a);
    free(b);
}

/* STEPS all-reduces (sum) with new data each step, checked against the sum over ranks. */
static void all_reduce_steps(qcclComm_t comm, int rank, int nranks, float* send, float* recv,
                             size_t n, const char* what) {
    for (int step = 0; step < STEPS; step++) {
        for (size_t i = 0; i < n; i++) send[i] = (float)value(rank, step, i);
        if (recv != send) poison(recv, n * sizeof(float));
        CHECK(qcclAllReduce(send, recv, n, qcclFloat32, qcclSum, comm, NULL));
        for (size_t i = 0; i < n; i++) {
            double want = 0;
            for (int r = 0; r < nranks; r++) want += value(r, step, i);
            if ((double)recv[i] != want)
                FAIL("%s, %zu elements, step %d: [%zu] = %g, want %g", what, n, step, i,
                     (double)recv[i], want);
        }
    }
}

static void collectives(qcclComm_t comm, int rank, int nranks) {
    const size_t counts[] = {1, 1000, 262147}; /* the last: 1 MiB and a bit, odd */
    for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++) {
        size_t n = counts[k], bytes = n * sizeof(float);
        float* send = (float*)page_alloc(bytes);
        float* recv = (float*)page_alloc(bytes);
        void *hs = NULL, *hr = NULL;
        /* Out of place, both registered. */
        CHECK(qcclCommRegister(comm, send, bytes, &hs));
        CHECK(qcclCommRegister(comm, recv, bytes, &hr));
        all_reduce_steps(comm, rank, nranks, send, recv, n, "registered, out of place");
        /* In place in a registered buffer. */
        all_reduce_steps(comm, rank, nranks, send, send, n, "registered, in place");
        /* Only the receive buffer registered. */
        CHECK(qcclCommDeregister(comm, hs));
        all_reduce_steps(comm, rank, nranks, send, recv, n, "recv registered");
        CHECK(qcclCommDeregister(comm, hr));
        /* Freed, then a new buffer (the allocator may hand back the same address) registered
         * and used: its bytes, not the old ones, are what the ranks get. */
        free(send);
        send = (float*)page_alloc(bytes);
        CHECK(qcclCommRegister(comm, send, bytes, &hs));
        all_reduce_steps(comm, rank, nranks, send, recv, n, "re-registered after free");
        /* A broadcast from a registered buffer on the root. */
        for (size_t i = 0; i < n; i++) send[i] = (float)value(rank, 9, i);
        CHECK(qcclBroadcast(send, recv, n, qcclFloat32, nranks - 1, comm, NULL));
        for (size_t i = 0; i < n; i++)
            if ((double)recv[i] != value(nranks - 1, 9, i))
                FAIL("broadcast from registered memory, %zu elements: [%zu] = %g", n, i, (double)recv[i]);
        CHECK(qcclCommDeregister(comm, hs));
        free(send);
        free(recv);
    }
}

static int body(int rank, int nranks, qcclUniqueId id) {
    qcclComm_t comm;
    CHECK(qcclCommInitRank(&comm, nranks, id, rank));
    handle_rules(comm);
    collectives(comm, rank, nranks);
    /* A registration left at destroy is released with the comm. */
    void* h = NULL;
    float* leftover = (float*)page_alloc(PAGE);
    CHECK(qcclCommRegister(comm, leftover, PAGE, &h));
    CHECK(qcclCommDestroy(comm));
    EXPECT_ERR(qcclCommDeregister(comm, h), qcclInvalidUsage, NULL, "not a live communicator");
    free(leftover);
    return 0;
}

int main(int argc, char** argv) {
    int nranks = argc > 1 ? atoi(argv[1]) : 2;
    int ib = argc > 2 && !strcmp(argv[2], "ib");
    if (ib) {
        /* Every pair of ranks over the RDMA link, on the emulated fabric. */
        setenv("QCCL_IB_EMULATE", "1", 1);
        setenv("QCCL_NET", "IB", 1);
        setenv("QCCL_SHM_DISABLE", "1", 1);
        setenv("QCCL_DEBUG", "INFO", 1); /* the test checks the links each rank names */
    }
    int failed = run_ranks(nranks, body);
    printf("registration on %d processes%s: %s\n", nranks, ib ? " over IB (emulated)" : "",
           failed ? "FAILED" : "ok");
    return failed;
}
