// A Horovod-style allreduce on qccl: the shape of Horovod's `NCCLAllreduce::Execute`
// (horovod/common/ops/nccl_operations.cc) with ncclAllReduce renamed to qcclAllReduce and
// host tensors instead of GPU ones: copy the ready tensors into the fusion buffer, scale,
// all-reduce the fusion buffer in place, scale, copy the results out.
//
// Build:  c++ -std=c++14 examples/horovod_allreduce.cc $(pkg-config --cflags --libs qccl)
//         or with CMake: examples/cmake/CMakeLists.txt (find_package(qccl), qccl::qccl)
// Run:    ./a.out [NRANKS]           forks NRANKS local ranks (default 3) sharing a unique id
//         torchrun/mpirun ... ./a.out  one rank per process, from the launcher's variables
#include <qccl.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace hvd {

// ---- the few Horovod types Execute touches ---------------------------------------------

enum class DataType { HOROVOD_FLOAT32, HOROVOD_FLOAT64, HOROVOD_INT32, HOROVOD_FLOAT16 };

size_t DataType_Size(DataType t) {
  switch (t) {
    case DataType::HOROVOD_FLOAT64: return 8;
    case DataType::HOROVOD_FLOAT16: return 2;
    default: return 4;
  }
}

struct Status {
  bool ok_;
  std::string reason_;
  static Status OK() { return {true, ""}; }
  static Status UnknownError(const std::string& r) { return {false, r}; }
  bool ok() const { return ok_; }
  const std::string& reason() const { return reason_; }
};

// A host tensor: bytes and a dtype.
struct Tensor {
  DataType dtype_;
  std::vector<unsigned char> bytes_;
  Tensor(DataType t, size_t n) : dtype_(t), bytes_(n * DataType_Size(t)) {}
  DataType dtype() const { return dtype_; }
  const void* data() const { return bytes_.data(); }
  void* mutable_data() { return bytes_.data(); }
  size_t size() const { return bytes_.size(); }
};

struct TensorTableEntry {
  std::string tensor_name;
  std::shared_ptr<Tensor> tensor;  // input
  std::shared_ptr<Tensor> output;  // result
};

// What the coordinator decided for this batch of tensors.
struct Response {
  double prescale_factor_ = 1.0;
  double postscale_factor_ = 1.0;
  double prescale_factor() const { return prescale_factor_; }
  double postscale_factor() const { return postscale_factor_; }
};

qcclDataType_t GetQcclDataType(const std::shared_ptr<Tensor>& t) {
  switch (t->dtype()) {
    case DataType::HOROVOD_FLOAT32: return qcclFloat32;
    case DataType::HOROVOD_FLOAT64: return qcclFloat64;
    case DataType::HOROVOD_INT32: return qcclInt32;
    case DataType::HOROVOD_FLOAT16: return qcclFloat16;
  }
  return qcclFloat32;
}

// ---- the op ----------------------------------------------------------------------------

class AllreduceOp {
 public:
  virtual ~AllreduceOp() = default;
  virtual Status Execute(std::vector<TensorTableEntry>& entries, const Response& response) = 0;

 protected:
  // Horovod keeps one persistent fusion buffer per device and framework.
  std::vector<unsigned char> fusion_buffer_;

  void MemcpyInFusionBuffer(const std::vector<TensorTableEntry>& entries,
                            const void*& fused_input_data, void*& buffer_data,
                            size_t& buffer_len) {
    size_t total = 0;
    for (auto& e : entries) total += e.tensor->size();
    if (fusion_buffer_.size() < total) fusion_buffer_.resize(total);
    size_t offset = 0;
    for (auto& e : entries) {
      std::memcpy(fusion_buffer_.data() + offset, e.tensor->data(), e.tensor->size());
      offset += e.tensor->size();
    }
    buffer_data = fusion_buffer_.data();
    buffer_len = total;
    fused_input_data = buffer_data;  // the all-reduce then runs in place
  }

  void MemcpyOutFusionBuffer(const void* buffer_data, std::vector<TensorTableEntry>& entries) {
    size_t offset = 0;
    for (auto& e : entries) {
      std::memcpy(e.output->mutable_data(), static_cast<const unsigned char*>(buffer_data) + offset,
                  e.output->size());
      offset += e.output->size();
    }
  }

  static void ScaleBuffer(double factor, const std::vector<TensorTableEntry>& entries,
                          const void* in, void* out, int64_t n) {
    // The CPU path of Horovod's ScaleBuffer, for the float dtypes of this example.
    if (entries[0].tensor->dtype() == DataType::HOROVOD_FLOAT64) {
      auto* o = static_cast<double*>(out);
      auto* i = static_cast<const double*>(in);
      for (int64_t k = 0; k < n; k++) o[k] = i[k] * factor;
    } else {
      auto* o = static_cast<float*>(out);
      auto* i = static_cast<const float*>(in);
      for (int64_t k = 0; k < n; k++) o[k] = static_cast<float>(i[k] * factor);
    }
  }
};

class QcclAllreduce : public AllreduceOp {
 public:
  explicit QcclAllreduce(qcclComm_t comm) : comm_(comm) {}

  Status Execute(std::vector<TensorTableEntry>& entries, const Response& response) override {
    auto& first_entry = entries[0];

    const void* fused_input_data;
    void* buffer_data;
    size_t buffer_len;

    // Copy memory into the fusion buffer.
    if (entries.size() > 1) {
      MemcpyInFusionBuffer(entries, fused_input_data, buffer_data, buffer_len);
    } else {
      fused_input_data = first_entry.tensor->data();
      buffer_data = first_entry.output->mutable_data();
      buffer_len = first_entry.output->size();
    }

    int64_t num_elements = buffer_len / DataType_Size(first_entry.tensor->dtype());

    if (response.prescale_factor() != 1.0) {
      // Execute prescaling op
      ScaleBuffer(response.prescale_factor(), entries, fused_input_data, buffer_data, num_elements);
      fused_input_data = buffer_data;  // for unfused, scale is done out of place
    }

    // Do allreduce.
    auto qccl_result = qcclAllReduce(fused_input_data, buffer_data, (size_t)num_elements,
                                     GetQcclDataType(first_entry.tensor), qcclSum, comm_,
                                     /*stream=*/nullptr);
    if (qccl_result != qcclSuccess) {
      return Status::UnknownError(std::string("qcclAllReduce failed: ") +
                                  qcclGetErrorString(qccl_result) + ": " +
                                  qcclGetLastError(comm_));
    }

    if (response.postscale_factor() != 1.0) {
      // Execute postscaling op
      ScaleBuffer(response.postscale_factor(), entries, buffer_data, buffer_data, num_elements);
    }

    // Copy memory out of the fusion buffer.
    if (entries.size() > 1) {
      MemcpyOutFusionBuffer(buffer_data, entries);
    }
    return Status::OK();
  }

 private:
  qcclComm_t comm_;
};

}  // namespace hvd

// ---- a training step's worth of gradients ------------------------------------------------

static float grad_value(int rank, size_t tensor, size_t i) {
  return static_cast<float>(rank + 1) * 0.25f + static_cast<float>((tensor * 31 + i) % 17);
}

static int run_rank(qcclComm_t comm) {
  int rank = 0, size = 0;
  if (qcclCommUserRank(comm, &rank) != qcclSuccess || qcclCommCount(comm, &size) != qcclSuccess)
    return 1;
  const size_t sizes[] = {1000, 17, 4096, 1};
  std::vector<hvd::TensorTableEntry> entries;
  for (size_t t = 0; t < 4; t++) {
    hvd::TensorTableEntry e;
    e.tensor_name = "layer" + std::to_string(t) + ".grad";
    e.tensor = std::make_shared<hvd::Tensor>(hvd::DataType::HOROVOD_FLOAT32, sizes[t]);
    e.output = std::make_shared<hvd::Tensor>(hvd::DataType::HOROVOD_FLOAT32, sizes[t]);
    auto* g = static_cast<float*>(e.tensor->mutable_data());
    for (size_t i = 0; i < sizes[t]; i++) g[i] = grad_value(rank, t, i);
    entries.push_back(e);
  }
  hvd::Response response;
  response.postscale_factor_ = 1.0 / size;  // Horovod's average: sum, then divide

  hvd::QcclAllreduce op(comm);
  // A fused batch of four tensors, then a single tensor (the unfused path).
  std::vector<hvd::TensorTableEntry> single = {entries[2]};
  for (auto* batch : {&entries, &single}) {
    hvd::Status s = op.Execute(*batch, response);
    if (!s.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", rank, s.reason().c_str());
      return 1;
    }
  }
  for (size_t t = 0; t < 4; t++) {
    auto* out = static_cast<const float*>(entries[t].output->data());
    for (size_t i = 0; i < sizes[t]; i++) {
      double want = 0;
      for (int r = 0; r < size; r++) want += grad_value(r, t, i);
      want /= size;
      if (std::fabs(out[i] - want) > 1e-4 * (1 + std::fabs(want))) {
        std::fprintf(stderr, "rank %d: %s[%zu] = %g, expected %g\n", rank,
                     entries[t].tensor_name.c_str(), i, out[i], want);
        return 1;
      }
    }
  }
  std::printf("rank %d/%d: averaged %zu tensors through the fusion buffer: ok\n", rank, size,
              entries.size());
  return qcclCommDestroy(comm) == qcclSuccess ? 0 : 1;
}

int main(int argc, char** argv) {
  if (std::getenv("QCCL_RANK") || std::getenv("RANK") || std::getenv("OMPI_COMM_WORLD_RANK") ||
      std::getenv("PMI_RANK") || std::getenv("SLURM_PROCID")) {
    qcclComm_t comm;
    qcclResult_t r = qcclCommInitFromEnv(&comm);
    if (r != qcclSuccess) {
      std::fprintf(stderr, "qcclCommInitFromEnv: %s\n", qcclGetLastError(nullptr));
      return 1;
    }
    return run_rank(comm);
  }

  // No launcher: fork the ranks here; rank 0 makes the id and pipes it to the others.
  int nranks = argc > 1 ? std::atoi(argv[1]) : 3;
  if (nranks < 1) nranks = 1;
  int fds[2];
  if (pipe(fds) != 0) return 1;
  std::vector<pid_t> pids;
  for (int rank = 0; rank < nranks; rank++) {
    pid_t pid = fork();
    if (pid < 0) return 1;
    if (pid == 0) {
      qcclUniqueId id;
      if (rank == 0) {
        if (qcclGetUniqueId(&id) != qcclSuccess) _exit(1);
        for (int k = 1; k < nranks; k++)
          if (write(fds[1], &id, sizeof id) != (ssize_t)sizeof id) _exit(1);
      } else if (read(fds[0], &id, sizeof id) != (ssize_t)sizeof id) {
        _exit(1);
      }
      qcclComm_t comm;
      if (qcclCommInitRank(&comm, nranks, id, rank) != qcclSuccess) {
        std::fprintf(stderr, "rank %d: qcclCommInitRank: %s\n", rank, qcclGetLastError(nullptr));
        _exit(1);
      }
      int rc = run_rank(comm);
      std::fflush(stdout);
      _exit(rc);
    }
    pids.push_back(pid);
  }
  close(fds[0]);
  close(fds[1]);
  int failed = 0;
  for (pid_t p : pids) {
    int st = 0;
    waitpid(p, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) failed = 1;
  }
  std::printf("horovod-style allreduce on %d ranks: %s\n", nranks, failed ? "FAILED" : "ok");
  return failed;
}
