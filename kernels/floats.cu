// The float codecs of src/codec/floats.rs: `none` (f32 as is), `fp16` and `bf16` (each element
// rounded to nearest even; NaN quieted, as the `half` crate does). Payloads only: the 32-byte
// header is the host's. Payload layout: element i at bytes 2i..2i+2 (4i..4i+4 for none), little
// endian, which is the device's byte order.
//
//   qccl_<codec>_encode(const float* x, T* payload, uint64_t count)
//   qccl_<codec>_encode_ef(const float* x, float* res, float* w_out, T* payload, uint64_t count)
//       error feedback fused: encodes w = x + res, then res = (0 + w) - decoded(w) (the bits of
//       the CPU's compensate, residual += w, residual -= decode); w_out (may be null) gets w.
//   qccl_<codec>_decode(const T* payload, float* out, uint64_t count)       out[i] = value
//   qccl_<codec>_decode_add(const T* payload, float* out, uint64_t count)   out[i] += value
//
// codec: fp16, bf16 (T = uint16_t), none (T = float). Buffers must be aligned to their element
// (the header is 32 bytes, so a payload is whenever its chunk is); with all of them 16-byte
// aligned each thread handles 8 elements with 16-byte loads and stores.
// Shape: grid-stride, any grid and block. Shim: sequential.
#include "common.cuh"

QCCL_DEVICE float qccl_none_to_f32(float x) { return x; }
QCCL_DEVICE float qccl_f32_to_none(float x) { return x; }

template <class T, class Enc>
QCCL_DEVICE void qccl_encode_body(const float* x, T* payload, uint64_t count, Enc enc) {
    uint64_t groups = qccl_aligned16(x, payload, x) ? count / 8 : 0;
    for (uint64_t g = qccl_tid(); g < groups; g += qccl_nthreads()) {
        qccl_x8<float> in = qccl_ld8(x + 8 * g);
        qccl_x8<T> out;
        for (int k = 0; k < 8; k++) out.e[k] = enc(in.e[k]);
        qccl_st8(payload + 8 * g, out);
    }
    for (uint64_t i = groups * 8 + qccl_tid(); i < count; i += qccl_nthreads()) payload[i] = enc(x[i]);
}

template <class T, class Enc, class Dec>
QCCL_DEVICE void qccl_encode_ef_body(const float* x, float* res, float* w_out, T* payload,
                                     uint64_t count, Enc enc, Dec dec) {
    bool vec = qccl_aligned16(x, res, payload) && qccl_aligned16(w_out ? w_out : x, x, x);
    uint64_t groups = vec ? count / 8 : 0;
    for (uint64_t g = qccl_tid(); g < groups; g += qccl_nthreads()) {
        qccl_x8<float> xv = qccl_ld8(x + 8 * g), rv = qccl_ld8(res + 8 * g);
        qccl_x8<T> p;
        for (int k = 0; k < 8; k++) {
            float w = qccl_add(xv.e[k], rv.e[k]);
            p.e[k] = enc(w);
            rv.e[k] = qccl_sub(qccl_add(0.0f, w), dec(p.e[k]));
            xv.e[k] = w;
        }
        qccl_st8(payload + 8 * g, p);
        qccl_st8(res + 8 * g, rv);
        if (w_out) qccl_st8(w_out + 8 * g, xv);
    }
    for (uint64_t i = groups * 8 + qccl_tid(); i < count; i += qccl_nthreads()) {
        float w = qccl_add(x[i], res[i]);
        T p = enc(w);
        payload[i] = p;
        res[i] = qccl_sub(qccl_add(0.0f, w), dec(p));
        if (w_out) w_out[i] = w;
    }
}

template <bool ADD, class T, class Dec>
QCCL_DEVICE void qccl_decode_body(const T* payload, float* out, uint64_t count, Dec dec) {
    uint64_t groups = qccl_aligned16(payload, out, out) ? count / 8 : 0;
    for (uint64_t g = qccl_tid(); g < groups; g += qccl_nthreads()) {
        qccl_x8<T> p = qccl_ld8(payload + 8 * g);
        qccl_x8<float> o;
        if (ADD) o = qccl_ld8(out + 8 * g);
        for (int k = 0; k < 8; k++) o.e[k] = ADD ? qccl_add(o.e[k], dec(p.e[k])) : dec(p.e[k]);
        qccl_st8(out + 8 * g, o);
    }
    for (uint64_t i = groups * 8 + qccl_tid(); i < count; i += qccl_nthreads())
        out[i] = ADD ? qccl_add(out[i], dec(payload[i])) : dec(payload[i]);
}

#define QCCL_FLOAT_CODEC(codec, T, ENCODE, DECODE)                                                \
    extern "C" __global__ void qccl_##codec##_encode(const float* x, T* payload, uint64_t count) { \
        qccl_encode_body(x, payload, count, [](float v) { return ENCODE(v); });                   \
    }                                                                                             \
    extern "C" __global__ void qccl_##codec##_encode_ef(const float* x, float* res, float* w_out,  \
                                                        T* payload, uint64_t count) {             \
        qccl_encode_ef_body(x, res, w_out, payload, count, [](float v) { return ENCODE(v); },     \
                            [](T p) { return DECODE(p); });                                       \
    }                                                                                             \
    extern "C" __global__ void qccl_##codec##_decode(const T* payload, float* out,                \
                                                     uint64_t count) {                            \
        qccl_decode_body<false>(payload, out, count, [](T p) { return DECODE(p); });              \
    }                                                                                             \
    extern "C" __global__ void qccl_##codec##_decode_add(const T* payload, float* out,            \
                                                         uint64_t count) {                        \
        qccl_decode_body<true>(payload, out, count, [](T p) { return DECODE(p); });               \
    }

QCCL_FLOAT_CODEC(none, float, qccl_f32_to_none, qccl_none_to_f32)
QCCL_FLOAT_CODEC(fp16, uint16_t, qccl_f32_to_f16, qccl_f16_to_f32)
QCCL_FLOAT_CODEC(bf16, uint16_t, qccl_f32_to_bf16, qccl_bf16_to_f32)

// Calls on float64 buffers: the codecs work on an f32 copy, as the CPU's `with_f32` does with
// Rust's `as` (a float16 or bfloat16 buffer takes its float codec's decode and encode instead).
//   qccl_f64_to_f32(const double* x, float* out, uint64_t count)   rounded to nearest even
//   qccl_f32_to_f64(const float* x, double* out, uint64_t count)   exact
// A NaN keeps its sign and the top of its payload, quieted, as x86's cvtsd2ss and cvtss2sd
// (what `as` compiles to there) do; a GPU's cvt would return the canonical NaN instead.
// Shape: grid-stride, any grid and block. Shim: sequential.
QCCL_DEVICE float qccl_f64_narrow(double d) {
    uint64_t b = qccl_f64_bits(d);
    if ((b & 0x7fffffffffffffffull) > 0x7ff0000000000000ull)
        return qccl_f32_from(((uint32_t)(b >> 32) & 0x80000000u) | 0x7fc00000u |
                             ((uint32_t)(b >> 29) & 0x003fffffu));
    return (float)d;
}

QCCL_DEVICE double qccl_f32_widen(float f) {
    uint32_t b = qccl_f32_bits(f);
    if ((b & 0x7fffffffu) > 0x7f800000u)
        return qccl_f64_from(((uint64_t)(b & 0x80000000u) << 32) | 0x7ff8000000000000ull |
                             ((uint64_t)(b & 0x003fffffu) << 29));
    return (double)f;
}

extern "C" __global__ void qccl_f64_to_f32(const double* x, float* out, uint64_t count) {
    for (uint64_t i = qccl_tid(); i < count; i += qccl_nthreads()) out[i] = qccl_f64_narrow(x[i]);
}

extern "C" __global__ void qccl_f32_to_f64(const float* x, double* out, uint64_t count) {
    for (uint64_t i = qccl_tid(); i < count; i += qccl_nthreads()) out[i] = qccl_f32_widen(x[i]);
}
