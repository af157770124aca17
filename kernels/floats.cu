// The float codecs of src/codec/floats.rs: `none` (f32 as is), `fp16` and `bf16` (each element
// rounded to nearest even; NaN quieted, as the `half` crate does). Payloads only: the 32-byte
// header is the host's. Payload layout: element i at bytes 2i..2i+2 (4i..4i+4 for none), little
// endian, which is the device's byte order.
//
//   qccl_<codec>_encode(const float* x, T* payload, uint64_t count)
//   qccl_<codec>_decode(const T* payload, float* out, uint64_t count)       out[i] = value
//   qccl_<codec>_decode_add(const T* payload, float* out, uint64_t count)   out[i] += value
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
    extern "C" __global__ void qccl_##codec##_decode_add(const T* payload, float* out,           \
                                                         uint64_t count) {                       \
        QCCL_GRID_STRIDE(i, count) out[i] = out[i] + DECODE(payload[i]);                         \
    }

QCCL_FLOAT_CODEC(none, float, qccl_f32_to_none, qccl_none_to_f32)
QCCL_FLOAT_CODEC(fp16, uint16_t, qccl_f32_to_f16, qccl_f16_to_f32)
QCCL_FLOAT_CODEC(bf16, uint16_t, qccl_f32_to_bf16, qccl_bf16_to_f32)
