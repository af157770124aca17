/* qsgd: bucketed max-min / max-abs quantization, bit for bit the payload of src/codec/qsgd.rs.
 *
 * Payload of n elements: ceil(n / bucket) bucket scales (maxmin: lo, hi as f32; maxabs: m as
 * f32, levels over [-m, m]), then one dense stream of B-bit levels, element e at bits
 * e*B .. e*B+B, least significant bit first, ceil(n*B / 8) bytes. Eight elements always fill
 * exactly B bytes, so one thread per group of eight writes whole bytes of its own, whatever the
 * bucket size: no two threads share a byte. A bucket holding a non-finite value has NaN scales
 * and decodes to NaN.
 *
 * Entries, arguments as kernels/README.md orders them (any grid; shim mode fibers for the file:
 * the scale scans shuffle across a warp, the other kernels never wait for another thread):
 *   encode: the scales, then the levels on the same stream (levels read the scales):
 *           scales, bucket <= QSGD_RUN (4096): qccl_qsgd_bounds(x, payload, n, bucket, maxabs),
 *             a warp per bucket of 32 elements or more (block a multiple of 32), a thread per
 *             smaller bucket (grid-stride);
 *           scales, larger buckets: qccl_qsgd_runs(x, runs, n, bucket, maxabs), a warp per
 *             4096-element run (block a multiple of 32; scratch: ceil(n / bucket) *
 *             ceil(bucket / 4096) QsgdLanes of 68 bytes), then qccl_qsgd_merge(runs, payload,
 *             n, bucket, maxabs), a thread per bucket (either path works for any bucket; they
 *             give the same bits);
 *           levels: qccl_qsgd_levels(x, payload, n, bits, bucket, maxabs, nearest, key), a
 *             thread per group of 8 elements (grid-stride);
 *   encode with error feedback: the same with qccl_qsgd_bounds_ef(x, res, payload, n, bucket,
 *           maxabs) or qccl_qsgd_runs_ef(x, res, runs, n, bucket, maxabs), then
 *           qccl_qsgd_levels_ef(x, res, w_out, payload, n, bits, bucket, maxabs, nearest, key);
 *   decode: qccl_qsgd_check(payload, bad, n, bucket, maxabs), a thread per bucket (the host
 *           reads *bad, zeroed before: 1 = refuse the chunk), then qccl_qsgd_decode or
 *           qccl_qsgd_decode_add(payload, out, n, bits, bucket, maxabs), a thread per group.
 * `payload` points at the payload (after the 32-byte header the host writes); it needs no
 * alignment (every access is bytewise). Codec fields: bits 1..8, bucket 1..2^24, maxabs 0|1,
 * nearest 0|1 (0: stochastic, element i's uniform is qccl_uniform24(key, i)).
 *
 * Error feedback (_ef): the input is w = x + res (the residual add), the payload encodes w, and
 * res becomes (0 + w) - decoded(w), the bits of the Rust EF wrapper (compensate, then
 * residual += w, residual -= decode). x and res are read and written by the same thread only,
 * so w_out may alias x and res is updated in place; w_out may be null (w is not kept). */
#include "common.cuh"
#include "draw.cuh"

/* Little-endian f32 load and store at any byte address. */
QCCL_DEVICE float qsgd_load_f32(const uint8_t *p) {
    return qccl_f32_from((unsigned)p[0] | (unsigned)p[1] << 8 | (unsigned)p[2] << 16 |
                         (unsigned)p[3] << 24);
}
QCCL_DEVICE void qsgd_store_f32(uint8_t *p, float f) {
    unsigned u = qccl_f32_bits(f);
    p[0] = (unsigned char)u;
    p[1] = (unsigned char)(u >> 8);
    p[2] = (unsigned char)(u >> 16);
    p[3] = (unsigned char)(u >> 24);
}

QCCL_DEVICE int qsgd_finite(float f) { return (qccl_f32_bits(f) & 0x7f800000u) != 0x7f800000u; }

QCCL_DEVICE uint64_t qsgd_meta_bytes(uint64_t n, unsigned bucket, int maxabs) {
    return (n + bucket - 1) / bucket * (maxabs ? 4u : 8u);
}

/* Element i of the encoder's input: x, or x + res with error feedback. */
template <bool EF>
QCCL_DEVICE float qsgd_input(const float *x, const float *res, uint64_t i) {
    return EF ? qccl_add(x[i], res[i]) : x[i];
}

/* A bucket's scales are computed as the Rust encoder does: eight lane accumulators (element e
 * of the bucket in lane e % 8), written as comparisons, then merged lane by lane. Lanes matter
 * for the sign of a zero bound (-0.0 and 0.0 compare equal: the first one a lane meets stays).
 * Runs of a bucket (multiples of 8 long) can be scanned apart and merged in order with the same
 * strict comparisons: the first occurrence still wins. */
struct QsgdLanes {
    float lo[8], hi[8];
    int bad;
};

QCCL_DEVICE void qsgd_lanes_init(QsgdLanes &a) {
    for (int j = 0; j < 8; j++) {
        a.lo[j] = qccl_f32_from(0x7f800000u);
        a.hi[j] = qccl_f32_from(0xff800000u);
    }
    a.bad = 0;
}

/* Scans elements start .. start+len, the first of them in lane 0. */
template <bool EF>
QCCL_DEVICE void qsgd_lanes_scan(QsgdLanes &a, const float *x, const float *res, uint64_t start,
                                 uint64_t len, int maxabs) {
    for (uint64_t e = 0; e < len; e++) {
        float x0 = qsgd_input<EF>(x, res, start + e);
        float v = maxabs ? qccl_f32_from(qccl_f32_bits(x0) & 0x7fffffffu) : x0;
        int j = (int)(e & 7);
        if (!maxabs)
            a.lo[j] = v < a.lo[j] ? v : a.lo[j];
        a.hi[j] = v > a.hi[j] ? v : a.hi[j];
        a.bad |= !qsgd_finite(x0);
    }
}

/* Folds a later run's lanes into a. */
QCCL_DEVICE void qsgd_lanes_merge(QsgdLanes &a, const QsgdLanes &b) {
    for (int j = 0; j < 8; j++) {
        a.lo[j] = b.lo[j] < a.lo[j] ? b.lo[j] : a.lo[j];
        a.hi[j] = b.hi[j] > a.hi[j] ? b.hi[j] : a.hi[j];
    }
    a.bad |= b.bad;
}

/* Merges the lanes and stores bucket bi's scales (NaN for a non-finite bucket). */
QCCL_DEVICE void qsgd_lanes_store(const QsgdLanes &a, int maxabs, uint8_t *meta, uint64_t bi) {
    float l = qccl_f32_from(0x7f800000u), h = qccl_f32_from(0xff800000u);
    for (int j = 0; j < 8; j++) {
        l = a.lo[j] < l ? a.lo[j] : l;
        h = a.hi[j] > h ? a.hi[j] : h;
    }
    if (maxabs)
        l = qccl_neg(h);
    if (a.bad || !qsgd_finite(l) || !qsgd_finite(h)) {
        l = qccl_f32_from(0x7fc00000u);
        h = l;
    }
    if (maxabs) {
        qsgd_store_f32(meta + 4 * bi, h);
    } else {
        qsgd_store_f32(meta + 8 * bi, l);
        qsgd_store_f32(meta + 8 * bi + 4, h);
    }
}

/* The warp's scan of elements start .. start+len of a bucket (the first of them at offset
 * `first` in the bucket), its lanes reading 32 apart so that each load is coalesced. Element e
 * of a bucket is the CPU's lane e % 8; the CPU keeps the first of equal values a lane meets,
 * then the lowest lane, so a bound's winner is the extreme value, ties (equal values differ in
 * bits only as -0.0 and 0.0) going to the lowest (e % 8, e). A warp lane's elements share
 * e % 8 (first is a multiple of 32) and come in order, so it keeps its first; the lanes then
 * fold in that order. Lane l of the result holds in a.lo[0] and a.hi[0] the winners of the
 * elements it and the lanes 8, 16 and 24 away read (the CPU's lane l % 8) or, when `whole`, of
 * all 32 lanes (the scanned elements' bounds); a.bad is the whole warp's. Every lane of the
 * warp calls it with the same arguments. */
QCCL_DEVICE int qsgd_before(unsigned a, unsigned b) {
    return (a & 7u) != (b & 7u) ? (a & 7u) < (b & 7u) : a < b;
}

template <bool EF>
QCCL_DEVICE void qsgd_warp_scan(QsgdLanes &a, const float *x, const float *res, uint64_t start,
                                uint64_t len, uint64_t first, int maxabs, bool whole) {
    const unsigned all = 0xffffffffu, lane = threadIdx.x & 31u;
    float lo = qccl_f32_from(0x7f800000u), hi = qccl_f32_from(0xff800000u);
    /* Offsets in the bucket; none (all ones) orders after every element. */
    unsigned lo_at = ~0u, hi_at = ~0u;
    int bad = 0;
    for (uint64_t e = lane; e < len; e += 32) {
        float x0 = qsgd_input<EF>(x, res, start + e);
        float v = maxabs ? qccl_abs_f32(x0) : x0;
        unsigned at = (unsigned)(first + e);
        if (v < lo) {
            lo = v;
            lo_at = at;
        }
        if (v > hi) {
            hi = v;
            hi_at = at;
        }
        bad |= !qsgd_finite(x0);
    }
    /* Lanes 16, then 8 apart share e % 8; 4, 2, 1 apart fold the CPU's lanes. */
    for (int d = 16; d >= (whole ? 1 : 8); d >>= 1) {
        /* One 64-bit shuffle per bound: its value's bits and its offset. */
        uint64_t ol = __shfl_xor_sync(all, (uint64_t)qccl_f32_bits(lo) << 32 | lo_at, d);
        uint64_t oh = __shfl_xor_sync(all, (uint64_t)qccl_f32_bits(hi) << 32 | hi_at, d);
        float olo = qccl_f32_from((uint32_t)(ol >> 32)), ohi = qccl_f32_from((uint32_t)(oh >> 32));
        if (olo < lo || (olo == lo && qsgd_before((unsigned)ol, lo_at))) {
            lo = olo;
            lo_at = (unsigned)ol;
        }
        if (ohi > hi || (ohi == hi && qsgd_before((unsigned)oh, hi_at))) {
            hi = ohi;
            hi_at = (unsigned)oh;
        }
    }
    a.lo[0] = lo;
    a.hi[0] = hi;
    a.bad = __any_sync(all, bad);
}

/* A warp per bucket for buckets of 32 elements or more (block a multiple of 32); smaller
 * buckets a thread each, scanning as the CPU does. */
template <bool EF>
QCCL_DEVICE void qsgd_bounds(const float *x, const float *res, uint64_t n, unsigned bucket,
                             int maxabs, uint8_t *payload) {
    uint64_t nb = (n + bucket - 1) / bucket;
    if (bucket < 32) {
        QCCL_GRID_STRIDE(bi, nb) {
            uint64_t start = bi * bucket;
            uint64_t len = n - start < bucket ? n - start : bucket;
            QsgdLanes a;
            qsgd_lanes_init(a);
            qsgd_lanes_scan<EF>(a, x, res, start, len, maxabs);
            qsgd_lanes_store(a, maxabs, payload, bi);
        }
        return;
    }
    /* The warp loops together: the fold's shuffles need every lane. */
    for (uint64_t bi = qccl_tid() / 32; bi < nb; bi += qccl_nthreads() / 32) {
        uint64_t start = bi * bucket;
        uint64_t len = n - start < bucket ? n - start : bucket;
        QsgdLanes a;
        qsgd_lanes_init(a);
        qsgd_warp_scan<EF>(a, x, res, start, len, 0, maxabs, true);
        if ((threadIdx.x & 31u) == 0)
            qsgd_lanes_store(a, maxabs, payload, bi);
    }
}

/* Large buckets: a warp per run of QSGD_RUN elements (a multiple of 32; block a multiple of
 * 32) writes the CPU's eight lanes of the run to `runs` (ceil(n / bucket) *
 * ceil(bucket / QSGD_RUN) QsgdLanes), then a thread per bucket merges them in order. */
#define QSGD_RUN 4096u

QCCL_DEVICE uint64_t qsgd_runs_per_bucket(unsigned bucket) {
    return (bucket + QSGD_RUN - 1) / QSGD_RUN;
}

template <bool EF>
QCCL_DEVICE void qsgd_runs(const float *x, const float *res, QsgdLanes *runs, uint64_t n,
                           unsigned bucket, int maxabs) {
    uint64_t rpb = qsgd_runs_per_bucket(bucket), nb = (n + bucket - 1) / bucket;
    unsigned lane = threadIdx.x & 31u;
    for (uint64_t g = qccl_tid() / 32; g < nb * rpb; g += qccl_nthreads() / 32) {
        uint64_t bi = g / rpb, r = g % rpb;
        uint64_t end = (bi + 1) * bucket < n ? (bi + 1) * bucket : n;
        uint64_t start = bi * bucket + r * QSGD_RUN;
        uint64_t len = start >= end ? 0 : (end - start < QSGD_RUN ? end - start : QSGD_RUN);
        QsgdLanes a;
        qsgd_lanes_init(a);
        qsgd_warp_scan<EF>(a, x, res, start, len, r * QSGD_RUN, maxabs, false);
        /* Lanes 0..7 hold the CPU's lanes 0..7; the flag is the whole run's. */
        if (lane < 8) {
            runs[g].lo[lane] = a.lo[0];
            runs[g].hi[lane] = a.hi[0];
        }
        if (lane == 0)
            runs[g].bad = a.bad;
    }
}

/* A bucket's (lo, hi) as stored: maxabs keeps m for [-m, m]. */
QCCL_DEVICE void qsgd_read_bounds(const uint8_t *meta, uint64_t bi, int maxabs, float *lo,
                                  float *hi) {
    if (maxabs) {
        float m = qsgd_load_f32(meta + 4 * bi);
        *lo = qccl_neg(m);
        *hi = m;
    } else {
        *lo = qsgd_load_f32(meta + 8 * bi);
        *hi = qsgd_load_f32(meta + 8 * bi + 4);
    }
}

/* The decoder's dequantizer of one bucket: x = mid + (2q - L) * hs, clamped to [lo, hi]. */
struct QsgdDequant {
    float lo, hi, mid, hs;
};

QCCL_DEVICE QsgdDequant qsgd_dequant(float l, float h, unsigned top) {
    QsgdDequant d;
    d.lo = l;
    d.hi = h;
    d.mid = l * 0.5f + h * 0.5f;
    d.hs = (h * 0.5f - l * 0.5f) / (float)top;
    return d;
}

QCCL_DEVICE float qsgd_value(const QsgdDequant &d, unsigned q, unsigned top) {
    float k = (float)(2 * (int)q - (int)top);
    float v = d.mid + k * d.hs;
    v = v < d.hi ? v : d.hi;
    v = v > d.lo ? v : d.lo;
    return v;
}

/* The first m (at most 8) elements of a float buffer from element i: 16-byte loads where
 * `vec` and all 8 are there. Loops over a group run to 8 and stop at m inside, a constant
 * trip count the compiler unrolls, so a group's arrays stay in registers. */
QCCL_DEVICE void qsgd_load8(float *v, const float *p, uint64_t i, unsigned m, bool vec) {
    if (vec && m == 8) {
        qccl_x8<float> r = qccl_ld8(p + i);
        for (int j = 0; j < 8; j++)
            v[j] = r.e[j];
        return;
    }
    for (unsigned j = 0; j < 8; j++)
        v[j] = j < m ? p[i + j] : 0.0f;
}

QCCL_DEVICE void qsgd_store8(float *p, const float *v, uint64_t i, unsigned m, bool vec) {
    if (vec && m == 8) {
        qccl_x8<float> r;
        for (int j = 0; j < 8; j++)
            r.e[j] = v[j];
        qccl_st8(p + i, r);
        return;
    }
    for (unsigned j = 0; j < 8; j++)
        if (j < m)
            p[i + j] = v[j];
}

/* The levels of group g (elements 8g .. 8g+7), packed into the B bytes at g*B of the stream. */
template <bool EF>
QCCL_DEVICE void qsgd_levels(const float *x, float *res, float *w_out, uint64_t n, unsigned bits,
                             unsigned bucket, int maxabs, int nearest, uint64_t key,
                             uint8_t *payload) {
    const unsigned top = (1u << bits) - 1u;
    const float topf = (float)top;
    uint8_t *stream = payload + qsgd_meta_bytes(n, bucket, maxabs);
    uint64_t groups = (n + 7) / 8;
    bool vec = qccl_aligned16(x, EF ? res : x, EF && w_out ? w_out : x);
    /* The quantizer of the bucket the walk is in (common.cuh: loaded once per bucket). */
    QcclBucketWalk walk = qccl_bucket_walk(bucket);
    float lo2 = 0.0f, inv = 0.0f;
    QsgdDequant dq = {0.0f, 0.0f, 0.0f, 0.0f};
    QCCL_GRID_STRIDE(g, groups) {
        uint64_t base = 8 * g;
        unsigned m = n - base < 8 ? (unsigned)(n - base) : 8u;
        float w[8], r8[8];
        qsgd_load8(w, x, base, m, vec);
        if (EF) {
            qsgd_load8(r8, res, base, m, vec);
            for (unsigned j = 0; j < 8; j++)
                w[j] = qccl_add(w[j], r8[j]);
        }
        uint64_t acc = 0;
        unsigned long long pair = 0; /* the draw of elements i & ~1 and i | 1 */
        for (unsigned j = 0; j < 8; j++) {
            if (j >= m)
                break;
            uint64_t i = base + j;
            if (qccl_bucket_walk_to(walk, i)) {
                float l, h;
                qsgd_read_bounds(payload, walk.b, maxabs, &l, &h);
                float d = h * 0.5f - l * 0.5f;
                /* d > 0 is false for NaN scales and constant buckets: every level is then 0. */
                if (d > 0.0f) {
                    lo2 = l * 0.5f;
                    inv = topf / d;
                } else {
                    lo2 = 0.0f;
                    inv = 0.0f;
                }
                if (EF)
                    dq = qsgd_dequant(l, h, top);
            }
            /* base is even: even j starts a pair. */
            if (!nearest && (j & 1u) == 0)
                pair = qccl_draw(key, i >> 1);
            float r = nearest ? 0.5f : qccl_uniform24_of(pair, (unsigned)(i & 1u));
            float t = (w[j] * 0.5f - lo2) * inv + r;
            t = t > 0.0f ? t : 0.0f; /* also maps NaN to 0 */
            t = t < topf ? t : topf;
            unsigned q = (unsigned)t; /* t >= 0: truncation is floor */
            acc |= (uint64_t)q << (bits * j);
            if (EF) {
                float e = qccl_add(0.0f, w[j]);
                r8[j] = qccl_sub(e, qsgd_value(dq, q, top));
            }
        }
        if (EF) {
            qsgd_store8(res, r8, base, m, vec);
            if (w_out)
                qsgd_store8(w_out, w, base, m, vec);
        }
        /* The last group owns only the stream's remaining bytes. */
        uint64_t total = (n * bits + 7) / 8;
        uint64_t at = g * bits;
        unsigned nbytes = total - at < bits ? (unsigned)(total - at) : bits;
        for (unsigned b = 0; b < nbytes; b++)
            stream[at + b] = (unsigned char)(acc >> (8 * b));
    }
}

/* Sets *bad to 1 when a bucket's scales cannot come from the encoder: the decoder rejects the
 * chunk (before decoding anything) as the Rust decoder does. Valid: both NaN, or finite with
 * lo <= hi. */
extern "C" __global__ void qccl_qsgd_check(const uint8_t *payload, int *bad, uint64_t n,
                                           unsigned bucket, int maxabs) {
    uint64_t nb = (n + bucket - 1) / bucket;
    QCCL_GRID_STRIDE(bi, nb) {
        float l, h;
        qsgd_read_bounds(payload, bi, maxabs, &l, &h);
        int nan = l != l && h != h;
        int ok = qsgd_finite(l) && qsgd_finite(h) && l <= h;
        if (!nan && !ok)
            *bad = 1;
    }
}

template <bool ADD>
QCCL_DEVICE void qsgd_decode(const uint8_t *payload, float *out, uint64_t n, unsigned bits,
                             unsigned bucket, int maxabs) {
    const unsigned top = (1u << bits) - 1u;
    const uint8_t *stream = payload + qsgd_meta_bytes(n, bucket, maxabs);
    uint64_t groups = (n + 7) / 8;
    uint64_t total = (n * bits + 7) / 8;
    bool vec = qccl_aligned16(out, out, out);
    QcclBucketWalk walk = qccl_bucket_walk(bucket);
    QsgdDequant dq = {0.0f, 0.0f, 0.0f, 0.0f};
    QCCL_GRID_STRIDE(g, groups) {
        uint64_t at = g * bits, base = 8 * g;
        unsigned m = n - base < 8 ? (unsigned)(n - base) : 8u;
        unsigned nbytes = total - at < bits ? (unsigned)(total - at) : bits;
        uint64_t acc = 0;
        for (unsigned b = 0; b < nbytes; b++)
            acc |= (uint64_t)stream[at + b] << (8 * b);
        float v[8];
        if (ADD)
            qsgd_load8(v, out, base, m, vec);
        for (unsigned j = 0; j < 8; j++) {
            if (j >= m)
                break;
            if (qccl_bucket_walk_to(walk, base + j)) {
                float l, h;
                qsgd_read_bounds(payload, walk.b, maxabs, &l, &h);
                dq = qsgd_dequant(l, h, top);
            }
            unsigned q = (unsigned)(acc >> (bits * j)) & top;
            float d = qsgd_value(dq, q, top);
            v[j] = ADD ? qccl_add(v[j], d) : d;
        }
        qsgd_store8(out, v, base, m, vec);
    }
}

extern "C" __global__ void qccl_qsgd_decode(const uint8_t *payload, float *out, uint64_t n,
                                            unsigned bits, unsigned bucket, int maxabs) {
    qsgd_decode<false>(payload, out, n, bits, bucket, maxabs);
}

extern "C" __global__ void qccl_qsgd_decode_add(const uint8_t *payload, float *out,
                                                uint64_t n, unsigned bits, unsigned bucket,
                                                int maxabs) {
    qsgd_decode<true>(payload, out, n, bits, bucket, maxabs);
}

extern "C" __global__ void qccl_qsgd_bounds(const float *x, uint8_t *payload, uint64_t n,
                                            unsigned bucket, int maxabs) {
    qsgd_bounds<false>(x, 0, n, bucket, maxabs, payload);
}

extern "C" __global__ void qccl_qsgd_runs(const float *x, QsgdLanes *runs, uint64_t n,
                                          unsigned bucket, int maxabs) {
    qsgd_runs<false>(x, 0, runs, n, bucket, maxabs);
}

extern "C" __global__ void qccl_qsgd_runs_ef(const float *x, const float *res, QsgdLanes *runs,
                                             uint64_t n, unsigned bucket, int maxabs) {
    qsgd_runs<true>(x, res, runs, n, bucket, maxabs);
}

extern "C" __global__ void qccl_qsgd_merge(const QsgdLanes *runs, uint8_t *payload, uint64_t n,
                                           unsigned bucket, int maxabs) {
    uint64_t rpb = qsgd_runs_per_bucket(bucket), nb = (n + bucket - 1) / bucket;
    QCCL_GRID_STRIDE(bi, nb) {
        QsgdLanes a = runs[bi * rpb];
        for (uint64_t r = 1; r < rpb; r++)
            qsgd_lanes_merge(a, runs[bi * rpb + r]);
        qsgd_lanes_store(a, maxabs, payload, bi);
    }
}

extern "C" __global__ void qccl_qsgd_levels(const float *x, uint8_t *payload, uint64_t n,
                                            unsigned bits, unsigned bucket, int maxabs,
                                            int nearest, uint64_t key) {
    qsgd_levels<false>(x, 0, 0, n, bits, bucket, maxabs, nearest, key, payload);
}

extern "C" __global__ void qccl_qsgd_bounds_ef(const float *x, const float *res,
                                               uint8_t *payload, uint64_t n, unsigned bucket,
                                               int maxabs) {
    qsgd_bounds<true>(x, res, n, bucket, maxabs, payload);
}

extern "C" __global__ void qccl_qsgd_levels_ef(const float *x, float *res, float *w_out,
                                               uint8_t *payload, uint64_t n, unsigned bits,
                                               unsigned bucket, int maxabs, int nearest,
                                               uint64_t key) {
    qsgd_levels<true>(x, res, w_out, n, bits, bucket, maxabs, nearest, key, payload);
}
