// Shim driver for kernels/reduce.cu. Entries (argument keys):
//   qccl_reduce_<op>_<dtype>: count, a, b (input files), out (output file), inplace (0/1:
//       out aliases a)
//   qccl_finish_avg_<dtype>: count, n, x (input file), out (output file)
#include "harness.h"
#include "../reduce.cu"

using namespace qccl_harness;

template <class T>
static void run_reduce(const Args& a, void (*k)(T*, const T*, const T*, uint64_t)) {
    uint64_t n = a.u64("count");
    auto x = a.load<T>("a");
    auto y = a.load<T>("b");
    if (x.size() != n || y.size() != n) die("input sizes differ from count");
    if (a.u64("inplace")) {
        qccl_shim::launch(k, grid_for(n, 256), dim3(256), x.data(), x.data(), y.data(), n);
        a.save("out", x);
    } else {
        std::vector<T> out(n);
        qccl_shim::launch(k, grid_for(n, 256), dim3(256), out.data(), x.data(), y.data(), n);
        a.save("out", out);
    }
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
