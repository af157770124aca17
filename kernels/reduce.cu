// Element-wise reduction, as src/reduce does it on the CPU, bit for bit:
//
//   qccl_reduce_<op>_<dtype>(T* out, const T* a, const T* b, uint64_t count)
//       out[i] = a[i] op b[i]; out may equal a (in place).
//       op: sum, prod, max, min for every dtype; avg (the same as sum: the division happens
//       once, in qccl_finish_avg) for the float dtypes.
//   qccl_finish_avg_<dtype>(T* x, uint64_t count, uint64_t n)
//       x[i] /= n, float dtypes only (f16/bf16 divide in f32).
//
// dtype: i8 u8 i32 u32 i64 u64 f16 f32 f64 bf16 (qccl's DType); f16 and bf16 are passed as their
// uint16_t bits and reduced through f32 with one rounding per call, as src/reduce/float16.rs.
// Any alignment; with every pointer 16-byte aligned, each thread moves 16 bytes at a time.
// Shape: grid-stride, any grid and block (e.g. 256 threads, enough blocks to fill the device).
// Shim: sequential.
#include "common.cuh"

// out[i] = f(a[i], b[i]) (b may be null for a map: f(a[i], a[i]) then, unused by f).
template <class T, class F>
QCCL_DEVICE void qccl_elementwise(T* out, const T* a, const T* b, uint64_t count, F f) {
    const uint64_t V = 16 / sizeof(T);
    const T* bb = b ? b : a;
    uint64_t vectors = qccl_aligned16(out, a, bb) ? count / V : 0;
    for (uint64_t v = qccl_tid(); v < vectors; v += qccl_nthreads()) {
        union {
            uint4 v;
            T e[16 / sizeof(T)];
        } x, y;
        x.v = qccl_load16(a + v * V);
        y.v = qccl_load16(bb + v * V);
        for (uint64_t k = 0; k < V; k++) x.e[k] = f(x.e[k], y.e[k]);
        qccl_store16(out + v * V, x.v);
    }
    for (uint64_t i = vectors * V + qccl_tid(); i < count; i += qccl_nthreads())
        out[i] = f(a[i], bb[i]);
}

#define QCCL_REDUCE(op, T, suffix)                                                                 \
    extern "C" __global__ void qccl_reduce_##op##_##suffix(T* out, const T* a, const T* b,         \
                                                           uint64_t count) {                       \
        qccl_elementwise(out, a, b, count, [](T x, T y) { return qccl_##op(x, y); });              \
    }

#define QCCL_REDUCE16(op, suffix, WIDEN, NARROW)                                                   \
    extern "C" __global__ void qccl_reduce_##op##_##suffix(uint16_t* out, const uint16_t* a,       \
                                                           const uint16_t* b, uint64_t count) {    \
        qccl_elementwise(out, a, b, count, [](uint16_t x, uint16_t y) {                            \
            return NARROW(qccl_##op(WIDEN(x), WIDEN(y)));                                          \
        });                                                                                        \
    }

// Avg reduces as sum; the entry exists so that every (op, float dtype) pair has a name.
QCCL_DEVICE float qccl_avg(float a, float b) { return qccl_sum(a, b); }
QCCL_DEVICE double qccl_avg(double a, double b) { return qccl_sum(a, b); }

#define QCCL_REDUCE_INT(T, suffix)                                                                 \
    QCCL_REDUCE(sum, T, suffix)                                                                    \
    QCCL_REDUCE(prod, T, suffix) QCCL_REDUCE(max, T, suffix) QCCL_REDUCE(min, T, suffix)

#define QCCL_REDUCE_FLOAT(T, suffix)                                                               \
    QCCL_REDUCE_INT(T, suffix) QCCL_REDUCE(avg, T, suffix)                                         \
    extern "C" __global__ void qccl_finish_avg_##suffix(T* x, uint64_t count, uint64_t n) {        \
        T d = (T)n;                                                                                \
        qccl_elementwise(x, x, (const T*)0, count, [d](T v, T) { return qccl_div(v, d); });        \
    }

#define QCCL_REDUCE_HALF(suffix, WIDEN, NARROW)                                                    \
    QCCL_REDUCE16(sum, suffix, WIDEN, NARROW)                                                      \
    QCCL_REDUCE16(prod, suffix, WIDEN, NARROW)                                                     \
    QCCL_REDUCE16(max, suffix, WIDEN, NARROW)                                                      \
    QCCL_REDUCE16(min, suffix, WIDEN, NARROW)                                                      \
    QCCL_REDUCE16(avg, suffix, WIDEN, NARROW)                                                      \
    extern "C" __global__ void qccl_finish_avg_##suffix(uint16_t* x, uint64_t count, uint64_t n) { \
        float d = (float)n;                                                                        \
        qccl_elementwise(x, x, (const uint16_t*)0, count,                                          \
                         [d](uint16_t v, uint16_t) { return NARROW(qccl_div(WIDEN(v), d)); });     \
    }

QCCL_REDUCE_INT(int8_t, i8)
QCCL_REDUCE_INT(uint8_t, u8)
QCCL_REDUCE_INT(int32_t, i32)
QCCL_REDUCE_INT(uint32_t, u32)
QCCL_REDUCE_INT(int64_t, i64)
QCCL_REDUCE_INT(uint64_t, u64)
QCCL_REDUCE_FLOAT(float, f32)
QCCL_REDUCE_FLOAT(double, f64)
QCCL_REDUCE_HALF(f16, qccl_f16_to_f32, qccl_f32_to_f16)
QCCL_REDUCE_HALF(bf16, qccl_bf16_to_f32, qccl_f32_to_bf16)
