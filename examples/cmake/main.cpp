// Built by examples/cmake/CMakeLists.txt (find_package(qccl), qccl::qccl). Makes 4 ranks in
// this process with qcclCommInitAll, all-reduces a vector on them in one group, checks every
// rank's sum, and checks that the header and the library it loaded are the same version.
#include <qccl.h>

#include <cstdio>
#include <vector>

#define CHECK(call)                                                                  \
  do {                                                                               \
    qcclResult_t r_ = (call);                                                        \
    if (r_ != qcclSuccess) {                                                         \
      std::fprintf(stderr, "%s: %s: %s\n", #call, qcclGetErrorString(r_),            \
                   qcclGetLastError(nullptr));                                       \
      return 1;                                                                      \
    }                                                                                \
  } while (0)

int main() {
  int version = 0;
  CHECK(qcclGetVersion(&version));
  if (version != QCCL_VERSION_CODE) {
    std::fprintf(stderr, "library version %d, header %d\n", version, QCCL_VERSION_CODE);
    return 1;
  }

  const int nranks = 4;
  const size_t count = 1 << 16;
  std::vector<qcclComm_t> comms(nranks);
  CHECK(qcclCommInitAll(comms.data(), nranks, nullptr));

  // Rank r contributes r + 1 + (i % 7) at element i.
  std::vector<std::vector<float>> buf(nranks, std::vector<float>(count));
  for (int r = 0; r < nranks; r++)
    for (size_t i = 0; i < count; i++) buf[r][i] = static_cast<float>(r + 1 + i % 7);

  // One thread drives all the comms: a group, as with NCCL.
  CHECK(qcclGroupStart());
  for (int r = 0; r < nranks; r++)
    CHECK(qcclAllReduce(buf[r].data(), buf[r].data(), count, qcclFloat32, qcclSum, comms[r],
                        nullptr));
  CHECK(qcclGroupEnd());

  for (int r = 0; r < nranks; r++) {
    for (size_t i = 0; i < count; i++) {
      float want = static_cast<float>(nranks * (nranks + 1) / 2 + nranks * (i % 7));
      if (buf[r][i] != want) {
        std::fprintf(stderr, "rank %d element %zu: %g, expected %g\n", r, i, buf[r][i], want);
        return 1;
      }
    }
  }
  for (qcclComm_t c : comms) CHECK(qcclCommDestroy(c));
  std::printf("qccl %d.%d.%d: all-reduce of %zu floats on %d ranks (one process): ok\n",
              QCCL_MAJOR, QCCL_MINOR, QCCL_PATCH, count, nranks);
  return 0;
}
