/* One thread drives 4 comms made by qcclCommInitAll: grouped all-reduce and other
 * collectives, send/recv rings and swaps (up to 64 MiB, both sides sending first),
 * all-to-all-v through send/recv including self, nested groups, non-blocking calls on all
 * comms at once, a spoiled group, and a runtime error at qcclGroupEnd. */
#include <time.h>

#include "common.h"

#define N 4

static void grouped_all_reduce(qcclComm_t* comms, qcclDataType_t t, size_t count) {
    size_t es = dt_size(t);
    void* buf[N];
    for (int r = 0; r < N; r++) {
        buf[r] = xmalloc(count * es);
        for (size_t i = 0; i < count; i++) put(t, buf[r], i, (double)(r + 1) + (double)(i % 5));
    }
    CHECK(qcclGroupStart());
    for (int r = 0; r < N; r++) CHECK(qcclAllReduce(buf[r], buf[r], count, t, qcclSum, comms[r], NULL));
    CHECK(qcclGroupEnd());
    for (int r = 0; r < N; r++) {
        for (size_t i = 0; i < count; i++) {
            double want = 10.0 + 4.0 * (double)(i % 5);
            if (get(t, buf[r], i) != want)
                FAIL("grouped all_reduce (%s) rank %d element %zu: %g, expected %g", dt_name(t), r,
                     i, get(t, buf[r], i), want);
        }
        free(buf[r]);
    }
}

static void grouped_collectives(qcclComm_t* comms) {
    size_t count = 3000;
    float* bc[N];
    float* red[N];
    float* ag[N];
    float* rs[N];
    for (int r = 0; r < N; r++) {
        bc[r] = (float*)xmalloc(count * 4);
        red[r] = (float*)xmalloc(count * 4);
        ag[r] = (float*)xmalloc(count * N * 4);
        rs[r] = (float*)xmalloc(count * N * 4);
        for (size_t i = 0; i < count; i++) {
            bc[r][i] = r == 2 ? (float)i : -1.0f;
            red[r][i] = (float)(r * i % 7);
            ag[r][r * count + i] = (float)(r * 10000 + (int)i);
        }
        for (size_t i = 0; i < count * N; i++) rs[r][i] = (float)r + (float)(i % 3);
    }
    /* Several collectives per comm in one group: they run in call order per comm. */
    CHECK(qcclGroupStart());
    for (int r = 0; r < N; r++) {
        CHECK(qcclBroadcast(bc[r], bc[r], count, qcclFloat32, 2, comms[r], NULL));
        CHECK(qcclReduce(red[r], red[r], count, qcclFloat32, qcclMax, 1, comms[r], NULL));
        CHECK(qcclAllGather(ag[r] + r * count, ag[r], count, qcclFloat32, comms[r], NULL));
        CHECK(qcclReduceScatter(rs[r], rs[r] + r * count, count, qcclFloat32, qcclSum, comms[r], NULL));
    }
    CHECK(qcclGroupEnd());
    for (int r = 0; r < N; r++) {
        for (size_t i = 0; i < count; i++) {
            if (bc[r][i] != (float)i) FAIL("grouped broadcast rank %d [%zu] = %g", r, i, (double)bc[r][i]);
            if (r == 1) {
                float want = 0;
                for (int q = 0; q < N; q++) want = (float)(q * i % 7) > want ? (float)(q * i % 7) : want;
                if (red[r][i] != want) FAIL("grouped reduce [%zu] = %g", i, (double)red[r][i]);
            }
            for (int q = 0; q < N; q++)
                if (ag[r][q * count + i] != (float)(q * 10000 + (int)i))
                    FAIL("grouped all_gather rank %d part %d [%zu]", r, q, i);
            float rs_want = 6.0f + 4.0f * (float)((r * count + i) % 3);
            if (rs[r][r * count + i] != rs_want)
                FAIL("grouped reduce_scatter rank %d [%zu] = %g, expected %g", r, i,
                     (double)rs[r][r * count + i], (double)rs_want);
        }
        free(bc[r]);
        free(red[r]);
        free(ag[r]);
        free(rs[r]);
    }
}

/* Every comm sends `bytes` to the next and receives from the previous, sends first. */
static void grouped_ring(qcclComm_t* comms, size_t bytes) {
    size_t count = bytes / 4;
    int32_t* s[N];
    int32_t* d[N];
    for (int r = 0; r < N; r++) {
        s[r] = (int32_t*)xmalloc(bytes);
        d[r] = (int32_t*)xmalloc(bytes);
        for (size_t i = 0; i < count; i++) s[r][i] = (int32_t)(r * 7 + (int)(i % 100003));
        poison(d[r], bytes);
    }
    CHECK(qcclGroupStart());
    for (int r = 0; r < N; r++) CHECK(qcclSend(s[r], count, qcclInt32, (r + 1) % N, comms[r], NULL));
    for (int r = 0; r < N; r++) CHECK(qcclRecv(d[r], count, qcclInt32, (r + N - 1) % N, comms[r], NULL));
    CHECK(qcclGroupEnd());
    for (int r = 0; r < N; r++) {
        int prev = (r + N - 1) % N;
        for (size_t i = 0; i < count; i++)
            if (d[r][i] != (int32_t)(prev * 7 + (int)(i % 100003)))
                FAIL("ring rank %d element %zu: %d", r, i, d[r][i]);
        free(s[r]);
        free(d[r]);
    }
}

/* Comms 0 and 1 swap 64 MiB, both calling send before recv, in one group. */
static void grouped_swap(qcclComm_t* comms) {
    size_t bytes = 64u << 20, count = bytes / 4;
    float* s[2];
    float* d[2];
    for (int r = 0; r < 2; r++) {
        s[r] = (float*)xmalloc(bytes);
        d[r] = (float*)xmalloc(bytes);
        for (size_t i = 0; i < count; i++) s[r][i] = (float)(r + 1) + (float)(i & 1023);
    }
    CHECK(qcclGroupStart());
    for (int r = 0; r < 2; r++) {
        CHECK(qcclSend(s[r], count, qcclFloat32, 1 - r, comms[r], NULL));
        CHECK(qcclRecv(d[r], count, qcclFloat32, 1 - r, comms[r], NULL));
    }
    CHECK(qcclGroupEnd());
    for (int r = 0; r < 2; r++) {
        for (size_t i = 0; i < count; i++)
            if (d[r][i] != (float)(2 - r) + (float)(i & 1023)) FAIL("swap rank %d element %zu", r, i);
        free(s[r]);
        free(d[r]);
    }
}

/* All-to-all-v through grouped send/recv, self included, two messages per pair. */
static void grouped_alltoallv(qcclComm_t* comms) {
    int64_t* out[N][N][2];
    int64_t* in[N][N][2];
    size_t cnt[N][N];
    CHECK(qcclGroupStart());
    CHECK(qcclGroupStart()); /* nested: only the outermost end runs the calls */
    for (int r = 0; r < N; r++) {
        for (int p = 0; p < N; p++) {
            cnt[r][p] = 50 + 11 * (size_t)r + 5 * (size_t)p; /* r -> p */
            for (int k = 0; k < 2; k++) {
                out[r][p][k] = (int64_t*)xmalloc(cnt[r][p] * 8);
                for (size_t i = 0; i < cnt[r][p]; i++)
                    out[r][p][k][i] = r * 1000000 + p * 10000 + k * 1000 + (int64_t)i;
            }
        }
    }
    for (int r = 0; r < N; r++) {
        for (int p = N - 1; p >= 0; p--) {
            for (int k = 0; k < 2; k++) {
                in[r][p][k] = (int64_t*)xmalloc(cnt[p][r] * 8);
                poison(in[r][p][k], cnt[p][r] * 8);
                CHECK(qcclSend(out[r][p][k], cnt[r][p], qcclInt64, p, comms[r], NULL));
                CHECK(qcclRecv(in[r][p][k], cnt[p][r], qcclInt64, p, comms[r], NULL));
            }
        }
    }
    CHECK(qcclGroupEnd());
    for (int r = 0; r < N; r++)
        if (in[r][0][0][0] != (int64_t)0x7b7b7b7b7b7b7b7bLL) FAIL("inner qcclGroupEnd ran the calls");
    CHECK(qcclGroupEnd());
    for (int r = 0; r < N; r++)
        for (int p = 0; p < N; p++)
            for (int k = 0; k < 2; k++) {
                for (size_t i = 0; i < cnt[p][r]; i++)
                    if (in[r][p][k][i] != p * 1000000 + r * 10000 + k * 1000 + (int64_t)i)
                        FAIL("alltoallv: rank %d from %d msg %d element %zu = %lld", r, p, k, i,
                             (long long)in[r][p][k][i]);
                free(in[r][p][k]);
                free(out[r][p][k]);
            }
}

/* Non-blocking all-reduce started on all 4 comms from this thread, then waited for. */
static void nonblocking(qcclComm_t* comms) {
    size_t count = 1 << 18;
    float* buf[N];
    qcclRequest_t req[N];
    for (int r = 0; r < N; r++) {
        buf[r] = (float*)xmalloc(count * 4);
        for (size_t i = 0; i < count; i++) buf[r][i] = (float)r;
        CHECK(qcclIAllReduce(buf[r], buf[r], count, qcclFloat32, qcclAvg, comms[r], &req[r]));
    }
    for (int r = N - 1; r >= 0; r--) CHECK(qcclWait(req[r]));
    for (int r = 0; r < N; r++) {
        for (size_t i = 0; i < count; i++)
            if (buf[r][i] != 1.5f) FAIL("iall_reduce avg rank %d [%zu] = %g", r, i, (double)buf[r][i]);
        free(buf[r]);
    }
}

/* A bad call inside a group spoils it: qcclGroupEnd runs nothing and reports it; the comms
 * stay usable. */
static void spoiled_group(qcclComm_t* comms) {
    float x[N] = {1, 2, 3, 4};
    CHECK(qcclGroupStart());
    CHECK(qcclAllReduce(&x[0], &x[0], 1, qcclFloat32, qcclSum, comms[0], NULL));
    EXPECT_ERR(qcclAllReduce(NULL, &x[1], 1, qcclFloat32, qcclSum, comms[1], NULL),
               qcclInvalidArgument, comms[1], "sendbuff is NULL");
    EXPECT_ERR(qcclGroupEnd(), qcclInvalidArgument, NULL, "none of the 1 queued operations ran");
    if (x[0] != 1) FAIL("a spoiled group ran a call");
    grouped_all_reduce(comms, qcclFloat32, 10);
}

/* Ranks that disagree (sizes of a send and its receive) fail at qcclGroupEnd with the
 * reason; the comms are failed afterwards. */
static void mismatch(qcclComm_t* comms) {
    float a[20], b[20];
    for (int i = 0; i < 20; i++) a[i] = (float)i;
    CHECK(qcclGroupStart());
    CHECK(qcclSend(a, 10, qcclFloat32, 1, comms[0], NULL));
    CHECK(qcclRecv(b, 20, qcclFloat32, 0, comms[1], NULL));
    qcclResult_t r = qcclGroupEnd();
    if (r == qcclSuccess) FAIL("mismatched send/recv succeeded");
    const char* msg = qcclGetLastError(NULL);
    if (!strstr(msg, "count=10") || !strstr(msg, "count=20"))
        FAIL("mismatch: last error \"%s\" does not name both calls", msg);
    printf("mismatch reported as %s: %s\n", qcclGetErrorString(r), msg);
    qcclResult_t async = qcclSuccess;
    CHECK(qcclCommGetAsyncError(comms[1], &async));
    if (async == qcclSuccess) FAIL("comm 1 is not failed after the mismatch");
    if (strlen(qcclGetLastError(comms[1])) == 0) FAIL("comm 1 has no last error");
}

/* QCCL_ALGO=hier on comms of qcclCommInitAll, one thread, inside a group: each comm's first
 * hierarchical all-reduce makes its levels, which must neither wait for the ranks this thread
 * has not reached yet (the timeout) nor go hierarchical again themselves (that recursed until
 * the stack overflowed). */
static void hier_in_a_group(void) {
    setenv("QCCL_ALGO", "hier", 1);
    qcclComm_t comms[N];
    CHECK(qcclCommInitAll(comms, N, NULL));
    unsetenv("QCCL_ALGO");
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    grouped_all_reduce(comms, qcclFloat32, 4099);
    grouped_all_reduce(comms, qcclFloat64, 7);
    qcclCodec_t fp16 = NULL;
    CHECK(qcclCodecCreate("fp16", &fp16));
    float* buf[N];
    for (int r = 0; r < N; r++) {
        buf[r] = (float*)xmalloc(1000 * sizeof(float));
        for (int i = 0; i < 1000; i++) buf[r][i] = (float)(r + 1);
    }
    CHECK(qcclGroupStart());
    for (int r = 0; r < N; r++)
        CHECK(qcclAllReduceCompressed(buf[r], buf[r], 1000, qcclFloat32, qcclSum, fp16, 0, comms[r], NULL));
    CHECK(qcclGroupEnd());
    for (int r = 0; r < N; r++) {
        if (buf[r][999] != 10.0f) FAIL("hier compressed: rank %d got %g", r, (double)buf[r][999]);
        free(buf[r]);
    }
    CHECK(qcclCodecDestroy(fp16));
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double secs = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    if (secs > 10.0) FAIL("hierarchical all-reduces in a group took %.1f s (waited for a timeout?)", secs);
    for (int r = 0; r < N; r++) CHECK(qcclCommDestroy(comms[r]));
}

int main(void) {
    qcclComm_t comms[N];
    g_rank = 0;
    alarm(120);
    CHECK(qcclCommInitAll(comms, N, NULL));
    for (int r = 0; r < N; r++) {
        int rank = -1, n = -1;
        CHECK(qcclCommUserRank(comms[r], &rank));
        CHECK(qcclCommCount(comms[r], &n));
        if (rank != r || n != N) FAIL("comm %d: rank %d of %d", r, rank, n);
    }
    grouped_all_reduce(comms, qcclFloat32, 100000);
    grouped_all_reduce(comms, qcclInt32, 777);
    grouped_all_reduce(comms, qcclBfloat16, 5000);
    grouped_collectives(comms);
    grouped_ring(comms, 8u << 20);
    grouped_swap(comms);
    grouped_alltoallv(comms);
    nonblocking(comms);
    spoiled_group(comms);
    mismatch(comms);
    hier_in_a_group();
    CHECK(qcclCommDestroy(comms[0]));
    CHECK(qcclCommDestroy(comms[1]));
    CHECK(qcclCommAbort(comms[2]));
    CHECK(qcclCommAbort(comms[3]));
    printf("group test with %d comms on one thread: ok\n", N);
    return 0;
}
