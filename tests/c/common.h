/* Helpers shared by the C tests of the qccl C ABI (built and run by ffi/tests/c_abi.rs). */
#ifndef QCCL_TEST_COMMON_H_
#define QCCL_TEST_COMMON_H_

#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <qccl.h>

static int g_rank = -1;

#define FAIL(...)                                                           \
    do {                                                                    \
        fprintf(stderr, "[rank %d] %s:%d: ", g_rank, __FILE__, __LINE__);   \
        fprintf(stderr, __VA_ARGS__);                                       \
        fprintf(stderr, "\n");                                              \
        exit(1);                                                            \
    } while (0)

/* A call that must succeed. */
#define CHECK(call)                                                                  \
    do {                                                                             \
        qcclResult_t r_ = (call);                                                    \
        if (r_ != qcclSuccess)                                                       \
            FAIL("%s returned %d (%s): %s", #call, (int)r_, qcclGetErrorString(r_),  \
                 qcclGetLastError(NULL));                                            \
    } while (0)

/* ---- element access through doubles, for every datatype the tests use ---------------- */

static inline size_t dt_size(qcclDataType_t t) {
    switch (t) {
    case qcclInt8: case qcclUint8: return 1;
    case qcclFloat16: case qcclBfloat16: return 2;
    case qcclInt32: case qcclUint32: case qcclFloat32: return 4;
    default: return 8;
    }
}

static inline const char* dt_name(qcclDataType_t t) {
    switch (t) {
    case qcclInt32: return "int32";
    case qcclFloat16: return "float16";
    case qcclFloat32: return "float32";
    case qcclFloat64: return "float64";
    case qcclBfloat16: return "bfloat16";
    case qcclInt64: return "int64";
    default: return "other";
    }
}

static inline int dt_is_float(qcclDataType_t t) {
    return t == qcclFloat16 || t == qcclFloat32 || t == qcclFloat64 || t == qcclBfloat16;
}

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* IEEE half <-> float, round to nearest even (normal range; the tests stay inside it). */
static inline uint16_t f32_to_f16(float f) {
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    int32_t exp = (int32_t)((u >> 23) & 0xff) - 127 + 15;
    uint32_t mant = u & 0x7fffff;
    if ((u & 0x7fffffff) == 0) return sign;
    if (exp <= 0) return sign; /* flush tiny values: not used by the tests */
    if (exp >= 31) return (uint16_t)(sign | 0x7c00);
    uint32_t h = ((uint32_t)exp << 10) | (mant >> 13);
    uint32_t rest = mant & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;
    return (uint16_t)(sign | h);
}

static inline float f16_to_f32(uint16_t h) {
    int sign = (h >> 15) & 1;
    int exp = (h >> 10) & 0x1f;
    int mant = h & 0x3ff;
    float v;
    if (exp == 0) v = ldexpf((float)mant, -24);
    else if (exp == 31) v = mant ? NAN : INFINITY;
    else v = ldexpf((float)(mant + 1024), exp - 25);
    return sign ? -v : v;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    u += 0x7fff + ((u >> 16) & 1); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

static inline void put(qcclDataType_t t, void* buf, size_t i, double v) {
    switch (t) {
    case qcclInt32: ((int32_t*)buf)[i] = (int32_t)v; break;
    case qcclInt64: ((int64_t*)buf)[i] = (int64_t)v; break;
    case qcclFloat32: ((float*)buf)[i] = (float)v; break;
    case qcclFloat64: ((double*)buf)[i] = v; break;
    case qcclFloat16: ((uint16_t*)buf)[i] = f32_to_f16((float)v); break;
    case qcclBfloat16: ((uint16_t*)buf)[i] = f32_to_bf16((float)v); break;
    default: FAIL("put: datatype %d not used by the tests", (int)t);
    }
}

static inline double get(qcclDataType_t t, const void* buf, size_t i) {
    switch (t) {
    case qcclInt32: return ((const int32_t*)buf)[i];
    case qcclInt64: return (double)((const int64_t*)buf)[i];
    case qcclFloat32: return ((const float*)buf)[i];
    case qcclFloat64: return ((const double*)buf)[i];
    case qcclFloat16: return f16_to_f32(((const uint16_t*)buf)[i]);
    case qcclBfloat16: return bf16_to_f32(((const uint16_t*)buf)[i]);
    default: FAIL("get: datatype %d not used by the tests", (int)t);
    }
    return 0;
}

/* Tolerance of a result that may be rounded (avg); sums of the test values are exact. */
static inline double tol(qcclDataType_t t) {
    switch (t) {
    case qcclFloat16: return 1e-2;
    case qcclBfloat16: return 6e-2;
    case qcclFloat32: return 1e-5;
    case qcclFloat64: return 1e-12;
    default: return 0;
    }
}

static inline void* xmalloc(size_t n) {
    void* p = malloc(n ? n : 1);
    if (!p) FAIL("out of memory (%zu bytes)", n);
    return p;
}

/* Fills n elements with a byte pattern no test value has. */
static inline void poison(void* buf, size_t bytes) { memset(buf, 0x7b, bytes); }

/* The error code and message of a call that must fail. */
#define EXPECT_ERR(call, code, comm, needle)                                               \
    do {                                                                                   \
        qcclResult_t r_ = (call);                                                          \
        if (r_ != (code))                                                                  \
            FAIL("%s returned %d (%s), expected %d (%s); last error: %s", #call, (int)r_,   \
                 qcclGetErrorString(r_), (int)(code), qcclGetErrorString(code),            \
                 qcclGetLastError(comm));                                                  \
        const char* m_ = qcclGetLastError(comm);                                           \
        if (!m_ || !strstr(m_, (needle)))                                                  \
            FAIL("%s: qcclGetLastError = \"%s\" does not mention \"%s\"", #call,           \
                 m_ ? m_ : "(null)", (needle));                                            \
    } while (0)

/* ---- processes ------------------------------------------------------------------------ */

static inline int read_all(int fd, void* buf, size_t n) {
    char* p = (char*)buf;
    while (n > 0) {
        ssize_t k = read(fd, p, n);
        if (k <= 0) return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

static inline int write_all(int fd, const void* buf, size_t n) {
    const char* p = (const char*)buf;
    while (n > 0) {
        ssize_t k = write(fd, p, n);
        if (k <= 0) return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

/* Forks `nranks` processes running body(rank, nranks, id): rank 0 makes the unique id
 * (hosting the rendezvous root) and sends it to the others through a pipe, as an
 * application would over its own channel. Returns 0 when every rank exited 0. Rank `killed`
 * (if >= 0) is the exception: once the others have ended, it is sent SIGKILL (it may have
 * stopped itself, or killed itself already) and must have ended by SIGKILL. */
static inline int run_ranks_killing(int nranks, int (*body)(int rank, int nranks, qcclUniqueId id),
                                    int killed) {
    int fds[2];
    if (pipe(fds) != 0) FAIL("pipe failed");
    pid_t* pids = (pid_t*)xmalloc(sizeof(pid_t) * (size_t)nranks);
    for (int r = 0; r < nranks; r++) {
        pid_t pid = fork();
        if (pid < 0) FAIL("fork failed");
        if (pid == 0) {
            g_rank = r;
            alarm(120); /* a hang fails the test instead of stalling it */
            qcclUniqueId id;
            if (r == 0) {
                close(fds[0]);
                CHECK(qcclGetUniqueId(&id));
                for (int k = 1; k < nranks; k++)
                    if (write_all(fds[1], &id, sizeof id) != 0) FAIL("writing the id");
                close(fds[1]);
            } else {
                close(fds[1]);
                if (read_all(fds[0], &id, sizeof id) != 0) FAIL("reading the id");
                close(fds[0]);
            }
            int rc = body(r, nranks, id);
            fflush(stdout);
            _exit(rc);
        }
        pids[r] = pid;
    }
    close(fds[0]);
    close(fds[1]);
    int failed = 0;
    for (int r = 0; r < nranks; r++) {
        if (r == killed) continue;
        int status = 0;
        if (waitpid(pids[r], &status, 0) < 0) FAIL("waitpid failed");
        if (WIFSIGNALED(status)) {
            fprintf(stderr, "rank %d killed by signal %d\n", r, WTERMSIG(status));
            failed = 1;
        } else if (WEXITSTATUS(status) != 0) {
            fprintf(stderr, "rank %d exited with %d\n", r, WEXITSTATUS(status));
            failed = 1;
        }
    }
    if (killed >= 0) {
        kill(pids[killed], SIGKILL);
        int status = 0;
        if (waitpid(pids[killed], &status, 0) < 0) FAIL("waitpid failed");
        if (!WIFSIGNALED(status) || WTERMSIG(status) != SIGKILL) {
            fprintf(stderr, "rank %d was to end by SIGKILL, status %d\n", killed, status);
            failed = 1;
        }
    }
    free(pids);
    return failed;
}

/* run_ranks_killing with no rank killed. */
static inline int run_ranks(int nranks, int (*body)(int rank, int nranks, qcclUniqueId id)) {
    return run_ranks_killing(nranks, body, -1);
}

#endif /* QCCL_TEST_COMMON_H_ */
