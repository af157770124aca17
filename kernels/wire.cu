// A wire chunk's 32-byte header, written on the stream, for a compressed all-reduce on device
// buffers (src/gpu/sra/): every kernel and copy of such a call is enqueued before its first
// byte moves, and a page-locked send slot is sent from by an earlier exchange until the
// stream reaches this point, so the host cannot write the header when it enqueues the
// encode. The header's bytes travel as kernel arguments (copied at launch).
//
//   qccl_put_header(uint8_t* dst, uint64_t w0, uint64_t w1, uint64_t w2, uint64_t w3)
//       dst[8k + b] = byte b (little-endian) of wk, for k < 4: the 32 bytes at any alignment.
//
// Shape: grid-stride, any grid and block. Shim: sequential.
#include "common.cuh"

extern "C" __global__ void qccl_put_header(uint8_t* dst, uint64_t w0, uint64_t w1, uint64_t w2,
                                           uint64_t w3) {
    QCCL_GRID_STRIDE(i, 32) {
        uint64_t w = i < 8 ? w0 : i < 16 ? w1 : i < 24 ? w2 : w3;
        dst[i] = (uint8_t)(w >> (8 * (i % 8)));
    }
}
