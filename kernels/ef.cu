// Error feedback's first step, and the own-data copy, for a compressed all-reduce on device
// buffers (src/gpu/sra/): the bits of the CPU's `ef::compensate` / `compensate_from`.
//
//   qccl_ef_compensate(const float* x, float* res, float* w, uint64_t count)
//       w[i] = x[i] + res[i], then res[i] = 0; with res null, w[i] = x[i] (a copy, so -0
//       stays -0 as the CPU's copy keeps it). w may equal x (in place).
//
//   qccl_ef_zero(float* res, uint64_t count)
//       res[i] = +0: a new residual, zeroed on the stream (a copy of zeros from the host
//       would wait for the stream's earlier work).
//
// Shape: grid-stride, any grid and block. Shim: sequential.
#include "common.cuh"

extern "C" __global__ void qccl_ef_compensate(const float* x, float* res, float* w,
                                              uint64_t count) {
    QCCL_GRID_STRIDE(i, count) {
        if (res) {
            w[i] = qccl_add(x[i], res[i]);
            res[i] = 0.0f;
        } else {
            w[i] = x[i];
        }
    }
}

extern "C" __global__ void qccl_ef_zero(float* res, uint64_t count) {
    QCCL_GRID_STRIDE(i, count) { res[i] = 0.0f; }
}
