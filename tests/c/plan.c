/* Fusion plans from C (QCCL_PLAN_FILE, qcclCommSetPlan) on N forked processes (argv[1]):
 * a plan of 5 tensors in 3 groups (dense, fp16-compressed, and a dense group of one tensor),
 * odd sizes including a 1-element tensor. Iterations of qcclIAllReduce calls waited for at
 * the end, one iteration in a group (plus the group of one as a blocking call), results
 * against a float64 reference (exact for the dense groups, within fp16's bound for the
 * compressed one) and bit-identical on every rank; then the error paths: bad plan files (at
 * init and at qcclCommSetPlan), waiting on a tensor of an incomplete group, a blocking call
 * into a multi-tensor group, a group of tensors with mixed ops, a qcclGroupEnd that leaves a
 * group incomplete. */
#include "common.h"

#define NT 5
static const size_t SIZES[NT] = {1, 999, 17, 4097, 3};
/* Groups: {0,1} dense, {2,3} fp16, {4} dense. Ops per tensor (a group shares its op). */
static const qcclRedOp_t OPS[NT] = {qcclAvg, qcclAvg, qcclSum, qcclSum, qcclAvg};
static const int COMPRESSED[NT] = {0, 0, 1, 1, 0};
/* In place (sendbuff == recvbuff) or not, per tensor. */
static const int IN_PLACE[NT] = {1, 0, 0, 1, 0};

static char g_dir[256];

static const char* PLAN =
    "{\"groups\": [{\"start\": 0, \"end\": 2},\n"
    "  {\"start\": 2, \"end\": 4, \"codec\": \"fp16\"},\n"
    "  {\"start\": 4, \"end\": 5}]}\n";

static void write_file(const char* name, const char* text, char* path, size_t cap) {
    snprintf(path, cap, "%s/%s", g_dir, name);
    FILE* f = fopen(path, "w");
    if (!f || fputs(text, f) < 0 || fclose(f) != 0) FAIL("writing %s", path);
}

/* Rank r's value of element i of tensor t at iteration it. Dense tensors: multiples of 1/8,
 * so float32 sums are exact; compressed ones carry bits fp16 cannot hold. */
static float value(int r, int t, size_t i, int it) {
    double v = (double)((int)((r * 7 + t * 3 + i * 5 + it * 11) % 41) - 20) / 8.0;
    if (COMPRESSED[t]) v += 1e-4 * (double)((i * 13 + (size_t)r) % 97);
    return (float)v;
}

typedef struct {
    float* send[NT];
    float* recv[NT];
} Tensors;

static void fill(Tensors* x, int rank, int it) {
    for (int t = 0; t < NT; t++) {
        float* in = IN_PLACE[t] ? x->recv[t] : x->send[t];
        for (size_t i = 0; i < SIZES[t]; i++) in[i] = value(rank, t, i, it);
        if (!IN_PLACE[t]) poison(x->recv[t], SIZES[t] * sizeof(float));
    }
}

static const void* sendbuf(Tensors* x, int t) { return IN_PLACE[t] ? x->recv[t] : x->send[t]; }

/* Checks every tensor against the float64 reference and that all ranks hold the same bits;
 * returns how many compressed elements differ from the exact result (fp16 did something). */
static int check(Tensors* x, int nranks, int it, qcclComm_t comm, const char* what) {
    int inexact = 0;
    for (int t = 0; t < NT; t++) {
        for (size_t i = 0; i < SIZES[t]; i++) {
            double sum = 0, mag = 0;
            for (int r = 0; r < nranks; r++) {
                sum += value(r, t, i, it);
                mag += fabs(value(r, t, i, it));
            }
            double want = OPS[t] == qcclAvg ? sum / nranks : sum;
            float got = x->recv[t][i];
            if (COMPRESSED[t]) {
                /* Each contribution and the owner's sum are fp16-rounded once: 2^-11 relative
                 * each; twice that as the bound. */
                double bound = ldexp(mag + fabs(sum), -10) + 1e-6;
                if (fabs(got - want) > bound)
                    FAIL("%s, iteration %d: tensor %d [%zu] = %.9g, float64 reference %.9g "
                         "(bound %.3g)", what, it, t, i, got, want, bound);
                inexact += got != (float)want;
            } else if (got != (float)want) {
                FAIL("%s, iteration %d: tensor %d [%zu] = %.9g, expected exactly %.9g", what,
                     it, t, i, got, (float)want);
            }
        }
        /* Bit-identical on every rank (an all-gather: the plan does not apply to it). */
        size_t bytes = SIZES[t] * sizeof(float);
        unsigned char* all = (unsigned char*)xmalloc(bytes * (size_t)nranks);
        CHECK(qcclAllGather(x->recv[t], all, bytes, qcclUint8, comm, NULL));
        for (int r = 1; r < nranks; r++)
            if (memcmp(all, all + (size_t)r * bytes, bytes) != 0)
                FAIL("%s, iteration %d: tensor %d differs between rank 0 and rank %d", what, it,
                     t, r);
        free(all);
    }
    return inexact;
}

/* One iteration with qcclIAllReduce, waiting at the end. */
static void iterate_nonblocking(Tensors* x, int rank, int nranks, int it, qcclComm_t comm) {
    fill(x, rank, it);
    qcclRequest_t req[NT];
    for (int t = 0; t < NT; t++)
        CHECK(qcclIAllReduce(sendbuf(x, t), x->recv[t], SIZES[t], qcclFloat32, OPS[t], comm,
                             &req[t]));
    for (int t = NT - 1; t >= 0; t--) CHECK(qcclWait(req[t]));
    int inexact = check(x, nranks, it, comm, "non-blocking");
    /* One rank has nothing to encode for another; with more, fp16 must have rounded. */
    if (nranks > 1 && inexact < 100)
        FAIL("iteration %d: only %d compressed results rounded", it, inexact);
}

static int body(int rank, int nranks, qcclUniqueId id) {
    char plan_path[512], bad_json[512], bad_groups[512], bad_codec[512], missing[512];
    snprintf(plan_path, sizeof plan_path, "%s/plan.json", g_dir);
    snprintf(bad_json, sizeof bad_json, "%s/bad_json.json", g_dir);
    snprintf(bad_groups, sizeof bad_groups, "%s/bad_groups.json", g_dir);
    snprintf(bad_codec, sizeof bad_codec, "%s/bad_codec.json", g_dir);
    snprintf(missing, sizeof missing, "%s/missing.json", g_dir);

    /* A bad QCCL_PLAN_FILE fails the init before the rendezvous; the rank can retry. */
    qcclComm_t comm;
    setenv("QCCL_PLAN_FILE", bad_codec, 1);
    EXPECT_ERR(qcclCommInitRank(&comm, nranks, id, rank), qcclInvalidArgument, NULL,
               "QCCL_PLAN_FILE");
    EXPECT_ERR(qcclCommInitRank(&comm, nranks, id, rank), qcclInvalidArgument, NULL,
               "nosuchcodec");
    if (comm != NULL) FAIL("comm set after a failed init");
    setenv("QCCL_PLAN_FILE", plan_path, 1);
    CHECK(qcclCommInitRank(&comm, nranks, id, rank));

    Tensors x;
    for (int t = 0; t < NT; t++) {
        x.send[t] = (float*)xmalloc(SIZES[t] * sizeof(float));
        x.recv[t] = (float*)xmalloc(SIZES[t] * sizeof(float));
    }
    int it = 0;
    iterate_nonblocking(&x, rank, nranks, it++, comm);
    iterate_nonblocking(&x, rank, nranks, it++, comm);

    /* An iteration in a group, with a float64 all-reduce in the middle (not a tensor), and
     * the group of one tensor as a blocking call. */
    fill(&x, rank, it);
    double d[3] = {rank, 1, 2};
    CHECK(qcclGroupStart());
    for (int t = 0; t < 2; t++)
        CHECK(qcclAllReduce(sendbuf(&x, t), x.recv[t], SIZES[t], qcclFloat32, OPS[t], comm, NULL));
    CHECK(qcclAllReduce(d, d, 3, qcclFloat64, qcclSum, comm, NULL));
    for (int t = 2; t < 4; t++)
        CHECK(qcclAllReduce(sendbuf(&x, t), x.recv[t], SIZES[t], qcclFloat32, OPS[t], comm, NULL));
    CHECK(qcclGroupEnd());
    CHECK(qcclAllReduce(sendbuf(&x, 4), x.recv[4], SIZES[4], qcclFloat32, OPS[4], comm, NULL));
    check(&x, nranks, it++, comm, "grouped");
    if (d[0] != nranks * (nranks - 1) / 2.0 || d[1] != nranks)
        FAIL("float64 all-reduce inside the plan's group: %g %g", d[0], d[1]);

    /* ---- errors ---- */
    EXPECT_ERR(qcclCommSetPlan(comm, bad_json), qcclInvalidArgument, comm, bad_json);
    EXPECT_ERR(qcclCommSetPlan(comm, bad_json), qcclInvalidArgument, comm, "plan JSON");
    EXPECT_ERR(qcclCommSetPlan(comm, bad_groups), qcclInvalidArgument, comm, bad_groups);
    EXPECT_ERR(qcclCommSetPlan(comm, bad_groups), qcclInvalidArgument, comm,
               "plan group 1 is 3..5, expected a non-empty group starting at tensor 2");
    EXPECT_ERR(qcclCommSetPlan(comm, bad_codec), qcclInvalidArgument, comm, "nosuchcodec");
    EXPECT_ERR(qcclCommSetPlan(comm, missing), qcclInvalidArgument, comm, missing);
    /* ... and the failed calls left the plan in place: */
    fill(&x, rank, it);
    qcclRequest_t req[NT];
    /* A blocking call into a group of two tensors. */
    EXPECT_ERR(qcclAllReduce(sendbuf(&x, 0), x.recv[0], SIZES[0], qcclFloat32, OPS[0], comm, NULL),
               qcclInvalidUsage, comm, "tensor 0 is in fusion group 0 (tensors 0 to 1)");
    EXPECT_ERR(qcclAllReduce(sendbuf(&x, 0), x.recv[0], SIZES[0], qcclFloat32, OPS[0], comm, NULL),
               qcclInvalidUsage, comm, "issue it with qcclIAllReduce");
    CHECK(qcclIAllReduce(sendbuf(&x, 0), x.recv[0], SIZES[0], qcclFloat32, OPS[0], comm, &req[0]));
    /* Waiting on a tensor of an incomplete group is an error, not a hang; the request lives. */
    int done = -1;
    CHECK(qcclTest(req[0], &done));
    if (done != 0) FAIL("qcclTest: a tensor of an incomplete group is done (%d)", done);
    EXPECT_ERR(qcclWait(req[0]), qcclInvalidUsage, comm,
               "tensor 0 is in fusion group 0 (tensors 0 to 1) which is incomplete: submit "
               "tensor 1 first");
    /* Mixed ops in one group. */
    EXPECT_ERR(qcclIAllReduce(sendbuf(&x, 1), x.recv[1], SIZES[1], qcclFloat32, qcclSum, comm,
                              &req[1]),
               qcclInvalidArgument, comm, "tensor 1 is in fusion group 0");
    if (req[1] != NULL) FAIL("request set after a failed call");
    for (int t = 1; t < NT; t++)
        CHECK(qcclIAllReduce(sendbuf(&x, t), x.recv[t], SIZES[t], qcclFloat32, OPS[t], comm,
                             &req[t]));
    for (int t = 0; t < NT; t++) CHECK(qcclWait(req[t]));
    check(&x, nranks, it++, comm, "after the errors");

    /* A group that leaves a fusion group incomplete runs nothing; the plan's iteration goes
     * back to where the group began. */
    CHECK(qcclGroupStart());
    CHECK(qcclAllReduce(sendbuf(&x, 0), x.recv[0], SIZES[0], qcclFloat32, OPS[0], comm, NULL));
    EXPECT_ERR(qcclGroupEnd(), qcclInvalidUsage, NULL,
               "tensor 0 is in fusion group 0 (tensors 0 to 1) which is incomplete at "
               "qcclGroupEnd");
    qcclResult_t async = qcclSuccess;
    CHECK(qcclCommGetAsyncError(comm, &async));
    if (async != qcclSuccess) FAIL("the comm failed after a refused group");
    iterate_nonblocking(&x, rank, nranks, it++, comm);

    /* Without the plan, float32 all-reduces are plain again. */
    CHECK(qcclCommSetPlan(comm, NULL));
    float y[7];
    for (int i = 0; i < 7; i++) y[i] = (float)(rank + i);
    CHECK(qcclAllReduce(y, y, 7, qcclFloat32, qcclSum, comm, NULL));
    for (int i = 0; i < 7; i++)
        if (y[i] != (float)(nranks * (nranks - 1) / 2 + nranks * i)) FAIL("no plan: [%d] = %g", i, y[i]);

    for (int t = 0; t < NT; t++) {
        free(x.send[t]);
        free(x.recv[t]);
    }
    CHECK(qcclCommDestroy(comm));
    return 0;
}

int main(int argc, char** argv) {
    int nranks = argc > 1 ? atoi(argv[1]) : 3;
    snprintf(g_dir, sizeof g_dir, "/tmp/qccl-plan-XXXXXX");
    if (!mkdtemp(g_dir)) FAIL("mkdtemp");
    char path[512];
    write_file("plan.json", PLAN, path, sizeof path);
    write_file("bad_json.json", "{\"groups\": [", path, sizeof path);
    write_file("bad_groups.json",
               "{\"groups\": [{\"start\": 0, \"end\": 2}, {\"start\": 3, \"end\": 5}]}", path,
               sizeof path);
    write_file("bad_codec.json", "{\"groups\": [{\"start\": 0, \"end\": 2, \"codec\": \"nosuchcodec\"}]}",
               path, sizeof path);
    unsetenv("QCCL_COMPRESSION");
    int failed = run_ranks(nranks, body);
    const char* names[] = {"plan.json", "bad_json.json", "bad_groups.json", "bad_codec.json"};
    for (int i = 0; i < 4; i++) {
        snprintf(path, sizeof path, "%s/%s", g_dir, names[i]);
        unlink(path);
    }
    rmdir(g_dir);
    printf("fusion plan on %d processes: %s\n", nranks, failed ? "FAILED" : "ok");
    return failed;
}
