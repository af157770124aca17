/* Every bad-argument case of the C ABI: each returns its code and qcclGetLastError names the
 * problem; nothing crashes, and the comm stays usable after argument errors. One process. */
#include <stdint.h>

#include "common.h"

static int checks = 0;
/* While set (outside open groups), every expected error is followed by a good grouped
 * all-reduce on both comms of the pair: an argument error must leave the comm usable. */
static qcclComm_t* g_pair = NULL;
static void good_call(qcclComm_t* pair);
#define ERR(call, code, comm, needle)             \
    do {                                          \
        EXPECT_ERR(call, code, comm, needle);     \
        checks++;                                 \
        if (g_pair) good_call(g_pair);            \
    } while (0)

/* A grouped all-reduce over the two comms of qcclCommInitAll (one thread drives both), with
 * its result checked; neither comm may report an async error. */
static void good_call(qcclComm_t* pair) {
    float x[2][5], y[2][5];
    for (int r = 0; r < 2; r++)
        for (int i = 0; i < 5; i++) x[r][i] = (float)(r + 1) * (float)(i + 1);
    CHECK(qcclGroupStart());
    for (int r = 0; r < 2; r++) CHECK(qcclAllReduce(x[r], y[r], 5, qcclFloat32, qcclSum, pair[r], NULL));
    CHECK(qcclGroupEnd());
    for (int r = 0; r < 2; r++) {
        for (int i = 0; i < 5; i++)
            if (y[r][i] != 3.0f * (float)(i + 1)) FAIL("good call after an error: rank %d [%d] = %g", r, i, (double)y[r][i]);
        qcclResult_t async = qcclInternalError;
        CHECK(qcclCommGetAsyncError(pair[r], &async));
        if (async != qcclSuccess) FAIL("an argument error failed comm %d (%d): %s", r, (int)async, qcclGetLastError(pair[r]));
    }
}

static void strings(void) {
    const char* seen[10];
    for (int c = 0; c <= 9; c++) {
        const char* s = qcclGetErrorString((qcclResult_t)c);
        if (!s || !*s || strstr(s, "unknown")) FAIL("qcclGetErrorString(%d) = \"%s\"", c, s ? s : "");
        for (int k = 0; k < c; k++)
            if (!strcmp(seen[k], s)) FAIL("codes %d and %d share a string", k, c);
        seen[c] = s;
    }
    if (!strstr(qcclGetErrorString((qcclResult_t)42), "unknown")) FAIL("code 42 is not unknown");
    if (!strstr(qcclGetErrorString(qcclInvalidArgument), "invalid argument")) FAIL("invalid arg string");
    int v = 0;
    CHECK(qcclGetVersion(&v));
    if (v != QCCL_VERSION_CODE || v != QCCL_VERSION(QCCL_MAJOR, QCCL_MINOR, QCCL_PATCH))
        FAIL("version %d, header says %d", v, QCCL_VERSION_CODE);
    if (sizeof(qcclUniqueId) != QCCL_UNIQUE_ID_BYTES || QCCL_UNIQUE_ID_BYTES != 128)
        FAIL("unique id size");
}

static void init_errors(void) {
    qcclComm_t c = (qcclComm_t)&c;
    qcclUniqueId id;
    memset(&id, 0, sizeof id);
    ERR(qcclGetVersion(NULL), qcclInvalidArgument, NULL, "version is NULL");
    ERR(qcclGetUniqueId(NULL), qcclInvalidArgument, NULL, "uniqueId is NULL");
    ERR(qcclCommInitRank(NULL, 2, id, 0), qcclInvalidArgument, NULL, "comm is NULL");
    ERR(qcclCommInitRank(&c, 0, id, 0), qcclInvalidArgument, NULL, "nranks is 0");
    if (c != NULL) FAIL("a failed qcclCommInitRank left *comm set");
    ERR(qcclCommInitRank(&c, -3, id, 0), qcclInvalidArgument, NULL, "nranks is -3");
    ERR(qcclCommInitRank(&c, 2, id, 2), qcclInvalidArgument, NULL, "rank 2 is out of range");
    ERR(qcclCommInitRank(&c, 2, id, -1), qcclInvalidArgument, NULL, "rank -1 is out of range");
    ERR(qcclCommInitRank(&c, 2, id, 0), qcclInvalidArgument, NULL, "not a qccl unique id");
    ERR(qcclCommInitAll(NULL, 2, NULL), qcclInvalidArgument, NULL, "comms is NULL");
    ERR(qcclCommInitAll(&c, 0, NULL), qcclInvalidArgument, NULL, "ndev is 0");
    ERR(qcclCommInitFromEnv(NULL), qcclInvalidArgument, NULL, "comm is NULL");
    const char* launcher_vars[] = {"QCCL_RANK", "QCCL_WORLD_SIZE", "RANK", "WORLD_SIZE",
                                   "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK",
                                   "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS"};
    for (size_t i = 0; i < sizeof launcher_vars / sizeof launcher_vars[0]; i++)
        unsetenv(launcher_vars[i]);
    ERR(qcclCommInitFromEnv(&c), qcclInvalidArgument, NULL, "no launcher variables");
    if (c != NULL) FAIL("a failed qcclCommInitFromEnv left *comm set");
    setenv("QCCL_ALGO", "bogus", 1); /* configuration errors are argument errors too */
    ERR(qcclCommInitAll(&c, 1, NULL), qcclInvalidArgument, NULL, "QCCL_ALGO");
    unsetenv("QCCL_ALGO");
}

static void handle_errors(qcclComm_t live) {
    float x = 1, y = 0;
    qcclComm_t dead;
    CHECK(qcclCommInitAll(&dead, 1, NULL));
    CHECK(qcclCommDestroy(dead));
    qcclComm_t invented = (qcclComm_t)(uintptr_t)0x1234560;
    ERR(qcclAllReduce(&x, &y, 1, qcclFloat32, qcclSum, NULL, NULL), qcclInvalidArgument, NULL,
        "comm is NULL");
    ERR(qcclAllReduce(&x, &y, 1, qcclFloat32, qcclSum, dead, NULL), qcclInvalidUsage, dead,
        "not a live communicator");
    ERR(qcclAllReduce(&x, &y, 1, qcclFloat32, qcclSum, invented, NULL), qcclInvalidUsage, NULL,
        "not a live communicator");
    ERR(qcclCommDestroy(dead), qcclInvalidUsage, NULL, "not a live communicator");
    ERR(qcclCommAbort(dead), qcclInvalidUsage, NULL, "not a live communicator");
    int n;
    ERR(qcclCommCount(dead, &n), qcclInvalidUsage, NULL, "not a live communicator");
    ERR(qcclCommUserRank(invented, &n), qcclInvalidUsage, NULL, "not a live communicator");
    qcclComm_t child = (qcclComm_t)&child;
    ERR(qcclCommSplit(dead, 0, 0, &child), qcclInvalidUsage, NULL, "not a live communicator");
    if (child != NULL) FAIL("a failed split left *newcomm set");
    ERR(qcclSend(&x, 1, qcclFloat32, 0, dead, NULL), qcclInvalidUsage, NULL, "not a live");
    qcclRequest_t req = (qcclRequest_t)&req;
    ERR(qcclIAllReduce(&x, &y, 1, qcclFloat32, qcclSum, dead, &req), qcclInvalidUsage, NULL,
        "not a live");
    if (req != NULL) FAIL("a failed qcclIAllReduce left *request set");
    qcclResult_t a;
    ERR(qcclCommGetAsyncError(dead, &a), qcclInvalidUsage, NULL, "not a live");
    CHECK(qcclCommDestroy(NULL)); /* like free(NULL) */

    /* Out pointers of the queries. */
    ERR(qcclCommCount(live, NULL), qcclInvalidArgument, live, "count is NULL");
    ERR(qcclCommUserRank(live, NULL), qcclInvalidArgument, live, "rank is NULL");
    ERR(qcclCommGetAsyncError(live, NULL), qcclInvalidArgument, live, "asyncError is NULL");
    ERR(qcclCommSplit(live, 0, 0, NULL), qcclInvalidArgument, live, "newcomm is NULL");
    qcclComm_t sub = (qcclComm_t)&sub;
    ERR(qcclCommSplit(live, -5, 0, &sub), qcclInvalidArgument, live, "color -5");
    if (sub != NULL) FAIL("a failed split left *newcomm set");
}

/* c2: rank 0 of a comm of 2 (the pair, both driven from this thread): each bad call is made
 * on c2 alone and fails before moving a byte; a good grouped call on both follows it. */
static void argument_errors(qcclComm_t* pair) {
    qcclComm_t c2 = pair[0];
    g_pair = pair;
    float a[64], b[64];
    void* s = a;
    void* r = b;
    size_t huge = SIZE_MAX / 2;
    int stream_obj;
    qcclStream_t stream = &stream_obj;

    /* NULL buffers with count > 0, for every collective. */
    ERR(qcclAllReduce(NULL, r, 4, qcclFloat32, qcclSum, c2, NULL), qcclInvalidArgument, c2, "sendbuff is NULL");
    ERR(qcclAllReduce(s, NULL, 4, qcclFloat32, qcclSum, c2, NULL), qcclInvalidArgument, c2, "recvbuff is NULL");
    ERR(qcclBroadcast(s, NULL, 4, qcclFloat32, 0, c2, NULL), qcclInvalidArgument, c2, "recvbuff is NULL");
    ERR(qcclBroadcast(NULL, r, 4, qcclFloat32, 0, c2, NULL), qcclInvalidArgument, c2, "sendbuff (on the root) is NULL");
    ERR(qcclReduce(NULL, r, 4, qcclFloat32, qcclSum, 0, c2, NULL), qcclInvalidArgument, c2, "sendbuff is NULL");
    ERR(qcclReduce(s, NULL, 4, qcclFloat32, qcclSum, 0, c2, NULL), qcclInvalidArgument, c2, "recvbuff (on the root) is NULL");
    ERR(qcclAllGather(NULL, r, 4, qcclFloat32, c2, NULL), qcclInvalidArgument, c2, "sendbuff is NULL");
    ERR(qcclAllGather(s, NULL, 4, qcclFloat32, c2, NULL), qcclInvalidArgument, c2, "recvbuff is NULL");
    ERR(qcclReduceScatter(NULL, r, 4, qcclFloat32, qcclSum, c2, NULL), qcclInvalidArgument, c2, "sendbuff is NULL");
    ERR(qcclReduceScatter(s, NULL, 4, qcclFloat32, qcclSum, c2, NULL), qcclInvalidArgument, c2, "recvbuff is NULL");
    ERR(qcclAlltoAll(NULL, r, 4, qcclFloat32, c2, NULL), qcclInvalidArgument, c2, "sendbuff is NULL");
    ERR(qcclAlltoAll(s, NULL, 4, qcclFloat32, c2, NULL), qcclInvalidArgument, c2, "recvbuff is NULL");
    ERR(qcclSend(NULL, 4, qcclFloat32, 1, c2, NULL), qcclInvalidArgument, c2, "sendbuff is NULL");
    ERR(qcclRecv(NULL, 4, qcclFloat32, 1, c2, NULL), qcclInvalidArgument, c2, "recvbuff is NULL");

    /* Unknown enum values. */
    ERR(qcclAllReduce(s, r, 4, (qcclDataType_t)10, qcclSum, c2, NULL), qcclInvalidArgument, c2, "unknown datatype 10");
    ERR(qcclAllReduce(s, r, 4, (qcclDataType_t)-1, qcclSum, c2, NULL), qcclInvalidArgument, c2, "unknown datatype -1");
    ERR(qcclAllReduce(s, r, 4, qcclFloat32, (qcclRedOp_t)5, c2, NULL), qcclInvalidArgument, c2, "unknown reduction op 5");
    ERR(qcclReduce(s, r, 4, qcclFloat32, (qcclRedOp_t)-7, 0, c2, NULL), qcclInvalidArgument, c2, "unknown reduction op -7");
    ERR(qcclReduceScatter(s, r, 4, qcclInt32, (qcclRedOp_t)99, c2, NULL), qcclInvalidArgument, c2, "unknown reduction op");
    ERR(qcclBroadcast(s, r, 4, (qcclDataType_t)77, 0, c2, NULL), qcclInvalidArgument, c2, "unknown datatype 77");
    ERR(qcclAllGather(s, r, 4, (qcclDataType_t)12, c2, NULL), qcclInvalidArgument, c2, "unknown datatype");
    ERR(qcclAlltoAll(s, r, 4, (qcclDataType_t)12, c2, NULL), qcclInvalidArgument, c2, "unknown datatype");
    ERR(qcclSend(s, 4, (qcclDataType_t)12, 1, c2, NULL), qcclInvalidArgument, c2, "unknown datatype");
    ERR(qcclRecv(r, 4, (qcclDataType_t)12, 1, c2, NULL), qcclInvalidArgument, c2, "unknown datatype");
    ERR(qcclAllReduce(s, r, 4, qcclInt32, qcclAvg, c2, NULL), qcclInvalidArgument, c2, "avg needs a floating-point datatype");

    /* count * element size (* nranks) overflows. */
    ERR(qcclAllReduce(s, r, huge, qcclFloat32, qcclSum, c2, NULL), qcclInvalidArgument, c2, "overflows");
    ERR(qcclAllReduce(s, r, SIZE_MAX, qcclInt8, qcclSum, c2, NULL), qcclInvalidArgument, c2, "overflows");
    ERR(qcclBroadcast(s, r, huge, qcclFloat64, 0, c2, NULL), qcclInvalidArgument, c2, "overflows");
    ERR(qcclReduce(s, r, huge, qcclFloat32, qcclSum, 0, c2, NULL), qcclInvalidArgument, c2, "overflows");
    ERR(qcclAllGather(s, r, SIZE_MAX / 4, qcclFloat16, c2, NULL), qcclInvalidArgument, c2, "overflows");
    ERR(qcclReduceScatter(s, r, SIZE_MAX / 4, qcclFloat16, qcclSum, c2, NULL), qcclInvalidArgument, c2, "× 2 ranks");
    ERR(qcclAlltoAll(s, r, SIZE_MAX / 3, qcclUint8, c2, NULL), qcclInvalidArgument, c2, "overflows");
    ERR(qcclSend(s, huge, qcclFloat32, 1, c2, NULL), qcclInvalidArgument, c2, "overflows");
    ERR(qcclRecv(r, huge, qcclFloat32, 1, c2, NULL), qcclInvalidArgument, c2, "overflows");

    /* Root and peer out of range. */
    ERR(qcclBroadcast(s, r, 4, qcclFloat32, 2, c2, NULL), qcclInvalidArgument, c2, "root 2 is out of range");
    ERR(qcclBroadcast(s, r, 4, qcclFloat32, -1, c2, NULL), qcclInvalidArgument, c2, "root -1 is out of range");
    ERR(qcclReduce(s, r, 4, qcclFloat32, qcclSum, 7, c2, NULL), qcclInvalidArgument, c2, "root 7 is out of range");
    ERR(qcclSend(s, 4, qcclFloat32, 2, c2, NULL), qcclInvalidArgument, c2, "peer 2 is out of range");
    ERR(qcclRecv(r, 4, qcclFloat32, -1, c2, NULL), qcclInvalidArgument, c2, "peer -1 is out of range");
    /* A peer that is this rank: refused outside a group, on either side (the core's rule). */
    ERR(qcclSend(s, 4, qcclFloat32, 0, c2, NULL), qcclInvalidArgument, c2, "cannot send to or from itself outside a group");
    ERR(qcclRecv(r, 4, qcclFloat32, 0, c2, NULL), qcclInvalidArgument, c2, "qcclRecv: invalid argument: peer 0 is this rank");

    /* Overlapping buffers that are not NCCL's in-place layout. */
    ERR(qcclAllReduce(a, a + 1, 4, qcclFloat32, qcclSum, c2, NULL), qcclInvalidArgument, c2, "overlap");
    ERR(qcclReduce(a + 2, a, 4, qcclFloat32, qcclSum, 0, c2, NULL), qcclInvalidArgument, c2, "overlap");
    ERR(qcclBroadcast(a + 2, a, 4, qcclFloat32, 0, c2, NULL), qcclInvalidArgument, c2, "overlap");
    ERR(qcclAllGather(a + 1, a, 4, qcclFloat32, c2, NULL), qcclInvalidArgument, c2, "overlap");
    ERR(qcclReduceScatter(a, a + 1, 4, qcclFloat32, qcclSum, c2, NULL), qcclInvalidArgument, c2, "overlap");
    ERR(qcclAlltoAll(a, a + 3, 4, qcclFloat32, c2, NULL), qcclInvalidArgument, c2, "overlap");

    /* A stream on a machine without a CUDA driver: refused, saying why. */
    ERR(qcclAllReduce(s, r, 4, qcclFloat32, qcclSum, c2, stream), qcclUnsupported, c2, "pass NULL");
    ERR(qcclBroadcast(s, r, 4, qcclFloat32, 0, c2, stream), qcclUnsupported, c2, "pass NULL");
    ERR(qcclReduce(s, r, 4, qcclFloat32, qcclSum, 0, c2, stream), qcclUnsupported, c2, "pass NULL");
    ERR(qcclAllGather(s, r, 4, qcclFloat32, c2, stream), qcclUnsupported, c2, "pass NULL");
    ERR(qcclReduceScatter(s, r, 4, qcclFloat32, qcclSum, c2, stream), qcclUnsupported, c2, "pass NULL");
    ERR(qcclAlltoAll(s, r, 4, qcclFloat32, c2, stream), qcclUnsupported, c2, "pass NULL");
    ERR(qcclSend(s, 4, qcclFloat32, 1, c2, stream), qcclUnsupported, c2, "pass NULL");
    ERR(qcclRecv(r, 4, qcclFloat32, 1, c2, stream), qcclUnsupported, c2, "pass NULL");

    /* Non-blocking forms. */
    qcclRequest_t req = (qcclRequest_t)&req;
    ERR(qcclIAllReduce(s, r, 4, qcclFloat32, qcclSum, c2, NULL), qcclInvalidArgument, c2, "request is NULL");
    ERR(qcclIAllReduce(NULL, r, 4, qcclFloat32, qcclSum, c2, &req), qcclInvalidArgument, c2, "sendbuff is NULL");
    if (req != NULL) FAIL("failed qcclIAllReduce left *request set");
    ERR(qcclIReduceScatter(s, r, 4, qcclFloat32, (qcclRedOp_t)9, c2, &req), qcclInvalidArgument, c2, "unknown reduction op 9");
    ERR(qcclIAllGather(s, r, huge, qcclFloat32, c2, &req), qcclInvalidArgument, c2, "overflows");
    ERR(qcclIAllGather(s, r, 4, qcclFloat32, NULL, &req), qcclInvalidArgument, NULL, "comm is NULL");
    ERR(qcclIReduceScatter(s, r, 4, qcclInt32, qcclAvg, c2, &req), qcclInvalidArgument, c2, "avg needs a floating-point datatype");
    ERR(qcclIAllReduce(s, r, huge, qcclFloat32, qcclSum, c2, &req), qcclInvalidArgument, c2, "overflows");
    if (req != NULL) FAIL("a refused non-blocking call left *request set");
    ERR(qcclWait(NULL), qcclInvalidArgument, NULL, "request is NULL");
    ERR(qcclWait((qcclRequest_t)(uintptr_t)0x51430000abc0), qcclInvalidUsage, NULL, "not live");
    int done = 0;
    ERR(qcclTest(NULL, &done), qcclInvalidArgument, NULL, "request is NULL");
    ERR(qcclTest((qcclRequest_t)&done, &done), qcclInvalidUsage, NULL, "not live");

    /* Shrink: comms of threads cannot lose a rank; refused before anything moves. */
    qcclComm_t shrunk = (qcclComm_t)&shrunk;
    ERR(qcclCommShrink(c2, NULL, 0, &shrunk), qcclUnsupported, c2, "comms of threads");
    if (shrunk != NULL) FAIL("a failed qcclCommShrink left *newcomm set");
    ERR(qcclCommShrink(c2, NULL, 0, NULL), qcclInvalidArgument, c2, "newcomm is NULL");

    /* Groups (no good call inside the open group: it would join it). */
    ERR(qcclGroupEnd(), qcclInvalidUsage, NULL, "without a matching qcclGroupStart");
    g_pair = NULL;
    CHECK(qcclGroupStart());
    ERR(qcclIAllReduce(s, r, 4, qcclFloat32, qcclSum, c2, &req), qcclInvalidUsage, c2, "non-blocking calls cannot");
    qcclComm_t child = NULL;
    ERR(qcclCommSplit(c2, 0, 0, &child), qcclUnsupported, c2, "between qcclGroupStart and qcclGroupEnd");
    CHECK(qcclGroupEnd());
    /* Grouped calls go through the same checks; one refused call spoils its group. */
    CHECK(qcclGroupStart());
    CHECK(qcclAllReduce(s, r, 4, qcclFloat32, qcclSum, c2, NULL));
    ERR(qcclBroadcast(s, r, 4, qcclFloat32, 5, c2, NULL), qcclInvalidArgument, c2, "root 5 is out of range");
    ERR(qcclSend(s, 4, qcclFloat32, -3, c2, NULL), qcclInvalidArgument, c2, "peer -3 is out of range");
    ERR(qcclGroupEnd(), qcclInvalidArgument, NULL, "none of the 1 queued operations ran");
    g_pair = pair;
    good_call(pair);

    /* Codecs: bad specs name the field; handles are checked; codec rules before any byte. */
    qcclCodec_t codec = (qcclCodec_t)&codec;
    ERR(qcclCodecCreate("qsgd:bits=9", &codec), qcclInvalidArgument, NULL, "bits must be in 1..=8");
    if (codec != NULL) FAIL("qcclCodecCreate left *codec set");
    ERR(qcclCodecCreate("zip", &codec), qcclInvalidArgument, NULL, "unknown codec");
    ERR(qcclCodecCreate("topk", &codec), qcclInvalidArgument, NULL, "density is required");
    ERR(qcclCodecCreate(NULL, &codec), qcclInvalidArgument, NULL, "spec is NULL");
    ERR(qcclCodecCreate("topk:density=0.01", NULL), qcclInvalidArgument, NULL, "codec is NULL");
    ERR(qcclCodecDestroy(NULL), qcclInvalidArgument, NULL, "codec is NULL");
    qcclCodec_t fake = (qcclCodec_t)&fake;
    ERR(qcclCodecDestroy(fake), qcclInvalidUsage, NULL, "not a live codec");
    qcclCodec_t q4 = NULL;
    CHECK(qcclCodecCreate("qsgd:bits=4,bucket=128", &q4));
    if (q4 == NULL) FAIL("qcclCodecCreate returned NULL");
    ERR(qcclAllReduceCompressed(s, r, 4, qcclFloat32, qcclSum, fake, 7, c2, NULL), qcclInvalidUsage, c2, "not a live codec");
    ERR(qcclAllReduceCompressed(s, r, 4, qcclFloat32, qcclSum, NULL, 7, c2, NULL), qcclInvalidArgument, c2, "codec is NULL");
    ERR(qcclAllReduceCompressed(NULL, r, 4, qcclFloat32, qcclSum, q4, 7, c2, NULL), qcclInvalidArgument, c2, "sendbuff is NULL");
    ERR(qcclAllReduceCompressed(s, r, 4, (qcclDataType_t)33, qcclSum, q4, 7, c2, NULL), qcclInvalidArgument, c2, "unknown datatype 33");
    ERR(qcclAllReduceCompressed(s, r, 4, qcclInt32, qcclSum, q4, 7, c2, NULL), qcclInvalidArgument, c2, "compresses floating-point data, not int32");
    ERR(qcclAllReduceCompressed(s, r, 4, qcclFloat32, qcclMax, q4, 7, c2, NULL), qcclInvalidArgument, c2, "only sum and avg");
    ERR(qcclAllReduceCompressed(s, r, 4, qcclFloat32, qcclSum, q4, 7, NULL, NULL), qcclInvalidArgument, NULL, "comm is NULL");
    ERR(qcclAllReduceCompressed(s, r, 4, qcclFloat32, qcclSum, q4, 7, c2, stream), qcclUnsupported, c2, "pass NULL");
    ERR(qcclAllReduceCompressed(a, a + 1, 4, qcclFloat32, qcclSum, q4, 7, c2, NULL), qcclInvalidArgument, c2, "overlap");
    req = (qcclRequest_t)&req;
    ERR(qcclIAllReduceCompressed(s, r, 4, qcclFloat32, qcclSum, fake, 7, c2, &req), qcclInvalidUsage, c2, "not a live codec");
    if (req != NULL) FAIL("qcclIAllReduceCompressed left *request set");
    ERR(qcclIAllReduceCompressed(s, r, 4, qcclFloat32, qcclSum, q4, 7, c2, NULL), qcclInvalidArgument, c2, "request is NULL");
    CHECK(qcclCodecDestroy(q4));
    ERR(qcclCodecDestroy(q4), qcclInvalidUsage, NULL, "not a live codec");
    /* HiTopK: argument errors before any byte moves. */
    ERR(qcclHiTopKAllReduce(s, r, 4, qcclFloat32, 0.01f, 7, c2, stream), qcclUnsupported, c2, "pass NULL");
    ERR(qcclHiTopKAllReduce(s, r, 4, qcclFloat32, 1.5f, 7, c2, NULL), qcclInvalidArgument, c2, "density 1.5");
    ERR(qcclHiTopKAllReduce(s, NULL, 4, qcclFloat32, 0.1f, 7, c2, NULL), qcclInvalidArgument, c2, "recvbuff is NULL");
    ERR(qcclHiTopKAllReduce(s, r, 4, qcclInt32, 0.1f, 7, c2, NULL), qcclInvalidArgument, c2, "floating-point");
    const char* names[2] = {"conv1.weight", "conv1.bias"};
    const char* bad_names[2] = {"conv1.weight", NULL};
    size_t counts[2] = {4, 4};
    CHECK(qcclCommSetLayout(c2, 2, names, counts));
    CHECK(qcclCommSetLayout(c2, 0, NULL, NULL));
    ERR(qcclCommSetLayout(c2, 2, NULL, counts), qcclInvalidArgument, c2, "names is NULL");
    ERR(qcclCommSetLayout(c2, 2, names, NULL), qcclInvalidArgument, c2, "counts is NULL");
    ERR(qcclCommSetLayout(c2, 2, bad_names, counts), qcclInvalidArgument, c2, "names[1] is NULL");
    ERR(qcclCommSetLayout(c2, -1, names, counts), qcclInvalidArgument, c2, "nlayers is -1");
    ERR(qcclCommSetLayout(NULL, 2, names, counts), qcclInvalidArgument, NULL, "comm is NULL");
    CHECK(qcclCommExcludeLayers(c2, "bias|norm"));
    ERR(qcclCommExcludeLayers(c2, NULL), qcclInvalidArgument, c2, "pattern is NULL");

    /* Every error above was an argument error: the comm is not failed. */
    qcclResult_t async = qcclInternalError;
    CHECK(qcclCommGetAsyncError(c2, &async));
    if (async != qcclSuccess) FAIL("argument errors failed the comm (%d)", (int)async);
    g_pair = NULL;
}

/* An error-feedback key used again with another length starts its residual from zero (INFO
 * line); the calls succeed and the comm stays usable. */
static void key_changes_length(qcclComm_t* pair) {
    qcclCodec_t q4 = NULL;
    CHECK(qcclCodecCreate("qsgd:bits=4,bucket=128,ef=1", &q4));
    for (size_t n = 1000; n <= 2000; n += 1000) {
        float* buf[2];
        for (int r = 0; r < 2; r++) {
            buf[r] = (float*)xmalloc(n * sizeof(float));
            for (size_t i = 0; i < n; i++) buf[r][i] = 0.25f * (float)(i % 7) - 0.5f * (float)r;
        }
        CHECK(qcclGroupStart());
        for (int r = 0; r < 2; r++)
            CHECK(qcclAllReduceCompressed(buf[r], buf[r], n, qcclFloat32, qcclSum, q4, 5, pair[r], NULL));
        CHECK(qcclGroupEnd());
        if (memcmp(buf[0], buf[1], n * sizeof(float)) != 0) FAIL("key 5 at %zu: ranks differ", n);
        free(buf[0]);
        free(buf[1]);
        good_call(pair);
    }
    CHECK(qcclCodecDestroy(q4));
}

/* Per-comm and per-thread last errors. */
static void last_errors(qcclComm_t c1, qcclComm_t c2) {
    float x = 0;
    if (strlen(qcclGetLastError(c1)) != 0) FAIL("c1 has a last error: %s", qcclGetLastError(c1));
    EXPECT_ERR(qcclAllReduce(&x, &x, 1, (qcclDataType_t)50, qcclSum, c2, NULL), qcclInvalidArgument, c2, "qcclAllReduce");
    const char* p = qcclGetLastError(c2);
    /* A comm's message stays its own; the thread's follows the latest failure. */
    EXPECT_ERR(qcclBroadcast(&x, &x, 1, qcclFloat32, 9, c1, NULL), qcclInvalidArgument, c1, "qcclBroadcast: invalid argument: root 9");
    if (!strstr(qcclGetLastError(c2), "unknown datatype 50")) FAIL("c2's last error was replaced");
    if (!strstr(qcclGetLastError(NULL), "root 9")) FAIL("thread's last error: %s", qcclGetLastError(NULL));
    if (!strstr(p, "unknown datatype 50")) FAIL("an earlier qcclGetLastError string changed: %s", p);
}

/* A 1-rank comm runs every collective (and count 0 with NULL buffers) without peers. */
static void single_rank(qcclComm_t c1) {
    float a[8], b[8];
    for (int i = 0; i < 8; i++) a[i] = (float)i;
    CHECK(qcclAllReduce(a, b, 8, qcclFloat32, qcclSum, c1, NULL));
    for (int i = 0; i < 8; i++) if (b[i] != (float)i) FAIL("1-rank all_reduce");
    CHECK(qcclAllReduce(a, a, 8, qcclFloat32, qcclAvg, c1, NULL));
    CHECK(qcclBroadcast(a, b, 8, qcclFloat32, 0, c1, NULL));
    CHECK(qcclReduce(a, b, 8, qcclFloat32, qcclMax, 0, c1, NULL));
    CHECK(qcclAllGather(a, b, 8, qcclFloat32, c1, NULL));
    CHECK(qcclReduceScatter(a, b, 8, qcclFloat32, qcclSum, c1, NULL));
    CHECK(qcclAlltoAll(a, b, 8, qcclFloat32, c1, NULL));
    for (int i = 0; i < 8; i++) if (b[i] != (float)i) FAIL("1-rank alltoall");
    CHECK(qcclGroupStart());
    CHECK(qcclSend(a, 8, qcclFloat32, 0, c1, NULL));
    CHECK(qcclRecv(b, 8, qcclFloat32, 0, c1, NULL));
    CHECK(qcclGroupEnd());
    CHECK(qcclAllReduce(NULL, NULL, 0, qcclFloat32, qcclSum, c1, NULL));
    CHECK(qcclBroadcast(NULL, NULL, 0, qcclInt8, 0, c1, NULL));
    CHECK(qcclReduce(NULL, NULL, 0, qcclInt8, qcclSum, 0, c1, NULL));
    CHECK(qcclAllGather(NULL, NULL, 0, qcclInt8, c1, NULL));
    CHECK(qcclReduceScatter(NULL, NULL, 0, qcclInt8, qcclSum, c1, NULL));
    CHECK(qcclAlltoAll(NULL, NULL, 0, qcclInt8, c1, NULL));
    qcclRequest_t req;
    CHECK(qcclIAllReduce(a, b, 8, qcclFloat32, qcclMin, c1, &req));
    int done = 0;
    while (!done) CHECK(qcclTest(req, &done));
    CHECK(qcclWait(req));
    ERR(qcclWait(req), qcclInvalidUsage, NULL, "not live"); /* freed by the first wait */

    /* Found at qcclGroupEnd before anything runs: the comm is not failed. */
    CHECK(qcclGroupStart());
    CHECK(qcclSend(a, 8, qcclFloat32, 0, c1, NULL));
    ERR(qcclGroupEnd(), qcclInvalidUsage, c1, "1 qcclSend to this rank itself but 0 qcclRecv");
    CHECK(qcclGroupStart());
    CHECK(qcclSend(a, 8, qcclFloat32, 0, c1, NULL));
    CHECK(qcclRecv(b, 4, qcclFloat32, 0, c1, NULL));
    ERR(qcclGroupEnd(), qcclInvalidUsage, c1, "is 32 bytes but the matching receive is 16");
    qcclResult_t async = qcclInternalError;
    CHECK(qcclCommGetAsyncError(c1, &async));
    if (async != qcclSuccess) FAIL("a group error found before running failed the comm");
    CHECK(qcclAllReduce(a, b, 8, qcclFloat32, qcclSum, c1, NULL));
}

/* What a call does not use on this rank is not checked there (NCCL's rules, the same in
 * the core): a non-root's NULL recvbuff of qcclReduce and sendbuff of qcclBroadcast; and in a
 * group a rank of a larger comm may send to itself, matched by a receive from itself. */
static void unused_buffers_and_grouped_self(qcclComm_t* pair) {
    float in[2][4], out[2][4], mine[4], back[4];
    for (int r = 0; r < 2; r++)
        for (int i = 0; i < 4; i++) in[r][i] = (float)(10 * r + i);
    CHECK(qcclGroupStart());
    CHECK(qcclReduce(in[0], out[0], 4, qcclFloat32, qcclSum, 0, pair[0], NULL));
    CHECK(qcclReduce(in[1], NULL, 4, qcclFloat32, qcclSum, 0, pair[1], NULL));
    CHECK(qcclGroupEnd());
    for (int i = 0; i < 4; i++)
        if (out[0][i] != (float)(10 + 2 * i)) FAIL("reduce with a NULL recvbuff elsewhere: [%d] = %g", i, (double)out[0][i]);
    CHECK(qcclGroupStart());
    CHECK(qcclBroadcast(in[0], out[0], 4, qcclFloat32, 0, pair[0], NULL));
    CHECK(qcclBroadcast(NULL, out[1], 4, qcclFloat32, 0, pair[1], NULL));
    CHECK(qcclGroupEnd());
    for (int i = 0; i < 4; i++)
        if (out[1][i] != (float)i) FAIL("broadcast with a NULL sendbuff elsewhere: [%d] = %g", i, (double)out[1][i]);
    for (int i = 0; i < 4; i++) mine[i] = (float)(i + 7);
    CHECK(qcclGroupStart());
    CHECK(qcclSend(mine, 4, qcclFloat32, 0, pair[0], NULL));
    CHECK(qcclRecv(back, 4, qcclFloat32, 0, pair[0], NULL));
    CHECK(qcclGroupEnd());
    if (memcmp(mine, back, sizeof mine) != 0) FAIL("grouped send to itself on a comm of 2");
    good_call(pair);
}

/* Receive buffers that overlap another buffer of the same grouped exchange. */
static void grouped_overlap(qcclComm_t c2) {
    float buf[16];
    CHECK(qcclGroupStart());
    CHECK(qcclRecv(buf, 4, qcclFloat32, 1, c2, NULL));
    CHECK(qcclSend(buf + 2, 4, qcclFloat32, 1, c2, NULL));
    ERR(qcclGroupEnd(), qcclInvalidArgument, c2, "overlaps a receive buffer");
    qcclResult_t async = qcclInternalError;
    CHECK(qcclCommGetAsyncError(c2, &async));
    if (async != qcclSuccess) FAIL("a group error found before running failed the comm");
}

int main(void) {
    g_rank = 0;
    alarm(60);
    strings();
    init_errors();
    qcclComm_t c1, c2[2];
    CHECK(qcclCommInitAll(&c1, 1, NULL));
    CHECK(qcclCommInitAll(c2, 2, NULL));
    handle_errors(c2[0]);
    argument_errors(c2);
    unused_buffers_and_grouped_self(c2);
    key_changes_length(c2);
    last_errors(c1, c2[0]);
    single_rank(c1);
    grouped_overlap(c2[0]);
    CHECK(qcclCommDestroy(c1));
    CHECK(qcclCommDestroy(c2[0]));
    CHECK(qcclCommDestroy(c2[1]));
    printf("error paths: %d checks ok\n", checks);
    return 0;
}
