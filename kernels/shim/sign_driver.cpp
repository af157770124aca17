// Shim driver for kernels/sign.cu. Entries (argument keys):
//   qccl_efsign_encode, qccl_onebit_encode: the codec's launch sequence (see sign.cu);
//       count, x (f32 input), payload (output), bucket (onebit), grid (blocks of the
//       fiber-mode kernel: 0 for one per 32 tiles, else a cap, so the grid-stride loop runs),
//       ef (1: the _ef sequence, with res an f32 input and res_out, w_out outputs)
//   qccl_<codec>_decode[_add]: count, payload, acc (f32 input), out (f32 output), bucket
#include "harness.h"
// Windows of 16 tile sums: the efsign scale's loop over windows runs from 32769 elements.
#define QCCL_SIGN_WINDOW 16u
#include "../sign.cu"

using namespace qccl_harness;

static dim3 tiles_grid(const Args& a, uint64_t n) {
    uint64_t tiles = (n + QCCL_SIGN_TILE - 1) / QCCL_SIGN_TILE;
    return grid_for(tiles * 8, 256, a.u64("grid") ? (unsigned)a.u64("grid") : 1u << 30);
}

static void efsign_encode(const Args& a) {
    uint64_t n = a.u64("count");
    auto x = a.load<float>("x");
    if (x.size() != n) die("x size differs from count");
    std::vector<float> tiles((n + QCCL_SIGN_TILE - 1) / QCCL_SIGN_TILE);
    std::vector<uint8_t> p(4 + (n + 7) / 8);
    dim3 g = tiles_grid(a, n), gb = grid_for(p.size() - 4, 256);
    if (a.u64("ef")) {
        auto res = a.load<float>("res");
        std::vector<float> w(n);
        qccl_shim::launch_fibers(qccl_efsign_tile_sums_ef, g, dim3(256), x.data(), res.data(), tiles.data(), n);
        qccl_shim::launch_fibers(qccl_efsign_scale, dim3(2), dim3(96), tiles.data(), p.data(), n);
        qccl_shim::launch(qccl_efsign_pack_ef, gb, dim3(256), x.data(), res.data(), w.data(), p.data(), n);
        a.save("res_out", res);
        a.save("w_out", w);
    } else {
        qccl_shim::launch_fibers(qccl_efsign_tile_sums, g, dim3(256), x.data(), tiles.data(), n);
        qccl_shim::launch_fibers(qccl_efsign_scale, dim3(2), dim3(96), tiles.data(), p.data(), n);
        qccl_shim::launch(qccl_signs_pack, gb, dim3(256), x.data(), p.data() + 4, n);
    }
    a.save("payload", p);
}

static void onebit_encode(const Args& a) {
    uint64_t n = a.u64("count");
    uint32_t b = (uint32_t)a.u64("bucket");
    auto x = a.load<float>("x");
    if (x.size() != n) die("x size differs from count");
    std::vector<float> seg(3 * qccl_onebit_segments(n, b));
    uint64_t meta = 8 * ((n + b - 1) / b);
    std::vector<uint8_t> p(meta + (n + 7) / 8);
    dim3 g = tiles_grid(a, n), gm = grid_for(meta / 8, 256), gb = grid_for(p.size() - meta, 256);
    if (a.u64("ef")) {
        auto res = a.load<float>("res");
        std::vector<float> w(n);
        qccl_shim::launch_fibers(qccl_onebit_segment_sums_ef, g, dim3(256), x.data(), res.data(), seg.data(), n, b);
        qccl_shim::launch(qccl_onebit_means, gm, dim3(256), seg.data(), p.data(), n, b);
        qccl_shim::launch(qccl_onebit_pack_ef, gb, dim3(256), x.data(), res.data(), w.data(), p.data(), n, b);
        a.save("res_out", res);
        a.save("w_out", w);
    } else {
        qccl_shim::launch_fibers(qccl_onebit_segment_sums, g, dim3(256), x.data(), seg.data(), n, b);
        qccl_shim::launch(qccl_onebit_means, gm, dim3(256), seg.data(), p.data(), n, b);
        qccl_shim::launch(qccl_signs_pack, gb, dim3(256), x.data(), p.data() + meta, n);
    }
    a.save("payload", p);
}

template <class... B>
static void decode(const Args& a, void (*k)(const uint8_t*, float*, uint64_t, B...)) {
    uint64_t n = a.u64("count");
    auto p = a.load<uint8_t>("payload");
    auto out = a.load<float>("acc");
    if (out.size() != n) die("acc size differs from count");
    if constexpr (sizeof...(B) == 0)
        qccl_shim::launch(k, grid_for(n, 256), dim3(256), p.data(), out.data(), n);
    else
        qccl_shim::launch(k, grid_for(n, 256), dim3(256), p.data(), out.data(), n, (uint32_t)a.u64("bucket"));
    a.save("out", out);
}

int main(int argc, char** argv) {
    return main_with(argc, argv,
                     {{"qccl_efsign_encode", efsign_encode},
                      {"qccl_efsign_decode", [](const Args& a) { decode(a, qccl_efsign_decode); }},
                      {"qccl_efsign_decode_add", [](const Args& a) { decode(a, qccl_efsign_decode_add); }},
                      {"qccl_onebit_encode", onebit_encode},
                      {"qccl_onebit_decode", [](const Args& a) { decode(a, qccl_onebit_decode); }},
                      {"qccl_onebit_decode_add", [](const Args& a) { decode(a, qccl_onebit_decode_add); }}});
}
