/* A rank that stops (SIGSTOP, as a debugger or a stuck node would leave it) while 4 forked
 * ranks loop over all-reduces and broadcasts: every other rank's failing call returns an
 * error within QCCL_TIMEOUT_MS (plus the stall inspector's probe of a second or so),
 * qcclCommGetAsyncError gives that error's code, and qcclGetLastError names the stopped rank
 * and its address. Over tcp, then over shared memory. The parent SIGKILLs the stopped rank
 * once the others are done, so nothing is left behind. */
#include <signal.h>
#include <time.h>

#include "common.h"

#define NR 4
#define STOPPED 2
#define TIMEOUT_MS 3000

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* True when msg holds "rank <rank> (<host>:<port>)". */
static int names_with_address(const char* msg, int rank) {
    char want[32];
    snprintf(want, sizeof want, "rank %d (", rank);
    for (const char* p = msg ? strstr(msg, want) : NULL; p; p = strstr(p + 1, want)) {
        const char* addr = p + strlen(want);
        const char* end = strchr(addr, ')');
        const char* colon = end ? memchr(addr, ':', (size_t)(end - addr)) : NULL;
        if (!colon || colon == addr || colon + 1 == end) continue;
        const char* d = colon + 1;
        while (d < end && *d >= '0' && *d <= '9') d++;
        if (d == end) return 1;
    }
    return 0;
}

static int body(int rank, int nranks, qcclUniqueId id) {
    qcclComm_t comm;
    CHECK(qcclCommInitRank(&comm, nranks, id, rank));
    static float x[1 << 16];
    for (int i = 0;; i++) {
        if (rank == STOPPED && i == 50) raise(SIGSTOP); /* never resumed: killed */
        size_t count = i % 3 == 0 ? 1000 : i % 3 == 1 ? 16384 : (size_t)1 << 16;
        for (size_t k = 0; k < count; k++) x[k] = 1.0f;
        double t0 = now();
        qcclResult_t res =
            i % 2 == 0 ? qcclAllReduce(x, x, count, qcclFloat32, qcclSum, comm, NULL)
                       : qcclBroadcast(x, x, count, qcclFloat32, i % nranks, comm, NULL);
        if (res == qcclSuccess) continue;
        double took = now() - t0;
        if (rank == STOPPED) FAIL("the rank to stop failed first: %s", qcclGetLastError(comm));
        if (took > TIMEOUT_MS / 1000.0 + 10) FAIL("the failure took %.1f s", took);
        qcclResult_t async = qcclSuccess;
        CHECK(qcclCommGetAsyncError(comm, &async));
        if (async != res)
            FAIL("call %d returned %d (%s), the async error is %d", i, (int)res,
                 qcclGetErrorString(res), (int)async);
        const char* msg = qcclGetLastError(comm);
        if (!names_with_address(msg, STOPPED))
            FAIL("call %d: qcclGetLastError = \"%s\" does not name rank %d with its address", i,
                 msg ? msg : "(null)", STOPPED);
        printf("rank %d: call %d failed after %.1f s with %s: %s\n", rank, i, took,
               qcclGetErrorString(res), msg);
        CHECK(qcclCommDestroy(comm));
        return 0;
    }
}

/* One job over `transport`; returns 0 when every rank but the stopped one exited 0 (the
 * stopped one is killed at the end). */
static int job(const char* transport) {
    setenv("QCCL_TRANSPORT", transport, 1);
    int failed = run_ranks_killing(NR, body, STOPPED);
    printf("stopped rank over %s on %d processes: %s\n", transport, NR, failed ? "FAILED" : "ok");
    fflush(stdout);
    return failed;
}

int main(void) {
    char ms[16];
    snprintf(ms, sizeof ms, "%d", TIMEOUT_MS);
    setenv("QCCL_TIMEOUT_MS", ms, 1);
    int failed = job("tcp");
    failed |= job("shm");
    return failed;
}
