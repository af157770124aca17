// Shim driver for kernels/shim/selftest.cu (fiber mode). Entries take count, x (u32 input)
// and block where noted; see the kernels for the outputs.
#include "harness.h"
#include "selftest.cu"

using namespace qccl_harness;

static void block_sum(const Args& a) {
    auto x = a.load<uint32_t>("x");
    unsigned block = (unsigned)a.u64("block");
    dim3 grid = grid_for(x.size(), block, 16);
    std::vector<uint32_t> out(grid.x);
    qccl_shim::launch_fibers(qccl_selftest_block_sum, grid, dim3(block), x.data(), x.size(), out.data());
    a.save("out", out);
}

static void votes(const Args& a) {
    auto x = a.load<uint32_t>("x");
    unsigned block = (unsigned)a.u64("block");
    unsigned blocks = (unsigned)((x.size() + block - 1) / block);
    if (!blocks) blocks = 1;
    size_t warps = (size_t)blocks * ((block + 31) / 32);
    std::vector<uint32_t> ballot(warps), all(warps), any(warps);
    qccl_shim::launch_fibers(qccl_selftest_votes, dim3(blocks), dim3(block), x.data(), x.size(),
                             ballot.data(), all.data(), any.data());
    a.save("ballot", ballot);
    a.save("all", all);
    a.save("any", any);
}

static void scan(const Args& a) {
    auto x = a.load<uint32_t>("x");
    unsigned blocks = (unsigned)((x.size() + 127) / 128);
    std::vector<uint32_t> out(x.size());
    qccl_shim::launch_fibers(qccl_selftest_scan, dim3(blocks ? blocks : 1), dim3(128), x.data(),
                             x.size(), out.data(), (int)a.u64("width"));
    a.save("out", out);
}

static void atomics(const Args& a) {
    auto x = a.load<uint32_t>("x");
    std::vector<uint32_t> acc = {0, 0, 0xffffffffu, 0};
    std::vector<float> facc = {0};
    if (a.u64("fibers"))
        qccl_shim::launch_fibers(qccl_selftest_atomics, grid_for(x.size(), 64, 8), dim3(64), x.data(),
                                 x.size(), acc.data(), facc.data());
    else
        qccl_shim::launch(qccl_selftest_atomics, grid_for(x.size(), 64, 8), dim3(64), x.data(),
                          x.size(), acc.data(), facc.data());
    a.save("acc", acc);
    a.save("facc", facc);
}

static void shared(const Args& a) {
    unsigned blocks = (unsigned)a.u64("blocks"), block = (unsigned)a.u64("block");
    std::vector<uint32_t> out((size_t)blocks * block);
    qccl_shim::launch_fibers(qccl_selftest_shared, dim3(blocks), dim3(block), out.data());
    a.save("out", out);
}

// Misuse: must abort with a message.
static void bad_barrier(const Args&) {
    std::vector<uint32_t> out(64);
    qccl_shim::launch_fibers(qccl_selftest_bad_barrier, dim3(1), dim3(64), out.data());
}

static void bad_mask(const Args&) {
    std::vector<uint32_t> out(32);
    qccl_shim::launch_fibers(qccl_selftest_bad_mask, dim3(1), dim3(32), out.data());
}

static void sync_in_sequential(const Args&) {
    std::vector<uint32_t> out(64);
    qccl_shim::launch(qccl_selftest_shared, dim3(1), dim3(64), out.data());
}

int main(int argc, char** argv) {
    return main_with(argc, argv,
                     {{"block_sum", block_sum},
                      {"votes", votes},
                      {"scan", scan},
                      {"atomics", atomics},
                      {"shared", shared},
                      {"bad_barrier", bad_barrier},
                      {"bad_mask", bad_mask},
                      {"sync_in_sequential", sync_in_sequential}});
}
