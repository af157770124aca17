// Shim driver for kernels/reduce.cu. Entries (argument keys):
//   qccl_reduce_<op>_<dtype>: count, a, b (input files), out (output file), inplace (0/1:
//       out aliases a), offset (elements of misalignment)
//   qccl_finish_avg_<dtype>: count, n, x (input file), out (output file)
#include "harness.h"
#include "../reduce.cu"

#include <algorithm>

using namespace qccl_harness;

// Buffers start `offset` elements into their allocation (offset 1 takes the kernels off their
// 16-byte vector path).
template <class T>
static void run_reduce(const Args& a, void (*k)(T*, const T*, const T*, uint64_t)) {
    uint64_t n = a.u64("count"), off = a.u64("offset");
    auto x = a.load<T>("a");
    auto y = a.load<T>("b");
    if (x.size() != n || y.size() != n) die("input sizes differ from count");
    std::vector<T> xs(off + n), ys(off + n), out(off + n);
    std::copy(x.begin(), x.end(), xs.begin() + off);
    std::copy(y.begin(), y.end(), ys.begin() + off);
    T* dst = a.u64("inplace") ? xs.data() + off : out.data() + off;
    qccl_shim::launch(k, grid_for(n, 256), dim3(256), dst, xs.data() + off, ys.data() + off, n);
    a.save("out", std::vector<T>(dst, dst + n));
}

template <class T>
static void run_finish(const Args& a, void (*k)(T*, uint64_t, uint64_t)) {
    uint64_t n = a.u64("count");
    auto x = a.load<T>("x");
    if (x.size() != n) die("input size differs from count");
    qccl_shim::launch(k, grid_for(n, 256), dim3(256), x.data(), n, a.u64("n"));
    a.save("out", x);
}

#define R(op, T, s) {"qccl_reduce_" #op "_" #s, [](const Args& a) { run_reduce<T>(a, qccl_reduce_##op##_##s); }},
#define INT(T, s) R(sum, T, s) R(prod, T, s) R(max, T, s) R(min, T, s)
#define FLOAT(T, s) INT(T, s) R(avg, T, s) \
    {"qccl_finish_avg_" #s, [](const Args& a) { run_finish<T>(a, qccl_finish_avg_##s); }},

int main(int argc, char** argv) {
    return main_with(argc, argv, {
        INT(int8_t, i8) INT(uint8_t, u8) INT(int32_t, i32) INT(uint32_t, u32)
        INT(int64_t, i64) INT(uint64_t, u64) FLOAT(float, f32) FLOAT(double, f64)
        FLOAT(uint16_t, f16) FLOAT(uint16_t, bf16)
    });
}
