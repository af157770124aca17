// Shim driver for kernels/floats.cu. Entries (argument keys):
//   qccl_<codec>_encode: count, x (f32 input), payload (output)
//   qccl_<codec>_decode, qccl_<codec>_decode_add: count, payload, acc (f32 input: the
//       accumulator decode_add adds to; decode ignores it), out (f32 output)
#include "harness.h"
#include "../floats.cu"

using namespace qccl_harness;

template <class T>
static void encode(const Args& a, void (*k)(const float*, T*, uint64_t)) {
    uint64_t n = a.u64("count");
    auto x = a.load<float>("x");
    if (x.size() != n) die("x size differs from count");
    std::vector<T> p(n);
    qccl_shim::launch(k, grid_for(n, 256), dim3(256), x.data(), p.data(), n);
    a.save("payload", p);
}

template <class T>
static void decode(const Args& a, void (*k)(const T*, float*, uint64_t)) {
    uint64_t n = a.u64("count");
    auto p = a.load<T>("payload");
    auto out = a.load<float>("acc");
    if (p.size() != n || out.size() != n) die("input sizes differ from count");
    qccl_shim::launch(k, grid_for(n, 256), dim3(256), p.data(), out.data(), n);
    a.save("out", out);
}

#define CODEC(c, T)                                                                            \
    {"qccl_" #c "_encode", [](const Args& a) { encode<T>(a, qccl_##c##_encode); }},             \
    {"qccl_" #c "_decode", [](const Args& a) { decode<T>(a, qccl_##c##_decode); }},             \
    {"qccl_" #c "_decode_add", [](const Args& a) { decode<T>(a, qccl_##c##_decode_add); }},

int main(int argc, char** argv) {
    return main_with(argc, argv, {CODEC(none, float) CODEC(fp16, uint16_t) CODEC(bf16, uint16_t)});
}
