// The one-bit codecs of src/codec/sign.rs, payloads bit for bit (the host writes the header,
// and checks a received payload's scales as decode_payload does before decoding it):
//
//   efsign: [f32 scale s = sum|x| / n][sign bits]        decodes to +s / -s
//   onebit: [per bucket: f32 mean of x >= 0, f32 mean of x < 0][sign bits]
// Sign bits: element k at bit k % 8 of byte k / 8, set for x >= 0 (NaN clear), last byte padded
// with zeros. f32 values are little endian at any byte offset.
//
// The scales are the CPU's sums in the CPU's order, so both give the same bits: tiles of 2048
// elements; within a tile (cut at bucket ends for onebit) eight f32 lanes, lane j summing the
// elements at offsets j, j+8, ... in order, then the lanes folded 0..7; across tiles an f64 sum
// in tile order.
//
// efsign encode, three launches in order (scratch: ceil(count / 2048) floats):
//   qccl_efsign_tile_sums(const float* x, float* tile_sums, uint64_t count)
//       8 threads a tile; block a multiple of 32 (256), any grid. Shim: fibers.
//   qccl_efsign_scale(const float* tile_sums, uint8_t* payload, uint64_t count)
//       writes bytes 0..4; one thread does it all (launch 1 x 1). Shim: sequential.
//   qccl_signs_pack(const float* x, uint8_t* payload + 4, uint64_t count)
// onebit encode, three launches in order (scratch: 3 * qccl_onebit_segments(count, bucket)
// floats; see that function for the count):
//   qccl_onebit_segment_sums(const float* x, float* seg, uint64_t count, uint32_t bucket)
//       8 threads a tile; block a multiple of 32 (256), any grid. Shim: fibers.
//   qccl_onebit_means(const float* seg, uint8_t* payload, uint64_t count, uint32_t bucket)
//       a thread a bucket, grid-stride. Shim: sequential.
//   qccl_signs_pack(const float* x, uint8_t* payload + 8 * ceil(count / bucket), uint64_t count)
// qccl_signs_pack: a thread a byte, grid-stride. Shim: sequential.
// Decoders, a thread an element, grid-stride, shim sequential:
//   qccl_efsign_decode[_add](const uint8_t* payload, float* out, uint64_t count)
//   qccl_onebit_decode[_add](const uint8_t* payload, float* out, uint64_t count, uint32_t bucket)
#include "common.cuh"

#define QCCL_SIGN_TILE 2048ull

// The value of this lane's group of 8 (adjacent threads) folded in lane order from 0.0, as the
// CPU's `[f32; 8].iter().sum()`; every lane of the group gets it. Lanes are never -0 here (sums
// from +0), so the fold's starting zero cannot change a result.
QCCL_DEVICE float qccl_fold8(float v) {
    unsigned mask = 0xffu << (threadIdx.x & 24u);
    float s = 0.0f;
    for (int k = 0; k < 8; k++) s = s + __shfl_sync(mask, v, k, 8);
    return s;
}

extern "C" __global__ void qccl_efsign_tile_sums(const float* x, float* tile_sums, uint64_t count) {
    unsigned lane = threadIdx.x & 7u;
    uint64_t tiles = qccl_div_ceil(count, QCCL_SIGN_TILE);
    // The 8 threads of a tile loop together: the fold's shuffles need all of them.
    for (uint64_t t = qccl_tid() / 8; t < tiles; t += qccl_nthreads() / 8) {
        uint64_t end = qccl_min_u64((t + 1) * QCCL_SIGN_TILE, count);
        float acc = 0.0f;
        for (uint64_t i = t * QCCL_SIGN_TILE + lane; i < end; i += 8) acc = acc + qccl_abs_f32(x[i]);
        float s = qccl_fold8(acc);
        if (lane == 0) tile_sums[t] = s;
    }
}

extern "C" __global__ void qccl_efsign_scale(const float* tile_sums, uint8_t* payload,
                                             uint64_t count) {
    if (qccl_tid() != 0) return;
    uint64_t tiles = qccl_div_ceil(count, QCCL_SIGN_TILE);
    double total = 0.0;
    for (uint64_t t = 0; t < tiles; t++) total = total + (double)tile_sums[t];
    float s = count == 0 ? 0.0f : (float)(total / (double)count);
    if (!qccl_finite_f32(s)) s = qccl_f32_from(QCCL_F32_NAN_BITS);
    qccl_store_f32_le(payload, s);
}

extern "C" __global__ void qccl_signs_pack(const float* x, uint8_t* bits, uint64_t count) {
    uint64_t bytes = qccl_div_ceil(count, 8);
    QCCL_GRID_STRIDE(k, bytes) {
        uint32_t b = 0;
        for (uint32_t j = 0; j < 8; j++) {
            uint64_t i = 8 * k + j;
            if (i < count && x[i] >= 0.0f) b |= 1u << j;
        }
        bits[k] = (uint8_t)b;
    }
}

// Segments are the pieces of [0, count) cut at every multiple of the tile and of the bucket;
// this is how many start before x: multiples of 2048 below x, plus those of the bucket, less
// those of both (their lcm), counting 0 once.
QCCL_DEVICE uint64_t qccl_onebit_segments_before(uint64_t x, uint64_t bucket) {
    uint64_t g = bucket & (~bucket + 1);  // gcd(2048, bucket): the bucket's power-of-two factor
    if (g > QCCL_SIGN_TILE) g = QCCL_SIGN_TILE;
    uint64_t lcm = QCCL_SIGN_TILE / g * bucket;
    return qccl_div_ceil(x, QCCL_SIGN_TILE) + qccl_div_ceil(x, bucket) - qccl_div_ceil(x, lcm);
}

// Segments of a count-element onebit encode: the scratch holds 3 floats for each.
QCCL_DEVICE uint64_t qccl_onebit_segments(uint64_t count, uint64_t bucket) {
    return qccl_onebit_segments_before(count, bucket);
}

extern "C" __global__ void qccl_onebit_segment_sums(const float* x, float* seg, uint64_t count,
                                                    uint32_t bucket) {
    unsigned lane = threadIdx.x & 7u;
    uint64_t tiles = qccl_div_ceil(count, QCCL_SIGN_TILE);
    for (uint64_t t = qccl_tid() / 8; t < tiles; t += qccl_nthreads() / 8) {
        uint64_t tend = qccl_min_u64((t + 1) * QCCL_SIGN_TILE, count);
        for (uint64_t p = t * QCCL_SIGN_TILE; p < tend;) {
            uint64_t end = qccl_min_u64((p / bucket + 1) * bucket, tend);
            float ps = 0.0f, pc = 0.0f, tot = 0.0f;
            for (uint64_t i = p + lane; i < end; i += 8) {
                float v = x[i];
                bool pos = v >= 0.0f;
                ps = ps + (pos ? v : 0.0f);
                pc = pc + (pos ? 1.0f : 0.0f);
                tot = tot + v;
            }
            ps = qccl_fold8(ps);
            pc = qccl_fold8(pc);
            tot = qccl_fold8(tot);
            if (lane == 0) {
                uint64_t s = qccl_onebit_segments_before(p, bucket);
                seg[3 * s] = ps;
                seg[3 * s + 1] = pc;
                seg[3 * s + 2] = tot;
            }
            p = end;
        }
    }
}

extern "C" __global__ void qccl_onebit_means(const float* seg, uint8_t* payload, uint64_t count,
                                             uint32_t bucket) {
    uint64_t buckets = qccl_div_ceil(count, bucket);
    QCCL_GRID_STRIDE(b, buckets) {
        uint64_t start = b * bucket, end = qccl_min_u64(start + bucket, count);
        uint64_t s1 = qccl_onebit_segments_before(end, bucket);
        double ps = 0.0, pc = 0.0, tot = 0.0;
        for (uint64_t s = qccl_onebit_segments_before(start, bucket); s < s1; s++) {
            ps = ps + (double)seg[3 * s];
            pc = pc + (double)seg[3 * s + 1];
            tot = tot + (double)seg[3 * s + 2];
        }
        double nc = (double)(end - start) - pc;
        float pos = pc == 0.0 ? 0.0f : (float)(ps / pc);
        float neg = nc == 0.0 ? 0.0f : (float)((tot - ps) / nc);
        // At most 0 even after the rounding of the difference (the CPU's .min(0.0)).
        neg = neg < 0.0f ? neg : 0.0f;
        if (!(qccl_finite_f64(tot) && qccl_finite_f32(pos) && qccl_finite_f32(neg)))
            pos = neg = qccl_f32_from(QCCL_F32_NAN_BITS);
        qccl_store_f32_le(payload + 8 * b, pos);
        qccl_store_f32_le(payload + 8 * b + 4, neg);
    }
}

QCCL_DEVICE bool qccl_sign_bit(const uint8_t* bits, uint64_t i) { return (bits[i >> 3] >> (i & 7)) & 1u; }

extern "C" __global__ void qccl_efsign_decode(const uint8_t* payload, float* out, uint64_t count) {
    float s = qccl_load_f32_le(payload);
    QCCL_GRID_STRIDE(i, count) out[i] = qccl_sign_bit(payload + 4, i) ? s : -s;
}

extern "C" __global__ void qccl_efsign_decode_add(const uint8_t* payload, float* out,
                                                  uint64_t count) {
    float s = qccl_load_f32_le(payload);
    QCCL_GRID_STRIDE(i, count) out[i] = out[i] + (qccl_sign_bit(payload + 4, i) ? s : -s);
}

// Element i of a onebit payload: its bucket's mean for its sign bit.
QCCL_DEVICE float qccl_onebit_value(const uint8_t* payload, uint64_t count, uint32_t bucket,
                                    uint64_t i) {
    const uint8_t* bits = payload + 8 * qccl_div_ceil(count, bucket);
    const uint8_t* m = payload + 8 * (i / bucket);
    return qccl_sign_bit(bits, i) ? qccl_load_f32_le(m) : qccl_load_f32_le(m + 4);
}

extern "C" __global__ void qccl_onebit_decode(const uint8_t* payload, float* out, uint64_t count,
                                              uint32_t bucket) {
    QCCL_GRID_STRIDE(i, count) out[i] = qccl_onebit_value(payload, count, bucket, i);
}

extern "C" __global__ void qccl_onebit_decode_add(const uint8_t* payload, float* out,
                                                  uint64_t count, uint32_t bucket) {
    QCCL_GRID_STRIDE(i, count) out[i] = out[i] + qccl_onebit_value(payload, count, bucket, i);
}
