/* qcclCommInitFromEnv across 3 forked processes given QCCL_RANK / QCCL_WORLD_SIZE /
 * QCCL_COMM_ID (as a launcher would set them) and QCCL_COMPRESSION=fp16 (float all-reduces
 * compressed, blocking, grouped and non-blocking alike), then qcclCommAbort on one rank: the
 * others' next collective fails promptly with the reason instead of hanging. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <time.h>

#include "common.h"

#define NR 3

/* A port on 127.0.0.1, held by *hold (bound with SO_REUSEADDR, never listening) until the
 * job ends: the kernel then hands it to no other bind to port 0 and no outgoing connection,
 * while rank 0 still binds it explicitly (SO_REUSEADDR, as Rust's TcpListener) and listens.
 * Closing the socket right away let another process take the port first. */
static int reserve_port(int* hold) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    int on = 1;
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (s < 0 || setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on) != 0 ||
        bind(s, (struct sockaddr*)&a, sizeof a) != 0 ||
        getsockname(s, (struct sockaddr*)&a, &len) != 0)
        FAIL("could not reserve a free port");
    *hold = s;
    return ntohs(a.sin_port);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int child(int rank) {
    qcclComm_t comm;
    CHECK(qcclCommInitFromEnv(&comm));
    int n = 0, r = -1;
    CHECK(qcclCommCount(comm, &n));
    CHECK(qcclCommUserRank(comm, &r));
    if (n != NR || r != rank) FAIL("rank %d of %d, expected %d of %d", r, n, rank, NR);
    double x[100];
    for (int i = 0; i < 100; i++) x[i] = rank + i * 0.5;
    CHECK(qcclAllReduce(x, x, 100, qcclFloat64, qcclSum, comm, NULL));
    for (int i = 0; i < 100; i++)
        if (x[i] != 3.0 + 3 * i * 0.5) FAIL("all_reduce from env: [%d] = %g", i, x[i]);

    /* Values fp16 cannot hold: the results are the fp16-rounded sums, not the exact ones. */
    static float y[1000];
    for (int mode = 0; mode < 3; mode++) {
        for (int i = 0; i < 1000; i++) y[i] = (float)(1.0 + 1e-4 * i + rank * 1e-5);
        if (mode == 0) {
            CHECK(qcclAllReduce(y, y, 1000, qcclFloat32, qcclSum, comm, NULL));
        } else if (mode == 1) {
            CHECK(qcclGroupStart());
            CHECK(qcclAllReduce(y, y, 1000, qcclFloat32, qcclSum, comm, NULL));
            CHECK(qcclGroupEnd());
        } else {
            qcclRequest_t req;
            CHECK(qcclIAllReduce(y, y, 1000, qcclFloat32, qcclSum, comm, &req));
            CHECK(qcclWait(req));
        }
        int inexact = 0;
        for (int i = 0; i < 1000; i++) {
            double exact = 3.0 * (1.0 + 1e-4 * i) + 3e-5;
            if (fabs(y[i] - exact) > 0.004) FAIL("QCCL_COMPRESSION mode %d: [%d] = %g", mode, i, y[i]);
            inexact += (float)exact != y[i];
        }
        if (inexact < 500) FAIL("QCCL_COMPRESSION mode %d: only %d results rounded", mode, inexact);
    }

    if (rank == 1) {
        CHECK(qcclCommAbort(comm));
        return 0;
    }
    double t0 = now();
    qcclResult_t res = qcclAllReduce(x, x, 100, qcclFloat64, qcclSum, comm, NULL);
    double took = now() - t0;
    if (res == qcclSuccess) FAIL("all_reduce after a peer aborted succeeded");
    if (took > 20) FAIL("the failure took %.1f s to surface", took);
    qcclResult_t async = qcclSuccess;
    CHECK(qcclCommGetAsyncError(comm, &async));
    if (async == qcclSuccess) FAIL("comm not failed after a peer's abort");
    printf("rank %d: after rank 1 aborted: %s (%.2f s): %s\n", rank, qcclGetErrorString(res),
           took, qcclGetLastError(comm));
    /* Later calls fail at once with the same reason. */
    if (qcclAllReduce(x, x, 1, qcclFloat64, qcclSum, comm, NULL) == qcclSuccess)
        FAIL("a failed comm ran a collective");
    CHECK(qcclCommDestroy(comm));
    return 0;
}

int main(void) {
    char addr[64];
    int hold = -1;
    snprintf(addr, sizeof addr, "127.0.0.1:%d", reserve_port(&hold));
    pid_t pids[NR];
    for (int r = 0; r < NR; r++) {
        pid_t pid = fork();
        if (pid < 0) FAIL("fork");
        if (pid == 0) {
            close(hold); /* the parent holds the port for the whole job */
            char rank[16], size[16];
            snprintf(rank, sizeof rank, "%d", r);
            snprintf(size, sizeof size, "%d", NR);
            setenv("QCCL_RANK", rank, 1);
            setenv("QCCL_WORLD_SIZE", size, 1);
            setenv("QCCL_COMM_ID", addr, 1);
            setenv("QCCL_COMPRESSION", "fp16", 1);
            g_rank = r;
            alarm(60);
            int rc = child(r);
            fflush(stdout);
            _exit(rc);
        }
        pids[r] = pid;
    }
    int failed = 0;
    for (int r = 0; r < NR; r++) {
        int st = 0;
        waitpid(pids[r], &st, 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            fprintf(stderr, "rank %d failed (status %d)\n", r, st);
            failed = 1;
        }
    }
    close(hold);
    printf("init from env + abort on %d processes: %s\n", NR, failed ? "FAILED" : "ok");
    return failed;
}
