// Shim driver for the sparsifiers: kernels/topk.cu, mstopk.cu, randk.cu and sparse.cu, in the
// launch sequences their headers document, on odd grid shapes so every grid-stride loop wraps.
// Entries (argument keys):
//   encode: codec (0 topk, 1 mstopk, 2 randk), count, k, samplings (mstopk), key, ef (0|1),
//       x (f32 input), res (f32 input, with ef), payload (output), res_out (f32 output, with ef);
//       with ef, topk and mstopk run qccl_sparse_compensate, the selection on w, then
//       qccl_sparse_ef_sub; randk runs qccl_randk_encode_ef (its pairs of w), then
//       qccl_sparse_compensate and qccl_sparse_ef_sub
//   decode: count, k, add, payload, acc (f32 input), bad (i32 output), out (f32 output)
#include "harness.h"
#include "../sparse.cu"
#include "../topk.cu"
#include "../mstopk.cu"
#include "../randk.cu"

using namespace qccl_harness;

// Whole warps where the kernels shuffle or vote.
static const dim3 GRID(7), BLOCK(37), WARPS(64), ONE(1);
static const unsigned SCAN_BLOCK = 300;

typedef unsigned long long u64;

// Writes the payload of the selection in st (the shared compaction).
static void compact(const float* x, u64 n, u64* st, uint8_t* payload) {
    std::vector<u64> counts(2 * ((n + SPARSE_SEG - 1) / SPARSE_SEG));
    qccl_shim::launch_fibers(qccl_sparse_count, GRID, WARPS, x, (const u64*)st, counts.data(), n);
    // The scan takes any block; an odd one here, so its idle threads are exercised too.
    qccl_shim::launch_fibers(qccl_sparse_scan, dim3(2), dim3(SCAN_BLOCK), counts.data(), n);
    qccl_shim::launch_fibers(qccl_sparse_write, GRID, WARPS, x, (const u64*)st,
                             (const u64*)counts.data(), payload, n);
}

static void topk(const float* x, u64 n, u64 k, u64* st, unsigned* hist, uint8_t* p) {
    qccl_shim::launch(qccl_topk_init, ONE, ONE, st, hist, k);
    for (int pass = 0; pass < SP_RADIX_PASSES; pass++) {
        qccl_shim::launch_fibers(qccl_topk_hist, GRID, BLOCK, x, (const u64*)st, hist, n, pass);
        qccl_shim::launch(qccl_topk_digit, ONE, ONE, st, hist, pass);
    }
    compact(x, n, st, p);
}

static void mstopk(const float* x, u64 n, u64 k, u64 samplings, u64 key, u64* st,
                   unsigned* hist, uint8_t* p) {
    u64 lanes = 16 * ((n + 16383) / 16384);
    std::vector<float> psum(lanes), pmax(lanes);
    qccl_shim::launch(qccl_mstopk_partials, GRID, BLOCK, x, psum.data(), pmax.data(), n);
    qccl_shim::launch(qccl_mstopk_init, ONE, ONE, (const float*)psum.data(),
                      (const float*)pmax.data(), st, hist, n, k);
    for (u64 s = 0; s < samplings; s += MSTOPK_LEVELS) {
        unsigned levels = (unsigned)(samplings - s < MSTOPK_LEVELS ? samplings - s : MSTOPK_LEVELS);
        qccl_shim::launch_fibers(qccl_mstopk_count, GRID, WARPS, x, st, n);
        qccl_shim::launch(qccl_mstopk_step, ONE, ONE, st, levels);
    }
    for (int pass = 0; pass < SP_RADIX_PASSES; pass++) {
        qccl_shim::launch_fibers(qccl_mstopk_hist, GRID, BLOCK, x, (const u64*)st, hist, n, pass);
        qccl_shim::launch(qccl_mstopk_digit, ONE, ONE, st, hist, pass);
    }
    qccl_shim::launch(qccl_mstopk_finish, ONE, ONE, st, key);
    compact(x, n, st, p);
}

static void encode(const Args& a) {
    u64 n = a.u64("count"), k = a.u64("k"), key = a.u64("key");
    bool ef = a.u64("ef") != 0;
    auto x = a.load<float>("x");
    if (x.size() != n) die("x size differs from count");
    std::vector<float> res;
    if (ef) {
        res = a.load<float>("res");
        if (res.size() != n) die("res size differs from count");
    }
    if (ef && a.u64("codec") == 2) {
        // random-k: the pairs of w = x + res first, then the element pass (w kept in place, as
        // a host would) and the subtraction of what was sent.
        std::vector<uint8_t> p(8 * k, 0xa5);
        qccl_shim::launch(qccl_randk_encode_ef, GRID, BLOCK, (const float*)x.data(),
                          (const float*)res.data(), p.data(), n, k, key);
        qccl_shim::launch(qccl_sparse_compensate, GRID, BLOCK, (const float*)x.data(), res.data(),
                          x.data(), n);
        qccl_shim::launch(qccl_sparse_ef_sub, GRID, BLOCK, (const uint8_t*)p.data(), res.data(), k);
        a.save("payload", p);
        a.save("res_out", res);
        return;
    }
    if (ef) {
        // In place, as a host compensating its work buffer would.
        qccl_shim::launch(qccl_sparse_compensate, GRID, BLOCK, (const float*)x.data(), res.data(),
                          x.data(), n);
    }
    std::vector<uint8_t> p(8 * k, 0xa5);
    // Garbage in the scratch: the init kernels must set what they use.
    std::vector<u64> st(SPARSE_STATE, 0x5a5a5a5a5a5a5a5aull);
    std::vector<unsigned> hist(SP_RADIX_BINS, 12345);
    if (k > 0) {
        switch (a.u64("codec")) {
        case 0: topk(x.data(), n, k, st.data(), hist.data(), p.data()); break;
        case 1: mstopk(x.data(), n, k, a.u64("samplings"), key, st.data(), hist.data(), p.data()); break;
        case 2: qccl_shim::launch(qccl_randk_encode, GRID, BLOCK, (const float*)x.data(), p.data(), n, k, key); break;
        default: die("unknown codec");
        }
        if (ef)
            qccl_shim::launch(qccl_sparse_ef_sub, GRID, BLOCK, (const uint8_t*)p.data(), res.data(), k);
    }
    a.save("payload", p);
    if (ef) a.save("res_out", res);
}

static void decode(const Args& a) {
    u64 n = a.u64("count"), k = a.u64("k");
    auto p = a.load<uint8_t>("payload");
    if (p.size() != 8 * k) die("payload size is not 8 k");
    auto out = a.load<float>("acc");
    if (out.size() != n) die("acc size differs from count");
    std::vector<int> bad(1, 0);
    qccl_shim::launch(qccl_sparse_check, GRID, BLOCK, (const uint8_t*)p.data(), bad.data(), n, k);
    if (!bad[0]) {
        // decode stores into zeroed memory: the host clears it first.
        if (!a.u64("add")) std::fill(out.begin(), out.end(), 0.0f);
        qccl_shim::launch(a.u64("add") ? qccl_sparse_decode_add : qccl_sparse_decode, GRID, BLOCK,
                          (const uint8_t*)p.data(), out.data(), n, k);
    }
    a.save("bad", bad);
    a.save("out", out);
}

int main(int argc, char** argv) {
    return main_with(argc, argv, {{"encode", encode}, {"decode", decode}});
}
