/* Every collective of the C ABI across N forked processes (N = argv[1], 2..5), for float32,
 * int32, float16 and bfloat16, in and out of place, checked against references computed
 * here in double; then send/recv (blocking and grouped, up to 64 MiB), split and the
 * non-blocking calls. */
#include "common.h"

static const size_t COUNTS[] = {0, 1, 7, 1031, 70001};
#define NCOUNTS (sizeof COUNTS / sizeof COUNTS[0])
static const qcclDataType_t TYPES[] = {qcclFloat32, qcclInt32, qcclFloat16, qcclBfloat16};
#define NTYPES (sizeof TYPES / sizeof TYPES[0])

/* Input of rank r at index i: small integers, exact in every tested type, and so are their
 * sums, maxima and minima. Products use 1..3 (at most 3^5 = 243, exact in bfloat16). */
static double val(int r, size_t i) { return (double)((int)((i * 7 + (size_t)r * 3) % 11) - 3); }
static double val_prod(int r, size_t i) { return (double)(1 + (int)((i + (size_t)r) % 3)); }

static double input(qcclRedOp_t op, int r, size_t i) {
    return op == qcclProd ? val_prod(r, i) : val(r, i);
}

static double reference(qcclRedOp_t op, int nranks, size_t i) {
    double acc = input(op, 0, i);
    for (int r = 1; r < nranks; r++) {
        double v = input(op, r, i);
        switch (op) {
        case qcclSum: case qcclAvg: acc += v; break;
        case qcclProd: acc *= v; break;
        case qcclMax: acc = v > acc ? v : acc; break;
        case qcclMin: acc = v < acc ? v : acc; break;
        }
    }
    return op == qcclAvg ? acc / nranks : acc;
}

static const char* op_name(qcclRedOp_t op) {
    static const char* names[] = {"sum", "prod", "max", "min", "avg"};
    return names[op];
}

static void fill(qcclDataType_t t, void* buf, size_t n, qcclRedOp_t op, int r, size_t offset) {
    for (size_t i = 0; i < n; i++) put(t, buf, i, input(op, r, offset + i));
}

static void expect(const char* what, qcclDataType_t t, const void* buf, size_t i, double want,
                   double tolerance) {
    double got = get(t, buf, i);
    if (!(fabs(got - want) <= tolerance))
        FAIL("%s (%s): element %zu is %g, expected %g", what, dt_name(t), i, got, want);
}

static void test_all_reduce(qcclComm_t comm, int rank, int n, qcclDataType_t t, size_t count) {
    size_t es = dt_size(t);
    void* send = xmalloc(count * es);
    void* recv = xmalloc(count * es);
    for (int op = qcclSum; op <= qcclAvg; op++) {
        if (op == qcclAvg && !dt_is_float(t)) continue;
        double tl = op == qcclAvg ? tol(t) : 0;
        fill(t, send, count, op, rank, 0);
        poison(recv, count * es);
        CHECK(qcclAllReduce(send, recv, count, t, op, comm, NULL));
        for (size_t i = 0; i < count; i++) {
            expect(op_name(op), t, recv, i, reference(op, n, i), tl);
            expect("all_reduce left sendbuff", t, send, i, input(op, rank, i), 0);
        }
        fill(t, recv, count, op, rank, 0);
        CHECK(qcclAllReduce(recv, recv, count, t, op, comm, NULL));
        for (size_t i = 0; i < count; i++)
            expect("all_reduce in place", t, recv, i, reference(op, n, i), tl);
    }
    free(send);
    free(recv);
}

static void test_broadcast(qcclComm_t comm, int rank, int n, qcclDataType_t t, size_t count) {
    size_t es = dt_size(t);
    void* send = xmalloc(count * es);
    void* recv = xmalloc(count * es);
    int roots[2] = {0, n - 1};
    for (int k = 0; k < 2; k++) {
        int root = roots[k];
        fill(t, send, count, qcclSum, root, 0);
        poison(recv, count * es);
        /* sendbuff is only read on the root: pass NULL elsewhere. */
        CHECK(qcclBroadcast(rank == root ? send : NULL, recv, count, t, root, comm, NULL));
        for (size_t i = 0; i < count; i++) expect("broadcast", t, recv, i, val(root, i), 0);
        if (rank == root) fill(t, recv, count, qcclSum, root, 0);
        else poison(recv, count * es);
        CHECK(qcclBroadcast(recv, recv, count, t, root, comm, NULL));
        for (size_t i = 0; i < count; i++)
            expect("broadcast in place", t, recv, i, val(root, i), 0);
    }
    free(send);
    free(recv);
}

static void test_reduce(qcclComm_t comm, int rank, int n, qcclDataType_t t, size_t count) {
    size_t es = dt_size(t);
    void* send = xmalloc(count * es);
    void* recv = xmalloc(count * es);
    int roots[2] = {n - 1, 0};
    qcclRedOp_t ops[2] = {qcclSum, qcclMax};
    for (int k = 0; k < 2; k++) {
        int root = roots[k];
        qcclRedOp_t op = ops[k];
        fill(t, send, count, op, rank, 0);
        poison(recv, count * es);
        /* recvbuff is only written on the root: pass NULL elsewhere. */
        CHECK(qcclReduce(send, rank == root ? recv : NULL, count, t, op, root, comm, NULL));
        if (rank == root)
            for (size_t i = 0; i < count; i++)
                expect("reduce", t, recv, i, reference(op, n, i), 0);
        fill(t, recv, count, op, rank, 0);
        CHECK(qcclReduce(recv, recv, count, t, op, root, comm, NULL));
        for (size_t i = 0; i < count; i++)
            expect(rank == root ? "reduce in place" : "reduce in place (non-root unchanged)", t,
                   recv, i, rank == root ? reference(op, n, i) : input(op, rank, i), 0);
    }
    free(send);
    free(recv);
}

static void test_all_gather(qcclComm_t comm, int rank, int n, qcclDataType_t t, size_t count) {
    size_t es = dt_size(t);
    void* send = xmalloc(count * es);
    void* recv = xmalloc(count * es * (size_t)n);
    fill(t, send, count, qcclSum, rank, 0);
    poison(recv, count * es * (size_t)n);
    CHECK(qcclAllGather(send, recv, count, t, comm, NULL));
    for (int r = 0; r < n; r++)
        for (size_t i = 0; i < count; i++)
            expect("all_gather", t, recv, (size_t)r * count + i, val(r, i), 0);
    /* In place: this rank's part already sits at part `rank` of recvbuff. */
    poison(recv, count * es * (size_t)n);
    char* mine = (char*)recv + (size_t)rank * count * es;
    fill(t, mine, count, qcclSum, rank, 0);
    CHECK(qcclAllGather(mine, recv, count, t, comm, NULL));
    for (int r = 0; r < n; r++)
        for (size_t i = 0; i < count; i++)
            expect("all_gather in place", t, recv, (size_t)r * count + i, val(r, i), 0);
    free(send);
    free(recv);
}

static void test_reduce_scatter(qcclComm_t comm, int rank, int n, qcclDataType_t t,
                                size_t count) {
    size_t es = dt_size(t);
    size_t total = count * (size_t)n;
    void* send = xmalloc(total * es);
    void* recv = xmalloc(count * es);
    fill(t, send, total, qcclSum, rank, 0);
    poison(recv, count * es);
    CHECK(qcclReduceScatter(send, recv, count, t, qcclSum, comm, NULL));
    for (size_t i = 0; i < count; i++)
        expect("reduce_scatter", t, recv, i, reference(qcclSum, n, (size_t)rank * count + i), 0);
    /* In place: recvbuff = sendbuff + rank*recvcount. */
    fill(t, send, total, qcclMin, rank, 0);
    char* part = (char*)send + (size_t)rank * count * es;
    CHECK(qcclReduceScatter(send, part, count, t, qcclMin, comm, NULL));
    for (size_t i = 0; i < count; i++)
        expect("reduce_scatter in place", t, part, i,
               reference(qcclMin, n, (size_t)rank * count + i), 0);
    free(send);
    free(recv);
}

static void test_alltoall(qcclComm_t comm, int rank, int n, qcclDataType_t t, size_t count) {
    size_t es = dt_size(t);
    size_t total = count * (size_t)n;
    void* send = xmalloc(total * es);
    void* recv = xmalloc(total * es);
    /* Part p of rank r's sendbuff is val(r, p*count + i). */
    fill(t, send, total, qcclSum, rank, 0);
    poison(recv, total * es);
    CHECK(qcclAlltoAll(send, recv, count, t, comm, NULL));
    for (int q = 0; q < n; q++)
        for (size_t i = 0; i < count; i++)
            expect("alltoall", t, recv, (size_t)q * count + i, val(q, (size_t)rank * count + i), 0);
    CHECK(qcclAlltoAll(send, send, count, t, comm, NULL));
    for (int q = 0; q < n; q++)
        for (size_t i = 0; i < count; i++)
            expect("alltoall in place", t, send, (size_t)q * count + i,
                   val(q, (size_t)rank * count + i), 0);
    free(send);
    free(recv);
}

static void test_p2p(qcclComm_t comm, int rank, int n) {
    int next = (rank + 1) % n, prev = (rank + n - 1) % n;
    /* Blocking, outside a group: even ranks send first, odd ranks receive first. 8 MiB, so
     * one frame is larger than a transport's buffers (socket buffers, shared-memory ring). */
    size_t count = (2u << 20) + 3;
    int32_t* a = (int32_t*)xmalloc(count * 4);
    int32_t* b = (int32_t*)xmalloc(count * 4);
    for (size_t i = 0; i < count; i++) a[i] = (int32_t)(rank * 10000000 + (int)i);
    poison(b, count * 4);
    if (rank % 2 == 0) {
        CHECK(qcclSend(a, count, qcclInt32, next, comm, NULL));
        CHECK(qcclRecv(b, count, qcclInt32, prev, comm, NULL));
    } else {
        CHECK(qcclRecv(b, count, qcclInt32, prev, comm, NULL));
        CHECK(qcclSend(a, count, qcclInt32, next, comm, NULL));
    }
    for (size_t i = 0; i < count; i++)
        if (b[i] != (int32_t)(prev * 10000000 + (int)i)) FAIL("recv: element %zu is %d", i, b[i]);
    free(a);
    free(b);

    /* Grouped: every rank sends, then receives, a large message around the ring (64 MiB
     * when two ranks just swap: both send first, which must not deadlock). */
    size_t big = (n == 2 ? (64u << 20) : (4u << 20)) / sizeof(float);
    float* s = (float*)xmalloc(big * sizeof(float));
    float* r = (float*)xmalloc(big * sizeof(float));
    for (size_t i = 0; i < big; i++) s[i] = (float)(rank + 1) * 0.5f + (float)(i % 1000);
    poison(r, big * sizeof(float));
    CHECK(qcclGroupStart());
    CHECK(qcclSend(s, big, qcclFloat32, next, comm, NULL));
    CHECK(qcclRecv(r, big, qcclFloat32, prev, comm, NULL));
    CHECK(qcclGroupEnd());
    for (size_t i = 0; i < big; i++)
        if (r[i] != (float)(prev + 1) * 0.5f + (float)(i % 1000))
            FAIL("grouped recv: element %zu is %g", i, (double)r[i]);
    free(s);
    free(r);

    /* All-to-all made of grouped sends and receives to every rank, this one included, with
     * a different count per pair (the way frameworks write all-to-all-v). */
    size_t* sc = (size_t*)xmalloc(sizeof(size_t) * (size_t)n);
    int64_t** out = (int64_t**)xmalloc(sizeof(void*) * (size_t)n);
    int64_t** in = (int64_t**)xmalloc(sizeof(void*) * (size_t)n);
    CHECK(qcclGroupStart());
    for (int p = 0; p < n; p++) {
        size_t c_out = 100 + 13 * (size_t)rank + 7 * (size_t)p; /* rank -> p */
        size_t c_in = 100 + 13 * (size_t)p + 7 * (size_t)rank;  /* p -> rank */
        sc[p] = c_in;
        out[p] = (int64_t*)xmalloc(c_out * 8);
        in[p] = (int64_t*)xmalloc(c_in * 8);
        for (size_t i = 0; i < c_out; i++) out[p][i] = (int64_t)rank * 1000000 + p * 1000 + (int64_t)i;
        poison(in[p], c_in * 8);
        CHECK(qcclRecv(in[p], c_in, qcclInt64, p, comm, NULL));
        CHECK(qcclSend(out[p], c_out, qcclInt64, p, comm, NULL));
    }
    CHECK(qcclGroupEnd());
    for (int p = 0; p < n; p++) {
        for (size_t i = 0; i < sc[p]; i++)
            if (in[p][i] != (int64_t)p * 1000000 + rank * 1000 + (int64_t)i)
                FAIL("all-to-all-v from %d: element %zu is %lld", p, i, (long long)in[p][i]);
        free(in[p]);
        free(out[p]);
    }
    free(sc);
    free(in);
    free(out);
}

static void test_split(qcclComm_t comm, int rank, int n) {
    qcclComm_t sub = NULL;
    int color = rank % 2;
    /* key = -rank: the new ranks run in reverse order of the old ones. */
    CHECK(qcclCommSplit(comm, color, -rank, &sub));
    if (!sub) FAIL("split returned no comm");
    int members = (n - color + 1) / 2, subrank = -1, subsize = -1;
    CHECK(qcclCommCount(sub, &subsize));
    CHECK(qcclCommUserRank(sub, &subrank));
    if (subsize != members) FAIL("split: size %d, expected %d", subsize, members);
    int expected_rank = members - 1 - rank / 2;
    if (subrank != expected_rank) FAIL("split: rank %d, expected %d", subrank, expected_rank);
    float x = (float)rank, sum = 0;
    CHECK(qcclAllReduce(&x, &sum, 1, qcclFloat32, qcclSum, sub, NULL));
    float want = 0;
    for (int r = color; r < n; r += 2) want += (float)r;
    if (sum != want) FAIL("split all_reduce: %g, expected %g", (double)sum, (double)want);
    CHECK(qcclCommDestroy(sub));

    /* QCCL_SPLIT_NOCOLOR: rank 0 takes no part. */
    qcclComm_t rest = (qcclComm_t)&rest;
    CHECK(qcclCommSplit(comm, rank == 0 ? QCCL_SPLIT_NOCOLOR : 0, 0, &rest));
    if (rank == 0) {
        if (rest != NULL) FAIL("NOCOLOR split returned a comm");
    } else {
        int sz = 0;
        CHECK(qcclCommCount(rest, &sz));
        if (sz != n - 1) FAIL("split without rank 0: size %d", sz);
        CHECK(qcclCommDestroy(rest));
    }
}

static void test_nonblocking(qcclComm_t comm, int rank, int n) {
    size_t count = 50000;
    float* ar = (float*)xmalloc(count * 4);
    float* rs_in = (float*)xmalloc(count * (size_t)n * 4);
    float* rs_out = (float*)xmalloc(count * 4);
    int32_t* ag_in = (int32_t*)xmalloc(count * 4);
    int32_t* ag_out = (int32_t*)xmalloc(count * (size_t)n * 4);
    for (size_t i = 0; i < count; i++) {
        ar[i] = (float)val(rank, i);
        ag_in[i] = (int32_t)val(rank, i);
    }
    for (size_t i = 0; i < count * (size_t)n; i++) rs_in[i] = (float)val(rank, i);
    qcclRequest_t req[3];
    CHECK(qcclIAllReduce(ar, ar, count, qcclFloat32, qcclSum, comm, &req[0]));
    CHECK(qcclIReduceScatter(rs_in, rs_out, count, qcclFloat32, qcclSum, comm, &req[1]));
    CHECK(qcclIAllGather(ag_in, ag_out, count, qcclInt32, comm, &req[2]));
    int done = 0, polls = 0;
    while (!done) {
        CHECK(qcclTest(req[2], &done));
        polls++;
        if (!done) usleep(100);
    }
    /* Finished requests still need qcclWait, which frees them. */
    for (int k = 0; k < 3; k++) CHECK(qcclWait(req[k]));
    for (size_t i = 0; i < count; i++) {
        expect("iall_reduce", qcclFloat32, ar, i, reference(qcclSum, n, i), 0);
        expect("ireduce_scatter", qcclFloat32, rs_out, i,
               reference(qcclSum, n, (size_t)rank * count + i), 0);
    }
    for (int r = 0; r < n; r++)
        for (size_t i = 0; i < count; i++)
            expect("iall_gather", qcclInt32, ag_out, (size_t)r * count + i, val(r, i), 0);
    (void)polls;
    free(ar);
    free(rs_in);
    free(rs_out);
    free(ag_in);
    free(ag_out);
}

/* FNV-1a over the bytes: compares results across ranks. */
static uint64_t fnv(const void* p, size_t n) {
    const unsigned char* b = (const unsigned char*)p;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* Relative L2 error of out against the float64 reference of val() summed over ranks. */
static double rel_err(const float* out, size_t count, int n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < count; i++) {
        double e = reference(qcclSum, n, i);
        num += ((double)out[i] - e) * ((double)out[i] - e);
        den += e * e;
    }
    return den > 0 ? sqrt(num / den) : 0;
}

static void same_everywhere(qcclComm_t comm, int n, const float* buf, size_t count, const char* what) {
    uint64_t mine = fnv(buf, count * 4);
    uint64_t* all = (uint64_t*)xmalloc(8 * (size_t)n);
    CHECK(qcclAllGather(&mine, all, 1, qcclUint64, comm, NULL));
    for (int r = 0; r < n; r++)
        if (all[r] != mine) FAIL("%s: rank %d ended with different bits", what, r);
    free(all);
}

static void test_compressed(qcclComm_t comm, int rank, int n) {
    size_t count = 100003;
    float* s = (float*)xmalloc(count * 4);
    float* r = (float*)xmalloc(count * 4);
    for (size_t i = 0; i < count; i++) s[i] = (float)val(rank, i);
    qcclCodec_t q8, topk;
    CHECK(qcclCodecCreate("qsgd:bits=8,bucket=128", &q8));
    CHECK(qcclCodecCreate("topk:density=0.05,ef=1", &topk));

    /* Blocking, out of place then in place. */
    poison(r, count * 4);
    CHECK(qcclAllReduceCompressed(s, r, count, qcclFloat32, qcclSum, q8, 1, comm, NULL));
    double e = rel_err(r, count, n);
    if (!(e < 0.02)) FAIL("compressed all_reduce: relative error %g", e);
    same_everywhere(comm, n, r, count, "compressed all_reduce");
    for (size_t i = 0; i < count; i++) r[i] = (float)val(rank, i);
    CHECK(qcclAllReduceCompressed(r, r, count, qcclFloat32, qcclSum, q8, 2, comm, NULL));
    if (!(rel_err(r, count, n) < 0.02)) FAIL("in-place compressed all_reduce");

    /* Grouped and non-blocking. */
    float* r2 = (float*)xmalloc(count * 4);
    CHECK(qcclGroupStart());
    CHECK(qcclAllReduceCompressed(s, r, count, qcclFloat32, qcclSum, topk, 3, comm, NULL));
    CHECK(qcclGroupEnd());
    same_everywhere(comm, n, r, count, "grouped top-k");
    if (!(rel_err(r, count, n) < 1.0)) FAIL("grouped top-k all_reduce");
    qcclRequest_t req;
    CHECK(qcclIAllReduceCompressed(s, r2, count, qcclFloat32, qcclSum, q8, 4, comm, &req));
    CHECK(qcclWait(req));
    if (!(rel_err(r2, count, n) < 0.02)) FAIL("non-blocking compressed all_reduce");
    same_everywhere(comm, n, r2, count, "non-blocking compressed all_reduce");

    /* A layout: the "bias" layer travels uncompressed, so it is exact. */
    const char* names[2] = {"fc.weight", "fc.bias"};
    size_t counts[2] = {count - 1000, 1000};
    CHECK(qcclCommSetLayout(comm, 2, names, counts));
    CHECK(qcclCommExcludeLayers(comm, "bias"));
    CHECK(qcclAllReduceCompressed(s, r, count, qcclFloat32, qcclSum, q8, 5, comm, NULL));
    for (size_t i = count - 1000; i < count; i++)
        expect("layout bias", qcclFloat32, r, i, reference(qcclSum, n, i), 0);
    if (!(rel_err(r, count, n) < 0.02)) FAIL("layered compressed all_reduce");
    CHECK(qcclCommSetLayout(comm, 0, NULL, NULL));

    /* HiTopKComm: density 1 keeps everything (the exact sum of these small integers);
     * density 0.05 is sparse, bit-identical everywhere; in place works too. */
    CHECK(qcclHiTopKAllReduce(s, r, count, qcclFloat32, 1.0f, 10, comm, NULL));
    for (size_t i = 0; i < count; i++)
        expect("hitopk density 1", qcclFloat32, r, i, reference(qcclSum, n, i), 0);
    CHECK(qcclHiTopKAllReduce(s, r, count, qcclFloat32, 0.05f, 11, comm, NULL));
    same_everywhere(comm, n, r, count, "hitopk");
    /* All ranks share one host here: HiTopK keeps the top 5% of each rank's slice of the exact
     * sum (these small integers add exactly in float) and zeroes the rest. */
    size_t nonzero = 0;
    for (size_t i = 0; i < count; i++) {
        nonzero += r[i] != 0.0f;
        if (r[i] != 0.0f && (double)r[i] != reference(qcclSum, n, i))
            FAIL("hitopk density 0.05: [%zu] = %g, the sum is %g", i, (double)r[i],
                 reference(qcclSum, n, i));
    }
    if (nonzero == 0 || nonzero > count / 10) FAIL("hitopk density 0.05: %zu non-zeros", nonzero);
    for (size_t i = 0; i < count; i++) r[i] = (float)val(rank, i);
    CHECK(qcclHiTopKAllReduce(r, r, count, qcclFloat32, 1.0f, 12, comm, NULL));
    for (size_t i = 0; i < count; i++)
        expect("in-place hitopk", qcclFloat32, r, i, reference(qcclSum, n, i), 0);

    CHECK(qcclCodecDestroy(q8));
    CHECK(qcclCodecDestroy(topk));
    free(s);
    free(r);
    free(r2);
}

static int body(int rank, int nranks, qcclUniqueId id) {
    qcclComm_t comm;
    CHECK(qcclCommInitRank(&comm, nranks, id, rank));
    int n = 0, r = -1;
    CHECK(qcclCommCount(comm, &n));
    CHECK(qcclCommUserRank(comm, &r));
    if (n != nranks || r != rank) FAIL("count/rank %d/%d, expected %d/%d", n, r, nranks, rank);
    for (size_t ti = 0; ti < NTYPES; ti++) {
        for (size_t ci = 0; ci < NCOUNTS; ci++) {
            qcclDataType_t t = TYPES[ti];
            size_t count = COUNTS[ci];
            test_all_reduce(comm, rank, n, t, count);
            if (count > 20000) continue; /* the rest at moderate sizes */
            test_broadcast(comm, rank, n, t, count);
            test_reduce(comm, rank, n, t, count);
            test_all_gather(comm, rank, n, t, count);
            test_reduce_scatter(comm, rank, n, t, count);
            test_alltoall(comm, rank, n, t, count);
        }
    }
    test_all_reduce(comm, rank, n, qcclFloat64, 3001);
    test_p2p(comm, rank, n);
    test_split(comm, rank, n);
    test_nonblocking(comm, rank, n);
    test_compressed(comm, rank, n);
    qcclResult_t async = qcclInternalError;
    CHECK(qcclCommGetAsyncError(comm, &async));
    if (async != qcclSuccess) FAIL("async error %d", (int)async);
    CHECK(qcclCommDestroy(comm));
    return 0;
}

int main(int argc, char** argv) {
    int nranks = argc > 1 ? atoi(argv[1]) : 2;
    if (nranks < 1 || nranks > 16) FAIL("usage: %s NRANKS", argv[0]);
    int failed = run_ranks(nranks, body);
    printf("collectives on %d processes: %s\n", nranks, failed ? "FAILED" : "ok");
    return failed;
}
