// What every kernel includes: fixed-width types, QCCL_DEVICE, f16/bf16 <-> f32 conversions that
// are bit-identical to qccl's Rust code (the `half` crate and src/reduce/float16.rs, NaNs
// included), the four reduce operators, and the grid-stride loop.
//
// Compiled three ways: by NVRTC (no headers at all: nothing here includes an NVIDIA header), by
// nvcc, and by g++ through kernels/shim/qccl_shim.h (which defines QCCL_SHIM first).
#pragma once

#if defined(QCCL_SHIM)
#include <cstdint>
#include <cstring>
#ifndef QCCL_DEVICE
#define QCCL_DEVICE static inline
#endif
#else
// NVRTC has no <cstdint>; these are the LP64 types CUDA uses on Linux.
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
#ifndef QCCL_DEVICE
#define QCCL_DEVICE __device__ __forceinline__
#endif
#endif

// ---- bit casts -------------------------------------------------------------------------------

QCCL_DEVICE uint32_t qccl_f32_bits(float x) {
#if defined(QCCL_SHIM)
    uint32_t u;
    std::memcpy(&u, &x, 4);
    return u;
#else
    return __float_as_uint(x);
#endif
}

QCCL_DEVICE float qccl_f32_from(uint32_t u) {
#if defined(QCCL_SHIM)
    float x;
    std::memcpy(&x, &u, 4);
    return x;
#else
    return __uint_as_float(u);
#endif
}

QCCL_DEVICE uint64_t qccl_f64_bits(double x) {
#if defined(QCCL_SHIM)
    uint64_t u;
    std::memcpy(&u, &x, 8);
    return u;
#else
    return (uint64_t)__double_as_longlong(x);
#endif
}

QCCL_DEVICE double qccl_f64_from(uint64_t u) {
#if defined(QCCL_SHIM)
    double x;
    std::memcpy(&x, &u, 8);
    return x;
#else
    return __longlong_as_double((long long)u);
#endif
}

// ---- arithmetic with the CPU's NaNs -----------------------------------------------------------
// A GPU's add, sub, mul and div return the canonical NaN (0x7fffffff) whenever the result is
// NaN; the CPU ranks' (x86 SSE/AVX, what Rust's float operators compile to) keep a NaN
// operand's payload, quieted (the first operand's when both are NaN), and give the negative
// quiet NaN for an invalid operation on numbers (inf - inf, 0 * inf, 0 / 0). Every value a
// kernel writes that arithmetic can make NaN goes through these, so GPU and CPU ranks write the
// same bits (found on an H200: an fp16 encode+EF of a NaN input). The shim runs the same
// fix-up over the CPU's own NaN, so its parity tests check the rule against the Rust codecs.

QCCL_DEVICE float qccl_x86_nan(float a, float b) {
    if (a != a) return qccl_f32_from(qccl_f32_bits(a) | 0x00400000u);
    if (b != b) return qccl_f32_from(qccl_f32_bits(b) | 0x00400000u);
    return qccl_f32_from(0xffc00000u);
}

QCCL_DEVICE double qccl_x86_nan(double a, double b) {
    if (a != a) return qccl_f64_from(qccl_f64_bits(a) | 0x0008000000000000ull);
    if (b != b) return qccl_f64_from(qccl_f64_bits(b) | 0x0008000000000000ull);
    return qccl_f64_from(0xfff8000000000000ull);
}

// -x as the CPU's: the sign bit flipped, a NaN's payload kept (PTX leaves neg's NaN open).
QCCL_DEVICE float qccl_neg(float x) { return qccl_f32_from(qccl_f32_bits(x) ^ 0x80000000u); }

#define QCCL_CPU_NAN_OP(name, op)                                               \
    QCCL_DEVICE float name(float a, float b) {                                  \
        float r = a op b;                                                       \
        return r == r ? r : qccl_x86_nan(a, b);                                 \
    }                                                                           \
    QCCL_DEVICE double name(double a, double b) {                               \
        double r = a op b;                                                      \
        return r == r ? r : qccl_x86_nan(a, b);                                 \
    }
QCCL_CPU_NAN_OP(qccl_add, +)
QCCL_CPU_NAN_OP(qccl_sub, -)
QCCL_CPU_NAN_OP(qccl_mul, *)
QCCL_CPU_NAN_OP(qccl_div, /)
#undef QCCL_CPU_NAN_OP

// ---- f16 / bf16 <-> f32 --------------------------------------------------------------------
// NaN rules (the `half` crate's, which qccl's CPU paths follow on every code path): widening
// and narrowing both set the quiet bit and keep the payload's high bits and the sign. The GPU's
// cvt gives a canonical NaN instead, so NaNs take the integer path there too.

// f32 NaN to f16 bits: quiet, top 10 payload bits kept.
QCCL_DEVICE uint16_t qccl_f16_nan(uint32_t x) {
    return (uint16_t)(((x >> 16) & 0x8000u) | 0x7e00u | ((x >> 13) & 0x3ffu));
}

// f16 NaN bits to f32 bits: quiet, payload shifted up.
QCCL_DEVICE uint32_t qccl_f16_nan_widen(uint16_t h) {
    return ((uint32_t)(h & 0x8000u) << 16) | 0x7fc00000u | ((uint32_t)(h & 0x3ffu) << 13);
}

// f32 -> f16 bits, round to nearest even (overflow to infinity).
QCCL_DEVICE uint16_t qccl_f32_to_f16(float f) {
    uint32_t x = qccl_f32_bits(f);
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return qccl_f16_nan(x);
#if defined(QCCL_SHIM)
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    // 65520 (halfway between the largest f16, 65504, and 2^16) and above round to infinity.
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);
    if (ax >= 0x38800000u) {
        // Normal f16 (>= 2^-14): round at bit 13 (adding 0xfff plus the kept lsb carries
        // exactly when rounding up), then rebias the exponent from 127 to 15.
        uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u);
        return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
    }
    uint32_t e = ax >> 23;
    if (e < 102) return sign;  // below 2^-25: rounds to zero (2^-25 itself ties to even 0)
    // Subnormal f16: the value in units of 2^-24 is m * 2^(e - 126), m with its hidden bit.
    uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - e;  // 14..24
    uint32_t q = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) q++;  // may carry into the smallest normal
    return (uint16_t)(sign | q);
#else
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#endif
}

// f16 bits -> f32 (exact).
QCCL_DEVICE float qccl_f16_to_f32(uint16_t h) {
    if ((h & 0x7fffu) > 0x7c00u) return qccl_f32_from(qccl_f16_nan_widen(h));
#if defined(QCCL_SHIM)
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu;
    uint32_t m = h & 0x3ffu;
    if (e == 0x1f) return qccl_f32_from(sign | 0x7f800000u);
    if (e == 0) {
        if (m == 0) return qccl_f32_from(sign);
        // Subnormal m * 2^-24: normalise so bit 10 is the hidden bit; 2^(-14-k).
        uint32_t k = 0;
        while (!(m & 0x400u)) {
            m <<= 1;
            k++;
        }
        return qccl_f32_from(sign | ((113u - k) << 23) | ((m & 0x3ffu) << 13));
    }
    return qccl_f32_from(sign | ((e + 112u) << 23) | (m << 13));
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)h));
    return f;
#endif
}

// f32 -> bf16 bits, round to nearest even; NaN quieted (bf16 is the high half of an f32).
QCCL_DEVICE uint16_t qccl_f32_to_bf16(float f) {
    uint32_t x = qccl_f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
#if defined(QCCL_SHIM)
    // Adding 0x7fff plus the kept lsb carries into the kept half exactly when rounding up.
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
#else
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#endif
}

// bf16 bits -> f32 (exact; NaN quieted).
QCCL_DEVICE float qccl_bf16_to_f32(uint16_t h) {
    if ((h & 0x7fffu) > 0x7f80u) h = (uint16_t)(h | 0x40u);
#if defined(QCCL_SHIM)
    return qccl_f32_from((uint32_t)h << 16);
#else
    uint32_t u;
    asm("mov.b32 %0, {%1, %2};" : "=r"(u) : "h"((unsigned short)0), "h"((unsigned short)h));
    return __uint_as_float(u);
#endif
}

// ---- the reduce operators --------------------------------------------------------------------
// As src/reduce/elementwise.rs: integers wrap (computed unsigned: signed overflow is undefined
// in C++); float max/min are IEEE 754-2019 maximumNumber/minimumNumber written as compares and
// selects (a NaN operand yields the other, two NaNs the first, -0 < +0).

#define QCCL_INT_OPS(T, U)                                                          \
    QCCL_DEVICE T qccl_sum(T a, T b) { return (T)(U)((U)a + (U)b); }                \
    QCCL_DEVICE T qccl_prod(T a, T b) { return (T)(U)((U)a * (U)b); }               \
    QCCL_DEVICE T qccl_max(T a, T b) { return a > b ? a : b; }                      \
    QCCL_DEVICE T qccl_min(T a, T b) { return a < b ? a : b; }

// 8-bit products promote to int; going through uint32_t keeps them defined, and the cast back
// keeps the low byte, as wrapping_mul does.
QCCL_INT_OPS(int8_t, uint32_t)
QCCL_INT_OPS(uint8_t, uint32_t)
QCCL_INT_OPS(int32_t, uint32_t)
QCCL_INT_OPS(uint32_t, uint32_t)
QCCL_INT_OPS(int64_t, uint64_t)
QCCL_INT_OPS(uint64_t, uint64_t)
#undef QCCL_INT_OPS

#define QCCL_FLOAT_OPS(T, BITS, FROM)                                              \
    QCCL_DEVICE T qccl_sum(T a, T b) { return qccl_add(a, b); }                    \
    QCCL_DEVICE T qccl_prod(T a, T b) { return qccl_mul(a, b); }                   \
    QCCL_DEVICE T qccl_max(T a, T b) {                                             \
        T r = a > b ? a : b;                                                       \
        if (a == b) r = FROM(BITS(a) & BITS(b)); /* +0 beats -0 */                 \
        return b != b ? a : r;                                                     \
    }                                                                              \
    QCCL_DEVICE T qccl_min(T a, T b) {                                             \
        T r = a < b ? a : b;                                                       \
        if (a == b) r = FROM(BITS(a) | BITS(b)); /* -0 beats +0 */                 \
        return b != b ? a : r;                                                     \
    }

QCCL_FLOAT_OPS(float, qccl_f32_bits, qccl_f32_from)
QCCL_FLOAT_OPS(double, qccl_f64_bits, qccl_f64_from)
#undef QCCL_FLOAT_OPS

// ---- small helpers ---------------------------------------------------------------------------

// Finite (neither infinite nor NaN), from the bits: the same on every compiler and flag set.
QCCL_DEVICE bool qccl_finite_f32(float x) { return (qccl_f32_bits(x) & 0x7f800000u) != 0x7f800000u; }
QCCL_DEVICE bool qccl_finite_f64(double x) {
    return (qccl_f64_bits(x) & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
}

// |x| as the CPU's f32::abs: the sign bit cleared (a NaN stays a NaN).
QCCL_DEVICE float qccl_abs_f32(float x) { return qccl_f32_from(qccl_f32_bits(x) & 0x7fffffffu); }

// f32 bits as produced by Rust's f32::NAN.
#define QCCL_F32_NAN_BITS 0x7fc00000u

// Little-endian f32 at any byte address (payload fields need not be aligned).
QCCL_DEVICE void qccl_store_f32_le(uint8_t* p, float v) {
    uint32_t u = qccl_f32_bits(v);
    p[0] = (uint8_t)u;
    p[1] = (uint8_t)(u >> 8);
    p[2] = (uint8_t)(u >> 16);
    p[3] = (uint8_t)(u >> 24);
}
QCCL_DEVICE float qccl_load_f32_le(const uint8_t* p) {
    return qccl_f32_from((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                         (uint32_t)p[3] << 24);
}

QCCL_DEVICE uint64_t qccl_div_ceil(uint64_t a, uint64_t b) { return (a + b - 1) / b; }
QCCL_DEVICE uint64_t qccl_min_u64(uint64_t a, uint64_t b) { return a < b ? a : b; }

// ---- 16-byte vector access ----------------------------------------------------------------
// Element-wise kernels move 16 bytes a thread where the buffers allow it: one vector load or
// store instead of up to 16 narrow ones keeps 1- and 2-byte types near copy bandwidth.

// True when every pointer is 16-byte aligned.
QCCL_DEVICE bool qccl_aligned16(const void* a, const void* b, const void* c) {
    return (((unsigned long long)a | (unsigned long long)b | (unsigned long long)c) & 15ull) == 0;
}

QCCL_DEVICE uint4 qccl_load16(const void* p) {
#if defined(QCCL_SHIM)
    // A GPU faults on a misaligned vector access; the CPU would not, so the shim checks.
    if ((unsigned long long)p & 15ull) qccl_shim::fail("qccl_load16: %p is not 16-byte aligned", p);
    uint4 v;
    std::memcpy(&v, p, 16);  // the shim's C++ forbids reading a float buffer through uint4*
    return v;
#else
    return *(const uint4*)p;
#endif
}

QCCL_DEVICE void qccl_store16(void* p, uint4 v) {
#if defined(QCCL_SHIM)
    if ((unsigned long long)p & 15ull) qccl_shim::fail("qccl_store16: %p is not 16-byte aligned", p);
    std::memcpy(p, &v, 16);
#else
    *(uint4*)p = v;
#endif
}

// Eight elements of T as 16-byte vectors (T of 2 or 4 bytes).
template <class T>
union qccl_x8 {
    uint4 u[sizeof(T) / 2];
    T e[8];
};

template <class T>
QCCL_DEVICE qccl_x8<T> qccl_ld8(const T* p) {
    qccl_x8<T> r;
    for (unsigned j = 0; j < sizeof(T) / 2; j++) r.u[j] = qccl_load16(p + j * (16 / sizeof(T)));
    return r;
}

template <class T>
QCCL_DEVICE void qccl_st8(T* p, const qccl_x8<T>& r) {
    for (unsigned j = 0; j < sizeof(T) / 2; j++) qccl_store16(p + j * (16 / sizeof(T)), r.u[j]);
}

// ---- launch helpers --------------------------------------------------------------------------

// Global index of this thread and the grid's thread count, in 64 bits.
QCCL_DEVICE uint64_t qccl_tid() { return (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; }
QCCL_DEVICE uint64_t qccl_nthreads() { return (uint64_t)gridDim.x * blockDim.x; }

// for (i = this thread's first; i < n; i += every thread of the grid)
#define QCCL_GRID_STRIDE(i, n) for (uint64_t i = qccl_tid(); i < (n); i += qccl_nthreads())

// ---- buckets ---------------------------------------------------------------------------------
// The bucket holding element i, for a thread that visits its elements in increasing order
// (qsgd's levels and decode, onebit's means): the next bucket is a step away, and a 64-bit
// division (one per element would cost more than the rest of an element's work on a GPU)
// happens only on a jump, such as to the thread's next grid-stride item.
struct QcclBucketWalk {
    uint64_t size, b, start, next;  // bucket b is [start, next)
};

// Nothing loaded yet: [1, 0) holds no element, and b + 1 wraps to bucket 0.
QCCL_DEVICE QcclBucketWalk qccl_bucket_walk(uint64_t size) {
    QcclBucketWalk w = {size, ~0ull, 1, 0};
    return w;
}

// Moves to element i's bucket; true when that is another bucket (the first call included),
// whose per-bucket values the caller then loads.
QCCL_DEVICE bool qccl_bucket_walk_to(QcclBucketWalk& w, uint64_t i) {
    if (i >= w.start && i < w.next) return false;
    w.b = i >= w.next && i - w.next < w.size ? w.b + 1 : i / w.size;
    w.start = w.b * w.size;
    w.next = w.start + w.size;
    return true;
}
