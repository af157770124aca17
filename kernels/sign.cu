// The one-bit codecs of src/codec/sign.rs, payloads bit for bit (the host writes the header;
// the check kernels refuse a received payload's scales as decode_payload does):
//
//   efsign: [f32 scale s = sum|x| / n][sign bits]        decodes to +s / -s
//   onebit: [per bucket: f32 mean of x >= 0, f32 mean of x < 0][sign bits]
// Sign bits: element k at bit k % 8 of byte k / 8, set for x >= 0 (NaN clear), last byte padded
// with zeros. f32 values are little endian at any byte offset.
//
// The scales are the CPU's sums in the CPU's order, so both give the same bits: tiles of 2048
// elements; within a tile (cut at bucket ends for onebit) eight f32 lanes, lane j summing the
// elements at offsets j, j+8, ... in order, then the lanes folded 0..7; across tiles an f64 sum
// in tile order. That last sum is serial (one thread for efsign: count / 2048 dependent adds), the
// part that does not scale on a GPU; a parallel one needs a new CPU order too (a fixed tree), a
// wire-visible change not made here.
//
// efsign encode, three launches in order (scratch: ceil(count / 2048) floats):
//   qccl_efsign_tile_sums(const float* x, float* tile_sums, uint64_t count)
//       8 threads a tile; block a multiple of 32 (256), any grid. Shim: fibers.
//   qccl_efsign_scale(const float* tile_sums, uint8_t* payload, uint64_t count)
//       writes bytes 0..4; one block (launch 1 x 256: its threads stage the sums in shared
//       memory, thread 0 adds them). Shim: fibers.
//   qccl_signs_pack(const float* x, uint8_t* payload + 4, uint64_t count)
// onebit encode, three launches in order (scratch: 3 * S floats, S = qccl_onebit_segments(count,
// bucket) = ceil(n / 2048) + ceil(n / bucket) - ceil(n / lcm(2048, bucket))):
//   qccl_onebit_segment_sums(const float* x, float* seg, uint64_t count, uint32_t bucket)
//       8 threads a tile; block a multiple of 32 (256), any grid. Shim: fibers.
//   qccl_onebit_means(const float* seg, uint8_t* payload, uint64_t count, uint32_t bucket)
//       a thread a bucket, grid-stride. Shim: sequential.
//   qccl_signs_pack(const float* x, uint8_t* payload + 8 * ceil(count / bucket), uint64_t count)
// qccl_signs_pack: a thread a byte (8 elements, 16-byte loads where x is aligned), grid-stride.
// Shim: sequential.
// Error feedback fused into encode (_ef: w = x + res is what is encoded, res is updated in
// place; see qccl_signs_pack_ef): the same sequences with qccl_efsign_tile_sums_ef(x, res,
// tile_sums, count) / qccl_onebit_segment_sums_ef(x, res, seg, count, bucket) first and
// qccl_efsign_pack_ef(x, res, w_out, payload, count) / qccl_onebit_pack_ef(x, res, w_out,
// payload, count, bucket) last, in place of qccl_signs_pack. Shim: as their plain twins.
// Decoders, a thread a byte of bits (8 elements, 16-byte stores where out is aligned),
// grid-stride, shim sequential:
//   qccl_efsign_decode[_add](const uint8_t* payload, float* out, uint64_t count)
//   qccl_onebit_decode[_add](const uint8_t* payload, float* out, uint64_t count, uint32_t bucket)
// Checks, before the decoder on the same stream (which is safe on any payload: it only reads
// the payload's own bytes), set *bad (zeroed by the host) to 1 for scales the encoder cannot
// write (decode_payload's refusal), shim sequential:
//   qccl_efsign_check(const uint8_t* payload, int* bad)   the scale; launch 1 x 1
//   qccl_onebit_check(const uint8_t* payload, int* bad, uint64_t count, uint32_t bucket)
//       a thread a bucket, grid-stride
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

// The encoder's input element i: x[i], or with error feedback w = x[i] + res[i].
template <bool EF>
QCCL_DEVICE float qccl_sign_input(const float* x, const float* res, uint64_t i) {
    return EF ? qccl_add(x[i], res[i]) : x[i];
}

template <bool EF>
QCCL_DEVICE void qccl_efsign_tile_sums_impl(const float* x, const float* res, float* tile_sums,
                                            uint64_t count) {
    unsigned lane = threadIdx.x & 7u;
    uint64_t tiles = qccl_div_ceil(count, QCCL_SIGN_TILE);
    // The 8 threads of a tile loop together: the fold's shuffles need all of them.
    for (uint64_t t = qccl_tid() / 8; t < tiles; t += qccl_nthreads() / 8) {
        uint64_t end = qccl_min_u64((t + 1) * QCCL_SIGN_TILE, count);
        float acc = 0.0f;
        for (uint64_t i = t * QCCL_SIGN_TILE + lane; i < end; i += 8)
            acc = acc + qccl_abs_f32(qccl_sign_input<EF>(x, res, i));
        float s = qccl_fold8(acc);
        if (lane == 0) tile_sums[t] = s;
    }
}

extern "C" __global__ void qccl_efsign_tile_sums(const float* x, float* tile_sums, uint64_t count) {
    qccl_efsign_tile_sums_impl<false>(x, 0, tile_sums, count);
}

extern "C" __global__ void qccl_efsign_tile_sums_ef(const float* x, const float* res,
                                                    float* tile_sums, uint64_t count) {
    qccl_efsign_tile_sums_impl<true>(x, res, tile_sums, count);
}

// Tile sums the scale's block stages in shared memory at a time (the shim's test driver sets
// a small one, so that a test's sums span several windows).
#ifndef QCCL_SIGN_WINDOW
#define QCCL_SIGN_WINDOW 2048u
#endif

extern "C" __global__ void qccl_efsign_scale(const float* tile_sums, uint8_t* payload,
                                             uint64_t count) {
    // The f64 sum runs in tile order, a chain of dependent adds on one thread. Fed straight
    // from global memory it would also wait for each load in turn; the block's threads load a
    // window of sums together (coalesced, in flight at once) into shared memory first.
    __shared__ float window[QCCL_SIGN_WINDOW];
    if (blockIdx.x != 0) return;  // uniform over the block
    uint64_t tiles = qccl_div_ceil(count, QCCL_SIGN_TILE);
    double total = 0.0;
    for (uint64_t w0 = 0; w0 < tiles; w0 += QCCL_SIGN_WINDOW) {
        uint64_t m = qccl_min_u64(QCCL_SIGN_WINDOW, tiles - w0);
        for (uint64_t k = threadIdx.x; k < m; k += blockDim.x) window[k] = tile_sums[w0 + k];
        __syncthreads();
        if (threadIdx.x == 0)
            for (uint64_t k = 0; k < m; k++) total = total + (double)window[k];
        __syncthreads();
    }
    if (threadIdx.x != 0) return;
    float s = count == 0 ? 0.0f : (float)(total / (double)count);
    if (!qccl_finite_f32(s)) s = qccl_f32_from(QCCL_F32_NAN_BITS);
    qccl_store_f32_le(payload, s);
}

// Sign bits of x[8k .. 8k+8) as byte k (bit j set for x >= 0; missing elements clear).
QCCL_DEVICE uint32_t qccl_sign_byte(const float* x, uint64_t k, uint64_t count, bool vec) {
    uint32_t b = 0;
    if (vec && 8 * k + 8 <= count) {
        qccl_x8<float> v = qccl_ld8(x + 8 * k);
        for (uint32_t j = 0; j < 8; j++) b |= (uint32_t)(v.e[j] >= 0.0f) << j;
    } else {
        for (uint64_t i = 8 * k; i < count && i < 8 * k + 8; i++)
            b |= (uint32_t)(x[i] >= 0.0f) << (i - 8 * k);
    }
    return b;
}

extern "C" __global__ void qccl_signs_pack(const float* x, uint8_t* bits, uint64_t count) {
    bool vec = qccl_aligned16(x, x, x);
    QCCL_GRID_STRIDE(k, qccl_div_ceil(count, 8)) bits[k] = (uint8_t)qccl_sign_byte(x, k, count, vec);
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

template <bool EF>
QCCL_DEVICE void qccl_onebit_segment_sums_impl(const float* x, const float* res, float* seg,
                                               uint64_t count, uint32_t bucket) {
    unsigned lane = threadIdx.x & 7u;
    uint64_t tiles = qccl_div_ceil(count, QCCL_SIGN_TILE);
    for (uint64_t t = qccl_tid() / 8; t < tiles; t += qccl_nthreads() / 8) {
        uint64_t tend = qccl_min_u64((t + 1) * QCCL_SIGN_TILE, count);
        for (uint64_t p = t * QCCL_SIGN_TILE; p < tend;) {
            uint64_t end = qccl_min_u64((p / bucket + 1) * bucket, tend);
            float ps = 0.0f, pc = 0.0f, tot = 0.0f;
            for (uint64_t i = p + lane; i < end; i += 8) {
                float v = qccl_sign_input<EF>(x, res, i);
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

extern "C" __global__ void qccl_onebit_segment_sums(const float* x, float* seg, uint64_t count,
                                                    uint32_t bucket) {
    qccl_onebit_segment_sums_impl<false>(x, 0, seg, count, bucket);
}

extern "C" __global__ void qccl_onebit_segment_sums_ef(const float* x, const float* res, float* seg,
                                                       uint64_t count, uint32_t bucket) {
    qccl_onebit_segment_sums_impl<true>(x, res, seg, count, bucket);
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

// out[i] = value(i, bit i) (ADD: out[i] += it), a thread a byte of bits: 8 elements, with
// 16-byte stores where out is aligned.
template <bool ADD, class Value>
QCCL_DEVICE void qccl_signs_decode(const uint8_t* bits, float* out, uint64_t count, Value value) {
    bool vec = qccl_aligned16(out, out, out);
    QCCL_GRID_STRIDE(k, qccl_div_ceil(count, 8)) {
        uint32_t b = bits[k];
        uint64_t i0 = 8 * k;
        if (vec && i0 + 8 <= count) {
            qccl_x8<float> o;
            if (ADD) o = qccl_ld8(out + i0);
            for (uint32_t j = 0; j < 8; j++) {
                float v = value(i0 + j, (b >> j) & 1u);
                o.e[j] = ADD ? qccl_add(o.e[j], v) : v;
            }
            qccl_st8(out + i0, o);
        } else {
            for (uint64_t i = i0; i < count && i < i0 + 8; i++) {
                float v = value(i, (b >> (i - i0)) & 1u);
                out[i] = ADD ? qccl_add(out[i], v) : v;
            }
        }
    }
}

extern "C" __global__ void qccl_efsign_decode(const uint8_t* payload, float* out, uint64_t count) {
    float s = qccl_load_f32_le(payload);
    qccl_signs_decode<false>(payload + 4, out, count, [s](uint64_t, uint32_t set) { return set ? s : qccl_neg(s); });
}

extern "C" __global__ void qccl_efsign_decode_add(const uint8_t* payload, float* out,
                                                  uint64_t count) {
    float s = qccl_load_f32_le(payload);
    qccl_signs_decode<true>(payload + 4, out, count, [s](uint64_t, uint32_t set) { return set ? s : qccl_neg(s); });
}

// Element i of a onebit payload: its bucket's mean for its sign bit. A thread asks for its
// elements in increasing order: the walk (common.cuh) loads a bucket's means once.
struct QcclOnebitCursor {
    const uint8_t* meta;
    QcclBucketWalk walk;
    float pos, neg;
};

QCCL_DEVICE QcclOnebitCursor qccl_onebit_cursor(const uint8_t* meta, uint32_t bucket) {
    QcclOnebitCursor c = {meta, qccl_bucket_walk(bucket), 0.0f, 0.0f};
    return c;
}

QCCL_DEVICE float qccl_onebit_value(QcclOnebitCursor& c, uint64_t i, uint32_t set) {
    if (qccl_bucket_walk_to(c.walk, i)) {
        c.pos = qccl_load_f32_le(c.meta + 8 * c.walk.b);
        c.neg = qccl_load_f32_le(c.meta + 8 * c.walk.b + 4);
    }
    return set ? c.pos : c.neg;
}

extern "C" __global__ void qccl_onebit_decode(const uint8_t* payload, float* out, uint64_t count,
                                              uint32_t bucket) {
    QcclOnebitCursor c = qccl_onebit_cursor(payload, bucket);
    qccl_signs_decode<false>(payload + 8 * qccl_div_ceil(count, bucket), out, count,
                             [&c](uint64_t i, uint32_t set) { return qccl_onebit_value(c, i, set); });
}

extern "C" __global__ void qccl_onebit_decode_add(const uint8_t* payload, float* out,
                                                  uint64_t count, uint32_t bucket) {
    QcclOnebitCursor c = qccl_onebit_cursor(payload, bucket);
    qccl_signs_decode<true>(payload + 8 * qccl_div_ceil(count, bucket), out, count,
                            [&c](uint64_t i, uint32_t set) { return qccl_onebit_value(c, i, set); });
}

// Error feedback's last pass: the sign bits of w = x + res (a thread a byte), then
// res = (0 + w) - decoded(w), the bits of the CPU's EF (compensate, residual += w, residual -=
// decode). x and res are touched by their own thread only; w_out (may be null) receives w.
template <class Value>
QCCL_DEVICE void qccl_signs_pack_ef(const float* x, float* res, float* w_out, uint8_t* bits,
                                    uint64_t count, Value value) {
    bool vec = qccl_aligned16(x, res, w_out ? w_out : x);
    QCCL_GRID_STRIDE(k, qccl_div_ceil(count, 8)) {
        uint32_t b = 0;
        uint64_t i0 = 8 * k;
        if (vec && i0 + 8 <= count) {
            qccl_x8<float> xv = qccl_ld8(x + i0), rv = qccl_ld8(res + i0);
            for (uint32_t j = 0; j < 8; j++) {
                float w = qccl_add(xv.e[j], rv.e[j]);
                uint32_t set = w >= 0.0f;
                b |= set << j;
                rv.e[j] = qccl_sub(qccl_add(0.0f, w), value(i0 + j, set));
                xv.e[j] = w;
            }
            qccl_st8(res + i0, rv);
            if (w_out) qccl_st8(w_out + i0, xv);
        } else {
            for (uint64_t i = i0; i < count && i < i0 + 8; i++) {
                float w = qccl_add(x[i], res[i]);
                uint32_t set = w >= 0.0f;
                b |= set << (i - i0);
                res[i] = qccl_sub(qccl_add(0.0f, w), value(i, set));
                if (w_out) w_out[i] = w;
            }
        }
        bits[k] = (uint8_t)b;
    }
}

// After qccl_efsign_tile_sums_ef and qccl_efsign_scale (which read w = x + res).
extern "C" __global__ void qccl_efsign_pack_ef(const float* x, float* res, float* w_out,
                                               uint8_t* payload, uint64_t count) {
    float s = qccl_load_f32_le(payload);
    qccl_signs_pack_ef(x, res, w_out, payload + 4, count,
                       [s](uint64_t, uint32_t set) { return set ? s : qccl_neg(s); });
}

// After qccl_onebit_segment_sums_ef and qccl_onebit_means.
extern "C" __global__ void qccl_onebit_pack_ef(const float* x, float* res, float* w_out,
                                               uint8_t* payload, uint64_t count, uint32_t bucket) {
    QcclOnebitCursor c = qccl_onebit_cursor(payload, bucket);
    qccl_signs_pack_ef(x, res, w_out, payload + 8 * qccl_div_ceil(count, bucket), count,
                       [&c](uint64_t i, uint32_t set) { return qccl_onebit_value(c, i, set); });
}

// efsign's scale is NaN (from non-finite input) or finite and >= 0.
extern "C" __global__ void qccl_efsign_check(const uint8_t* payload, int* bad) {
    if (qccl_tid() != 0) return;
    float s = qccl_load_f32_le(payload);
    if (!(s != s || (qccl_finite_f32(s) && s >= 0.0f))) *bad = 1;
}

// A onebit bucket's means are both NaN, or finite with the non-negatives' >= 0 and the
// negatives' <= 0.
extern "C" __global__ void qccl_onebit_check(const uint8_t* payload, int* bad, uint64_t count,
                                             uint32_t bucket) {
    QCCL_GRID_STRIDE(b, qccl_div_ceil(count, bucket)) {
        float pos = qccl_load_f32_le(payload + 8 * b), neg = qccl_load_f32_le(payload + 8 * b + 4);
        bool nan = pos != pos && neg != neg;
        bool ok = qccl_finite_f32(pos) && qccl_finite_f32(neg) && pos >= 0.0f && neg <= 0.0f;
        if (!nan && !ok) *bad = 1;
    }
}
