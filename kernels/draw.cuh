/* The codecs' counter-based draw: the C twin of src/codec/rng.rs, bit for bit.
 *
 * Pinned spec (CPU and GPU must agree):
 *   site key K      = qccl_site_key(seed, step, chunk, rank): splitmix64's mix chained over
 *                     seed ^ "QCCL-cod", step, rotl(chunk, 17), rotl(rank, 41);
 *   draw(K, j)      = mix(K + (j + 1) * 0x9e3779b97f4a7c15), wrapping u64: output j of a
 *                     splitmix64 stream started at K;
 *   element i bits  = low half of draw(K, i / 2) for even i, high half for odd i;
 *   24-bit uniform  = those 32 bits >> 8, times 2^-24, in [0, 1);
 *   random-k        = k strata, stratum t covers [t*n/k, (t+1)*n/k) (floor, 64-bit products)
 *                     and keeps start + draw(K, t) % len.
 *
 * Plain C/CUDA, no headers: NVRTC compiles it without the CUDA toolkit's includes, g++ through
 * the shim, a C compiler for host parity tests. */
#ifndef QCCL_DRAW_CUH
#define QCCL_DRAW_CUH

#ifndef QCCL_DEVICE
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define QCCL_DEVICE __device__ inline
#else
#define QCCL_DEVICE static inline
#endif
#endif

/* splitmix64's finaliser: a bijective 64-bit mix. */
QCCL_DEVICE unsigned long long qccl_mix(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

QCCL_DEVICE unsigned long long qccl_rotl64(unsigned long long x, unsigned r) {
    return (x << r) | (x >> (64u - r));
}

/* The site key K of the encode at (seed, step, chunk, rank). */
QCCL_DEVICE unsigned long long qccl_site_key(unsigned long long seed, unsigned long long step,
                                             unsigned long long chunk, unsigned long long rank) {
    unsigned long long k = qccl_mix(seed ^ 0x5143434c2d636f64ULL); /* "QCCL-cod" */
    k = qccl_mix(k ^ step);
    k = qccl_mix(k ^ qccl_rotl64(chunk, 17));
    return qccl_mix(k ^ qccl_rotl64(rank, 41));
}

/* Output j of the splitmix64 stream keyed by key. */
QCCL_DEVICE unsigned long long qccl_draw(unsigned long long key, unsigned long long j) {
    return qccl_mix(key + (j + 1ULL) * 0x9e3779b97f4a7c15ULL);
}

/* Element i's 32 random bits: one half of draw(key, i / 2), low for even i. */
QCCL_DEVICE unsigned qccl_draw32(unsigned long long key, unsigned long long i) {
    return (unsigned)(qccl_draw(key, i >> 1) >> ((i & 1ULL) * 32u));
}

/* The uniform in [0, 1) with 24 bits of resolution of one half (0: low, 1: high) of a draw:
 * elements 2j and 2j + 1 share draw(key, j), so a thread holding both draws once. */
QCCL_DEVICE float qccl_uniform24_of(unsigned long long draw, unsigned half) {
    return (float)((unsigned)(draw >> (half * 32u)) >> 8) * (1.0f / 16777216.0f);
}

/* Element i's uniform in [0, 1) with 24 bits of resolution (stochastic rounding). */
QCCL_DEVICE float qccl_uniform24(unsigned long long key, unsigned long long i) {
    return qccl_uniform24_of(qccl_draw(key, i >> 1), (unsigned)(i & 1ULL));
}

/* Random-k: the index kept in stratum t of k over n elements (0 <= t < k <= n). */
QCCL_DEVICE unsigned long long qccl_randk_index(unsigned long long key, unsigned long long n,
                                                unsigned long long k, unsigned long long t) {
    unsigned long long start = t * n / k;
    unsigned long long end = (t + 1ULL) * n / k;
    return start + qccl_draw(key, t) % (end - start);
}

#endif /* QCCL_DRAW_CUH */
