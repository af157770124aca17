/* Survivors carry on through the C ABI: 4 forked ranks run checked all-reduces; rank 2
 * kills itself (SIGKILL) at step 5; every survivor's call fails, qcclCommGetAsyncError and
 * qcclGetLastError report it, qcclCommShrink(comm, NULL, 0, &newcomm) makes a comm of the 3
 * survivors (ranks renumbered in order), they agree on the step to resume from and finish
 * the loop on it. Then the survivors shrink once more with an exclusion list (old rank 3
 * leaves, alive, without calling), and bad arguments are refused before anything moves. */
#include "common.h"

#define NR 4
#define VICTIM 2
#define COUNT 1009

static double value(int old_rank, int step, int i) {
    return 0.01 * (double)((i * 13 + old_rank * 7 + step * 3) % 97) - 0.3 * old_rank;
}

/* One checked all-reduce on `comm`, whose ranks are the old ranks `members[0..n]`. */
static qcclResult_t step_once(qcclComm_t comm, const int* members, int n, int me, int step) {
    float x[COUNT], y[COUNT];
    for (int i = 0; i < COUNT; i++) x[i] = (float)value(me, step, i);
    qcclResult_t rc = qcclAllReduce(x, y, COUNT, qcclFloat32, qcclSum, comm, NULL);
    if (rc != qcclSuccess) return rc;
    for (int i = 0; i < COUNT; i++) {
        double want = 0;
        for (int k = 0; k < n; k++) want += (float)value(members[k], step, i);
        if (fabs(y[i] - want) > 1e-4 * (fabs(want) + 1))
            FAIL("step %d: [%d] = %.7g, float64 reference %.7g", step, i, (double)y[i], want);
    }
    return qcclSuccess;
}

static int body(int rank, int nranks, qcclUniqueId id) {
    (void)nranks;
    qcclComm_t comm;
    CHECK(qcclCommInitRank(&comm, NR, id, rank));
    int members[NR] = {0, 1, 2, 3}, n = NR, shrunk = 0;
    for (int step = 0; step < 12; step++) {
        if (rank == VICTIM && step == 5) raise(SIGKILL);
        qcclResult_t rc = step_once(comm, members, n, rank, step);
        if (rc == qcclSuccess) continue;
        if (shrunk) FAIL("step %d failed after the shrink: %s", step, qcclGetLastError(comm));
        qcclResult_t async = qcclSuccess;
        CHECK(qcclCommGetAsyncError(comm, &async));
        if (async != rc) FAIL("async error %d, the call returned %d", (int)async, (int)rc);
        printf("rank %d: step %d failed (%d): %s\n", rank, step, (int)rc, qcclGetLastError(comm));
        qcclComm_t next = NULL;
        CHECK(qcclCommShrink(comm, NULL, 0, &next));
        CHECK(qcclCommDestroy(comm));
        comm = next;
        int c = 0, r = -1;
        CHECK(qcclCommCount(comm, &c));
        CHECK(qcclCommUserRank(comm, &r));
        if (c != NR - 1 || r != rank - (rank > VICTIM)) FAIL("new comm: rank %d of %d", r, c);
        n = 0;
        for (int k = 0; k < NR; k++)
            if (k != VICTIM) members[n++] = k;
        /* The failed step may have completed on some survivors: resume from the earliest. */
        int from = step;
        CHECK(qcclAllReduce(&from, &from, 1, qcclInt32, qcclMin, comm, NULL));
        step = from - 1;
        shrunk = 1;
    }
    if (!shrunk) FAIL("no failure seen");

    /* Bad arguments: refused before anything moves; the comm stays usable. */
    qcclComm_t bad = (qcclComm_t)&bad;
    int self = rank - (rank > VICTIM), two = 2, far = 9;
    EXPECT_ERR(qcclCommShrink(comm, NULL, 0, NULL), qcclInvalidArgument, comm, "newcomm is NULL");
    EXPECT_ERR(qcclCommShrink(comm, NULL, 2, &bad), qcclInvalidArgument, comm, "excludeRanks is NULL but excludeCount is 2");
    if (bad != NULL) FAIL("a failed qcclCommShrink left *newcomm set");
    EXPECT_ERR(qcclCommShrink(comm, &two, -1, &bad), qcclInvalidArgument, comm, "excludeCount is -1");
    EXPECT_ERR(qcclCommShrink(comm, &self, 1, &bad), qcclInvalidArgument, comm, "excludes itself");
    EXPECT_ERR(qcclCommShrink(comm, &far, 1, &bad), qcclInvalidArgument, comm, "rank 9 is out of range");
    CHECK(step_once(comm, members, n, rank, 100));

    /* Planned: old rank 3 (new rank 2) leaves without calling; the others name it. */
    if (rank == 3) {
        CHECK(qcclCommDestroy(comm));
        printf("rank %d: left\n", rank);
        return 0;
    }
    qcclComm_t pair = NULL;
    CHECK(qcclCommShrink(comm, &two, 1, &pair));
    CHECK(qcclCommDestroy(comm));
    int both[2] = {0, 1};
    CHECK(step_once(pair, both, 2, rank, 200));
    CHECK(qcclCommDestroy(pair));
    printf("rank %d: shrink ok\n", rank);
    return 0;
}

int main(void) {
    if (run_ranks_killing(NR, body, VICTIM) != 0) return 1;
    printf("shrink on %d processes: ok\n", NR);
    return 0;
}
