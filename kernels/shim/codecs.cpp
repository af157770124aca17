// The codec kernels' host side under the shim: reads one request on stdin, runs the kernels of
// qsgd.cu, topk.cu, mstopk.cu, randk.cu and sparse.cu in the launch sequences their headers
// document (what a GPU host runs on a stream), writes the results on stdout. Driven by
// tests/kernels_codecs.rs, which compares them bit for bit with the Rust codecs.
//
//   g++ -O2 -std=c++17 -I kernels kernels/shim/codecs.cpp -o codecs
//   codecs qsgd_encode | qsgd_decode | sparse_encode | sparse_decode  < request > reply
//
// Requests and replies are little-endian binary, fields in the order read below.
#include "qccl_shim.h"

#include "../qsgd.cu"
#include "../sparse.cu"
#include "../topk.cu"
#include "../mstopk.cu"
#include "../randk.cu"

#include <string>

namespace {

template <class T>
T get() {
    T v;
    if (std::fread(&v, sizeof v, 1, stdin) != 1) qccl_shim::fail("short request");
    return v;
}

template <class T>
std::vector<T> get_vec(uint64_t n) {
    std::vector<T> v(n);
    if (n && std::fread(v.data(), sizeof(T), n, stdin) != n) qccl_shim::fail("short request");
    return v;
}

template <class T>
void put_vec(const std::vector<T>& v) {
    if (!v.empty()) std::fwrite(v.data(), sizeof(T), v.size(), stdout);
}

// Odd grid shapes, so every grid-stride loop wraps and no kernel relies on a shape.
const dim3 GRID(7), BLOCK(37), ONE(1);
// Whole warps, for the kernels that shuffle.
const dim3 WARPS(64);

uint64_t qsgd_payload_len(uint64_t n, unsigned bits, unsigned bucket, unsigned maxabs) {
    return (n + bucket - 1) / bucket * (maxabs ? 4 : 8) + (n * bits + 7) / 8;
}

void qsgd_encode() {
    auto n = get<uint64_t>();
    auto bits = get<uint32_t>(), bucket = get<uint32_t>(), maxabs = get<uint32_t>(),
         nearest = get<uint32_t>();
    auto key = get<uint64_t>();
    auto ef = get<uint32_t>();
    auto x = get_vec<float>(n);
    std::vector<unsigned char> payload(qsgd_payload_len(n, bits, bucket, maxabs), 0xa5);
    if (!ef) {
        qccl_shim::launch(qccl_qsgd_bounds, GRID, BLOCK, x.data(), n, bucket, (int)maxabs,
                          payload.data());
        qccl_shim::launch(qccl_qsgd_levels, GRID, BLOCK, x.data(), n, bits, bucket, (int)maxabs,
                          (int)nearest, (unsigned long long)key, payload.data());
        put_vec(payload);
        return;
    }
    auto res = get_vec<float>(n);
    std::vector<float> w(n);
    qccl_shim::launch(qccl_qsgd_bounds_ef, GRID, BLOCK, x.data(), res.data(), n, bucket,
                      (int)maxabs, payload.data());
    qccl_shim::launch(qccl_qsgd_levels_ef, GRID, BLOCK, x.data(), res.data(), w.data(), n, bits,
                      bucket, (int)maxabs, (int)nearest, (unsigned long long)key,
                      payload.data());
    put_vec(payload);
    put_vec(res);
    put_vec(w);
}

void qsgd_decode() {
    auto n = get<uint64_t>();
    auto bits = get<uint32_t>(), bucket = get<uint32_t>(), maxabs = get<uint32_t>(),
         add = get<uint32_t>();
    auto payload = get_vec<unsigned char>(qsgd_payload_len(n, bits, bucket, maxabs));
    auto out = get_vec<float>(n);
    int bad = 0;
    qccl_shim::launch(qccl_qsgd_check, GRID, BLOCK, payload.data(), n, bucket, (int)maxabs, &bad);
    if (!bad)
        qccl_shim::launch(qccl_qsgd_decode, GRID, BLOCK, payload.data(), n, bits, bucket,
                          (int)maxabs, out.data(), (int)add);
    std::fwrite(&bad, 4, 1, stdout);
    put_vec(out);
}

// Writes the payload of the selection in st over x (the shared compaction).
void compact(const float* x, uint64_t n, unsigned long long* st, unsigned char* payload) {
    std::vector<unsigned long long> counts(2 * ((n + SPARSE_SEG - 1) / SPARSE_SEG));
    qccl_shim::launch_fibers(qccl_sparse_count, GRID, WARPS, x, n, (const unsigned long long*)st,
                             counts.data());
    qccl_shim::launch_fibers(qccl_sparse_scan, ONE, dim3(SPARSE_SCAN), n, counts.data());
    qccl_shim::launch_fibers(qccl_sparse_write, GRID, WARPS, x, n, (const unsigned long long*)st,
                             (const unsigned long long*)counts.data(), payload);
}

void sparse_encode() {
    auto codec = get<uint32_t>();  // 0 topk, 1 mstopk, 2 randk
    auto n = get<uint64_t>(), k = get<uint64_t>();
    auto samplings = get<uint32_t>();
    auto key = get<uint64_t>();
    auto ef = get<uint32_t>();
    auto x = get_vec<float>(n);
    std::vector<float> res;
    if (ef) {
        res = get_vec<float>(n);
        // In place, as a host compensating its work buffer would.
        qccl_shim::launch(qccl_sparse_compensate, GRID, BLOCK, (const float*)x.data(),
                          res.data(), x.data(), n);
    }
    std::vector<unsigned char> payload(8 * k, 0xa5);
    std::vector<unsigned long long> st(SPARSE_STATE, 0x5a5a5a5a5a5a5a5aull);
    std::vector<unsigned> hist(256, 12345);  // garbage: the init kernels clear it
    const float* xs = x.data();
    if (k > 0 && codec == 0) {
        qccl_shim::launch(qccl_topk_init, ONE, ONE, (unsigned long long)k, st.data(),
                          hist.data());
        for (int pass = 0; pass < 4; pass++) {
            qccl_shim::launch_fibers(qccl_topk_hist, GRID, BLOCK, xs, n, pass,
                              (const unsigned long long*)st.data(), hist.data());
            qccl_shim::launch(qccl_topk_digit, ONE, ONE, pass, st.data(), hist.data());
        }
        compact(xs, n, st.data(), payload.data());
    } else if (k > 0 && codec == 1) {
        uint64_t lanes = 16 * ((n + 16383) / 16384);
        std::vector<float> psum(lanes), pmax(lanes);
        qccl_shim::launch(qccl_mstopk_partials, GRID, BLOCK, xs, n, psum.data(), pmax.data());
        qccl_shim::launch(qccl_mstopk_init, ONE, ONE, n, (unsigned long long)k,
                          (const float*)psum.data(), (const float*)pmax.data(), st.data(),
                          hist.data());
        for (uint32_t s = 0; s < samplings; s++) {
            qccl_shim::launch_fibers(qccl_mstopk_count, GRID, WARPS, xs, n, st.data());
            qccl_shim::launch(qccl_mstopk_step, ONE, ONE, st.data());
        }
        for (int pass = 0; pass < 4; pass++) {
            qccl_shim::launch_fibers(qccl_mstopk_hist, GRID, BLOCK, xs, n, pass,
                              (const unsigned long long*)st.data(), hist.data());
            qccl_shim::launch(qccl_mstopk_digit, ONE, ONE, pass, st.data(), hist.data());
        }
        qccl_shim::launch(qccl_mstopk_finish, ONE, ONE, (unsigned long long)key, st.data());
        compact(xs, n, st.data(), payload.data());
    } else if (k > 0 && codec == 2) {
        qccl_shim::launch(qccl_randk_encode, GRID, BLOCK, xs, n, (unsigned long long)k,
                          (unsigned long long)key, payload.data());
    } else if (k > 0) {
        qccl_shim::fail("unknown sparse codec %u", codec);
    }
    if (ef && k > 0)
        qccl_shim::launch(qccl_sparse_ef_sub, GRID, BLOCK, (const unsigned char*)payload.data(),
                          (unsigned long long)k, res.data());
    put_vec(payload);
    if (ef) put_vec(res);
}

void sparse_decode() {
    auto n = get<uint64_t>(), k = get<uint64_t>();
    auto add = get<uint32_t>();
    auto payload = get_vec<unsigned char>(8 * k);
    auto out = get_vec<float>(n);
    int bad = 0;
    qccl_shim::launch(qccl_sparse_check, GRID, BLOCK, (const unsigned char*)payload.data(),
                      (unsigned long long)k, n, &bad);
    if (!bad) {
        if (!add) std::fill(out.begin(), out.end(), 0.0f);
        qccl_shim::launch(qccl_sparse_decode, GRID, BLOCK, (const unsigned char*)payload.data(),
                          (unsigned long long)k, out.data(), (int)add);
    }
    std::fwrite(&bad, 4, 1, stdout);
    put_vec(out);
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) qccl_shim::fail("usage: codecs OP < request > reply");
    std::string op = argv[1];
    if (op == "qsgd_encode") qsgd_encode();
    else if (op == "qsgd_decode") qsgd_decode();
    else if (op == "sparse_encode") sparse_encode();
    else if (op == "sparse_decode") sparse_decode();
    else qccl_shim::fail("unknown op %s", op.c_str());
    return std::fflush(stdout) == 0 ? 0 : 1;
}
