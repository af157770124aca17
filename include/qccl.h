/*
 * qccl.h: the C ABI of qccl, a collective-communication library with NCCL's calls,
 * argument order, numbering and in-place rules, for host and device memory.
 *
 * Link with libqccl (`cc app.c $(pkg-config --cflags --libs qccl)`; see ffi/README.md).
 * Written by hand; ffi/tests/header.rs fails when it and the library's exports disagree.
 *
 * Conventions:
 *  - Every call returns a qcclResult_t; qcclGetLastError() gives the detailed message.
 *  - Buffers are host or device memory (cudaMalloc'd, on one device per comm: the device of
 *    its first call on device memory), staged through page-locked host memory. On a stream
 *    (a cudaStream_t of that device) a call on device buffers is enqueued and returns at
 *    once, as NCCL's: it runs after the work enqueued on the stream before it, and work
 *    enqueued after it waits for it; its failure is reported by qcclCommGetAsyncError. With
 *    a NULL stream, or host buffers, the call is complete when it returns. Without a CUDA
 *    driver a non-NULL stream returns qcclUnsupported.
 *    Non-blocking calls (qcclI*) take device buffers too; they are done at qcclWait.
 *  - Between qcclGroupStart() and qcclGroupEnd() calls are queued and run at the outermost
 *    qcclGroupEnd(), which returns when they are complete; buffers stay valid until then.
 *    Calls of one comm in a group name one stream (qcclUnsupported otherwise); on a
 *    non-NULL stream the group's calls on that comm are enqueued there and qcclGroupEnd
 *    returns once they are (NCCL's meaning), their buffers being device memory.
 *  - All ranks of a comm make the same collective calls in the same order.
 *  - A NULL pointer with a non-zero count, an unknown enum value, a count whose byte size
 *    overflows, a root or peer out of range return qcclInvalidArgument; a destroyed comm
 *    or request handle returns qcclInvalidUsage. No call panics or aborts the process.
 */
#ifndef QCCL_H_
#define QCCL_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define QCCL_MAJOR 0
#define QCCL_MINOR 1
#define QCCL_PATCH 0
/* NCCL's encoding: major*10000 + minor*100 + patch (what qcclGetVersion returns). */
#define QCCL_VERSION_CODE 100
#define QCCL_VERSION(X, Y, Z) ((X) * 10000 + (Y) * 100 + (Z))

#define QCCL_UNIQUE_ID_BYTES 128
/* Made by qcclGetUniqueId on one rank; send its bytes to the others. */
typedef struct { char internal[QCCL_UNIQUE_ID_BYTES]; } qcclUniqueId;

/* Handles are opaque tokens; the library never lets them dangle (see qcclCommDestroy). */
typedef struct qcclComm* qcclComm_t;
typedef void* qcclStream_t;   /* a cudaStream_t / CUstream; NULL: legacy default stream */
typedef struct qcclCodec* qcclCodec_t;
typedef struct qcclRequest* qcclRequest_t;

/* color of qcclCommSplit for a rank that takes no part (NCCL_SPLIT_NOCOLOR). */
#define QCCL_SPLIT_NOCOLOR (-1)

typedef enum { qcclSuccess = 0, qcclUnhandledCudaError = 1, qcclSystemError = 2,
  qcclInternalError = 3, qcclInvalidArgument = 4, qcclInvalidUsage = 5, qcclRemoteError = 6,
  qcclInProgress = 7, qcclTimeout = 8, qcclUnsupported = 9 } qcclResult_t;

typedef enum { qcclInt8 = 0, qcclUint8 = 1, qcclInt32 = 2, qcclUint32 = 3, qcclInt64 = 4,
  qcclUint64 = 5, qcclFloat16 = 6, qcclFloat32 = 7, qcclFloat64 = 8, qcclBfloat16 = 9,
  /* NCCL's aliases */
  qcclChar = 0, qcclInt = 2, qcclHalf = 6, qcclFloat = 7, qcclDouble = 8 } qcclDataType_t;

/* qcclAvg needs a floating-point datatype. Integers wrap on overflow. */
typedef enum { qcclSum = 0, qcclProd = 1, qcclMax = 2, qcclMin = 3, qcclAvg = 4 } qcclRedOp_t;

/* ---- library, ids, communicators ------------------------------------------------------ */

qcclResult_t qcclGetVersion(int* version);
/* Creates an id and hosts its rendezvous root in this process (like ncclGetUniqueId). */
qcclResult_t qcclGetUniqueId(qcclUniqueId* uniqueId);
/* Blocks until all nranks ranks joined (QCCL_INIT_TIMEOUT_MS). *comm is NULL on failure. */
qcclResult_t qcclCommInitRank(qcclComm_t* comm, int nranks, qcclUniqueId commId, int rank);
/* ndev ranks in this process (in-process transport); devlist is ignored and may be NULL. */
qcclResult_t qcclCommInitAll(qcclComm_t* comms, int ndev, const int* devlist);
/* torchrun / mpirun / srun variables, or QCCL_RANK, QCCL_WORLD_SIZE, QCCL_COMM_ID. */
qcclResult_t qcclCommInitFromEnv(qcclComm_t* comm);
/* Collective: same color -> same new comm, ranked by key; QCCL_SPLIT_NOCOLOR -> *newcomm NULL. */
qcclResult_t qcclCommSplit(qcclComm_t comm, int color, int key, qcclComm_t* newcomm);
/* Survivors of a failure make a new comm (ncclCommShrink, MPIX_Comm_shrink): every rank but
 * excludeRanks calls it with the same list, on the comm that returned the error, before
 * destroying it; excludeRanks NULL (excludeCount 0): agree on the ranks that are gone. New
 * rank = old rank minus the excluded ranks below it. comm is aborted; destroy it after. */
qcclResult_t qcclCommShrink(qcclComm_t comm, const int* excludeRanks, int excludeCount,
                            qcclComm_t* newcomm);
/* Frees comm after its queued operations (NULL: no-op). Later use -> qcclInvalidUsage. */
qcclResult_t qcclCommDestroy(qcclComm_t comm);
/* Fails running and queued operations, tells the peers (within ~1 s), then frees comm. */
qcclResult_t qcclCommAbort(qcclComm_t comm);
qcclResult_t qcclCommCount(const qcclComm_t comm, int* count);
qcclResult_t qcclCommUserRank(const qcclComm_t comm, int* rank);
/* qcclSuccess, or the code of the error that failed the comm. */
qcclResult_t qcclCommGetAsyncError(qcclComm_t comm, qcclResult_t* asyncError);
/* Buffer registration (ncclCommRegister / ncclCommDeregister): records size bytes at buff
 * (whole pages) with comm and sets *handle; registering the same pages again gives the same
 * handle, counted, each needing its qcclCommDeregister. Collectives on registered buffers may
 * be sent straight from them by links that can (RDMA); elsewhere nothing changes. Local, not
 * collective. Deregister before freeing the buffer. NULL buff, size 0, NULL handle, or a
 * handle comm did not hand out (or already deregistered) -> qcclInvalidArgument. */
qcclResult_t qcclCommRegister(const qcclComm_t comm, void* buff, size_t size, void** handle);
qcclResult_t qcclCommDeregister(const qcclComm_t comm, void* handle);
const char*  qcclGetErrorString(qcclResult_t result);
/* The detailed message of the last failure on comm; comm NULL (or not a live comm): of the
 * last failure on the calling thread. "" if none. The string stays valid for the thread's
 * life and unchanged for the next 7 qcclGetLastError calls of that thread. */
const char*  qcclGetLastError(qcclComm_t comm);       /* the detailed message of the last failure */

/* ---- collectives (NCCL's in-place rules) ---------------------------------------------- */

/* In place when sendbuff == recvbuff. */
qcclResult_t qcclAllReduce(const void* sendbuff, void* recvbuff, size_t count, qcclDataType_t datatype, qcclRedOp_t op, qcclComm_t comm, qcclStream_t stream);
/* sendbuff is read on root only; in place when sendbuff == recvbuff there. */
qcclResult_t qcclBroadcast(const void* sendbuff, void* recvbuff, size_t count, qcclDataType_t datatype, int root, qcclComm_t comm, qcclStream_t stream);
/* recvbuff is written on root only (may be NULL elsewhere); in place when sendbuff == recvbuff. */
qcclResult_t qcclReduce(const void* sendbuff, void* recvbuff, size_t count, qcclDataType_t datatype, qcclRedOp_t op, int root, qcclComm_t comm, qcclStream_t stream);
/* recvbuff holds nranks*sendcount; in place when sendbuff == recvbuff + rank*sendcount. */
qcclResult_t qcclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, qcclDataType_t datatype, qcclComm_t comm, qcclStream_t stream);
/* sendbuff holds nranks*recvcount; in place when recvbuff == sendbuff + rank*recvcount. */
qcclResult_t qcclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount, qcclDataType_t datatype, qcclRedOp_t op, qcclComm_t comm, qcclStream_t stream);
/* Both hold nranks*count: part p of sendbuff goes to rank p. In place when equal. */
qcclResult_t qcclAlltoAll(const void* sendbuff, void* recvbuff, size_t count, qcclDataType_t datatype, qcclComm_t comm, qcclStream_t stream);
/* Point to point. Outside a group each call blocks until done; inside one, the sends and
 * receives of a comm run together at qcclGroupEnd (any order, any size, self included). */
qcclResult_t qcclSend(const void* sendbuff, size_t count, qcclDataType_t datatype, int peer, qcclComm_t comm, qcclStream_t stream);
qcclResult_t qcclRecv(void* recvbuff, size_t count, qcclDataType_t datatype, int peer, qcclComm_t comm, qcclStream_t stream);
/* Groups nest; the outermost qcclGroupEnd runs the queued calls of every comm at once and
 * returns when all finished, with the first error. A call that fails inside a group spoils
 * it: qcclGroupEnd then runs nothing and returns that error. */
qcclResult_t qcclGroupStart(void);
qcclResult_t qcclGroupEnd(void);

/* ---- compression ----------------------------------------------------------------------- */
/* A codec is made from a spec string (see README: qsgd, topk, mstopk, randk, efsign, onebit,
 * fp16, bf16, none; ",ef=1" adds error feedback) and freed with qcclCodecDestroy. Compressed
 * all-reduce: float types, sum or avg, NCCL's in-place rule; tensorKey names the tensor across
 * calls (its error-feedback residual). qcclCommSetLayout registers the layers of fused buffers:
 * a compressed call whose count equals their total compresses each layer on its own, layers
 * matching qcclCommExcludeLayers' patterns ("bias|norm") or under
 * QCCL_COMPRESSION_MINIMAL_SIZE elements stay uncompressed. qcclHiTopKAllReduce: HiTopKComm
 * (intra-host reduce-scatter, MSTopK at density on each rank's slice, inter-host all-gather of
 * (index, value) pairs, intra-host all-gather), a sum, error feedback keyed by tensorKey. */

qcclResult_t qcclCodecCreate(const char* spec, qcclCodec_t* codec);   /* "qsgd:bits=4,bucket=128", "topk:density=0.01,ef=1", ... */
qcclResult_t qcclCodecDestroy(qcclCodec_t codec);
qcclResult_t qcclAllReduceCompressed(const void* sendbuff, void* recvbuff, size_t count, qcclDataType_t datatype, qcclRedOp_t op, qcclCodec_t codec, uint64_t tensorKey, qcclComm_t comm, qcclStream_t stream);
qcclResult_t qcclHiTopKAllReduce(const void* sendbuff, void* recvbuff, size_t count, qcclDataType_t datatype, float density, uint64_t tensorKey, qcclComm_t comm, qcclStream_t stream);
qcclResult_t qcclCommSetLayout(qcclComm_t comm, int nlayers, const char* const* names, const size_t* counts);
qcclResult_t qcclCommExcludeLayers(qcclComm_t comm, const char* pattern);

/* ---- fusion plans ---------------------------------------------------------------------- */
/* A plan (JSON written by qccl-plan: groups of consecutive tensors, each dense or with a codec
 * spec) from QCCL_PLAN_FILE at init, or set here (NULL path clears it). While a comm has one,
 * its float32 sum/avg all-reduces issued with qcclIAllReduce or inside a group are the plan's
 * tensors in order; each fusion group is reduced as one buffer when its last tensor is
 * issued, and every tensor's request completes with its group. */
qcclResult_t qcclCommSetPlan(qcclComm_t comm, const char* path);

/* ---- non-blocking forms: same arguments, a request out instead of a stream ------------- */
/* The buffers stay valid and untouched until qcclWait. Not allowed inside a group. */

qcclResult_t qcclIAllReduce(const void* sendbuff, void* recvbuff, size_t count, qcclDataType_t datatype, qcclRedOp_t op, qcclComm_t comm, qcclRequest_t* request);
qcclResult_t qcclIReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount, qcclDataType_t datatype, qcclRedOp_t op, qcclComm_t comm, qcclRequest_t* request);
qcclResult_t qcclIAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, qcclDataType_t datatype, qcclComm_t comm, qcclRequest_t* request);
qcclResult_t qcclIAllReduceCompressed(const void* sendbuff, void* recvbuff, size_t count, qcclDataType_t datatype, qcclRedOp_t op, qcclCodec_t codec, uint64_t tensorKey, qcclComm_t comm, qcclRequest_t* request);
/* *done = 1 once finished (then a failed operation's error is returned here too). */
qcclResult_t qcclTest(qcclRequest_t request, int* done);
qcclResult_t qcclWait(qcclRequest_t request);          /* frees the request */

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif /* QCCL_H_ */
