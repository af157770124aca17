// Shim driver for kernels/floats.cu. Entries (argument keys):
//   qccl_<codec>_encode: count, x (f32 input), payload (output)
//   qccl_<codec>_encode_ef: count, x, res (f32 inputs), payload, res_out, w_out (outputs)
//   qccl_<codec>_decode, qccl_<codec>_decode_add: count, payload, acc (f32 input: the
//       accumulator decode_add adds to; decode ignores it), out (f32 output)
// Every entry also takes offset: buffers start that many elements into their allocation
// (1 takes the kernels off their 16-byte vector path).
#include "harness.h"
#include "../floats.cu"

using namespace qccl_harness;

// A buffer whose elements start `off` elements into its storage.
template <class T>
struct Buf {
    std::vector<T> store;
    size_t off;
    Buf(const std::vector<T>& v, size_t o) : store(o + v.size()), off(o) {
        std::copy(v.begin(), v.end(), store.begin() + o);
    }
    T* data() { return store.data() + off; }
    std::vector<T> get() const { return std::vector<T>(store.begin() + off, store.end()); }
};

template <class T>
static void encode(const Args& a, void (*k)(const float*, T*, uint64_t)) {
    uint64_t n = a.u64("count"), off = a.u64("offset");
    Buf<float> x(a.load<float>("x"), off);
    Buf<T> p(std::vector<T>(n), off);
    if (x.get().size() != n) die("x size differs from count");
    qccl_shim::launch(k, grid_for(n, 256), dim3(256), x.data(), p.data(), n);
    a.save("payload", p.get());
}

template <class T>
static void encode_ef(const Args& a, void (*k)(const float*, float*, float*, T*, uint64_t)) {
    uint64_t n = a.u64("count"), off = a.u64("offset");
    Buf<float> x(a.load<float>("x"), off), res(a.load<float>("res"), off), w(std::vector<float>(n), off);
    Buf<T> p(std::vector<T>(n), off);
    if (x.get().size() != n || res.get().size() != n) die("input sizes differ from count");
    qccl_shim::launch(k, grid_for(n, 256), dim3(256), x.data(), res.data(), w.data(), p.data(), n);
    a.save("payload", p.get());
    a.save("res_out", res.get());
    a.save("w_out", w.get());
}

template <class T>
static void decode(const Args& a, void (*k)(const T*, float*, uint64_t)) {
    uint64_t n = a.u64("count"), off = a.u64("offset");
    Buf<T> p(a.load<T>("payload"), off);
    Buf<float> out(a.load<float>("acc"), off);
    if (p.get().size() != n || out.get().size() != n) die("input sizes differ from count");
    qccl_shim::launch(k, grid_for(n, 256), dim3(256), p.data(), out.data(), n);
    a.save("out", out.get());
}

#define CODEC(c, T)                                                                            \
    {"qccl_" #c "_encode", [](const Args& a) { encode<T>(a, qccl_##c##_encode); }},             \
    {"qccl_" #c "_encode_ef", [](const Args& a) { encode_ef<T>(a, qccl_##c##_encode_ef); }},    \
    {"qccl_" #c "_decode", [](const Args& a) { decode<T>(a, qccl_##c##_decode); }},             \
    {"qccl_" #c "_decode_add", [](const Args& a) { decode<T>(a, qccl_##c##_decode_add); }},

int main(int argc, char** argv) {
    return main_with(argc, argv, {CODEC(none, float) CODEC(fp16, uint16_t) CODEC(bf16, uint16_t)});
}
