// The float codecs of src/codec/floats.rs: `none` (f32 as is), `fp16` and `bf16` (each element
// rounded to nearest even; NaN quieted, as the `half` crate does). Payloads only: the 32-byte
// header is the host's. Payload layout: element i at bytes 2i..2i+2 (4i..4i+4 for none), little
// endian, which is the device's byte order.
//
//   qccl_<codec>_encode(const float* x, T* payload, uint64_t count)
//   qccl_<codec>_decode(const T* payload, float* out, uint64_t count)       out[i] = value
//   qccl_<codec>_decode_add(const T* payload, float* out, uint64_t count)   out[i] += value
//
//   qccl_<codec>_encode_ef(const float* x, float* res, float* w_out, T* payload, uint64_t count)
//       error feedback fused: encodes w = x + res, then res = (0 + w) - decoded(w) (the bits of
//       the CPU's compensate, residual += w, residual -= decode); w_out (may be null) gets w.
//       Each element is touched by its own thread only.
//
// codec: fp16, bf16 (T = uint16_t), none (T = float). The payload must be aligned to its
// element (the header is 32 bytes, so a payload is whenever its chunk is).
// Shape: grid-stride, any grid and block. Shim: sequential.
#include "common.cuh"

QCCL_DEVICE float qccl_none_to_f32(float x) { return x; }
QCCL_DEVICE float qccl_f32_to_none(float x) { return x; }

#define QCCL_FLOAT_CODEC(codec, T, ENCODE, DECODE)                                               \
    extern "C" __global__ void qccl_##codec##_encode(const float* x, T* payload,                 \
                                                     uint64_t count) {                           \
        QCCL_GRID_STRIDE(i, count) payload[i] = ENCODE(x[i]);                                    \
    }                                                                                            \
    extern "C" __global__ void qccl_##codec##_decode(const T* payload, float* out,               \
                                                     uint64_t count) {                           \
        QCCL_GRID_STRIDE(i, count) out[i] = DECODE(payload[i]);                                  \
    }                                                                                            \
    extern "C" __global__ void qccl_##codec##_encode_ef(const float* x, float* res, float* w_out,  \
                                                        T* payload, uint64_t count) {          \
        QCCL_GRID_STRIDE(i, count) {                                                             \
            float w = x[i] + res[i];                                                             \
            T p = ENCODE(w);                                                                     \
            payload[i] = p;                                                                      \
            res[i] = (0.0f + w) - DECODE(p);                                                     \
            if (w_out) w_out[i] = w;                                                             \
        }                                                                                        \
    }                                                                                            \
    extern "C" __global__ void qccl_##codec##_decode_add(const T* payload, float* out,           \
                                                         uint64_t count) {                       \
        QCCL_GRID_STRIDE(i, count) out[i] = out[i] + DECODE(payload[i]);                         \
    }

QCCL_FLOAT_CODEC(none, float, qccl_f32_to_none, qccl_none_to_f32)
QCCL_FLOAT_CODEC(fp16, uint16_t, qccl_f32_to_f16, qccl_f16_to_f32)
QCCL_FLOAT_CODEC(bf16, uint16_t, qccl_f32_to_bf16, qccl_bf16_to_f32)
