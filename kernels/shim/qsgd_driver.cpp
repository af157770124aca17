// Shim driver for kernels/qsgd.cu: the launch sequences a GPU host runs (see qsgd.cu), on odd
// grid shapes so every grid-stride loop wraps; scales by runs for buckets over QSGD_RUN.
// The scale kernels run in fiber mode on whole warps.
// Entries (argument keys):
//   encode: count, bits, bucket, maxabs, nearest, key, x (f32 input), payload (output)
//   encode_ef: the same plus res (f32 input), res_out and w (f32 outputs)
//   decode: count, bits, bucket, maxabs, add, payload, acc (f32 input), bad (i32 output: the
//       check kernel's flag), out (f32 output: acc untouched when bad)
#include "harness.h"
#include "../qsgd.cu"

using namespace qccl_harness;

static const dim3 GRID(7), BLOCK(37);
// The scale scans work a warp at a time: whole warps, in fiber mode.
static const dim3 WARPS(64);

static uint64_t payload_len(const Args& a) {
    uint64_t n = a.u64("count"), bucket = a.u64("bucket");
    return (n + bucket - 1) / bucket * (a.u64("maxabs") ? 4 : 8) + (n * a.u64("bits") + 7) / 8;
}

// Scratch runs of the large-bucket scale path.
static uint64_t nruns(uint64_t n, unsigned bucket) {
    return (n + bucket - 1) / bucket * ((bucket + QSGD_RUN - 1) / QSGD_RUN);
}

static std::vector<float> input(const Args& a, const char* key) {
    auto v = a.load<float>(key);
    if (v.size() != a.u64("count")) die(std::string(key) + " size differs from count");
    return v;
}

static void encode(const Args& a, bool ef) {
    uint64_t n = a.u64("count");
    unsigned bits = (unsigned)a.u64("bits"), bucket = (unsigned)a.u64("bucket");
    int maxabs = (int)a.u64("maxabs"), nearest = (int)a.u64("nearest");
    unsigned long long key = a.u64("key");
    auto x = input(a, "x");
    std::vector<uint8_t> p(payload_len(a), 0xa5);
    if (!ef) {
        if (bucket > QSGD_RUN) {
            std::vector<QsgdLanes> runs(nruns(n, bucket));
            qccl_shim::launch_fibers(qccl_qsgd_runs, GRID, WARPS, x.data(), runs.data(), n, bucket, maxabs);
            qccl_shim::launch(qccl_qsgd_merge, GRID, BLOCK, (const QsgdLanes*)runs.data(), p.data(),
                              n, bucket, maxabs);
        } else {
            qccl_shim::launch_fibers(qccl_qsgd_bounds, GRID, WARPS, x.data(), p.data(), n, bucket, maxabs);
        }
        qccl_shim::launch(qccl_qsgd_levels, GRID, BLOCK, x.data(), p.data(), n, bits, bucket,
                          maxabs, nearest, key);
        a.save("payload", p);
        return;
    }
    auto res = input(a, "res");
    std::vector<float> w(n);
    if (bucket > QSGD_RUN) {
        std::vector<QsgdLanes> runs(nruns(n, bucket));
        qccl_shim::launch_fibers(qccl_qsgd_runs_ef, GRID, WARPS, x.data(), (const float*)res.data(),
                          runs.data(), n, bucket, maxabs);
        qccl_shim::launch(qccl_qsgd_merge, GRID, BLOCK, (const QsgdLanes*)runs.data(), p.data(), n,
                          bucket, maxabs);
    } else {
        qccl_shim::launch_fibers(qccl_qsgd_bounds_ef, GRID, WARPS, x.data(), res.data(), p.data(), n,
                          bucket, maxabs);
    }
    qccl_shim::launch(qccl_qsgd_levels_ef, GRID, BLOCK, x.data(), res.data(), w.data(), p.data(),
                      n, bits, bucket, maxabs, nearest, key);
    a.save("payload", p);
    a.save("res_out", res);
    a.save("w", w);
}

static void decode(const Args& a) {
    uint64_t n = a.u64("count");
    auto p = a.load<uint8_t>("payload");
    if (p.size() != payload_len(a)) die("payload size differs from the codec's");
    auto out = input(a, "acc");
    std::vector<int> bad(1, 0);
    unsigned bits = (unsigned)a.u64("bits"), bucket = (unsigned)a.u64("bucket");
    int maxabs = (int)a.u64("maxabs");
    qccl_shim::launch(qccl_qsgd_check, GRID, BLOCK, p.data(), bad.data(), n, bucket, maxabs);
    if (!bad[0])
        qccl_shim::launch(a.u64("add") ? qccl_qsgd_decode_add : qccl_qsgd_decode, GRID, BLOCK,
                          p.data(), out.data(), n, bits, bucket, maxabs);
    a.save("bad", bad);
    a.save("out", out);
}

int main(int argc, char** argv) {
    return main_with(argc, argv,
                     {{"encode", [](const Args& a) { encode(a, false); }},
                      {"encode_ef", [](const Args& a) { encode(a, true); }},
                      {"decode", decode}});
}
