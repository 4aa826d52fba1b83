#include "tandem/collective/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"

namespace tandem::collective {
namespace {

struct StreamDeleter {
  void operator()(CUstream_st* s) const { cudaStreamDestroy(s); }
};
struct DeviceFloatDeleter {
  void operator()(float* p) const { cudaFree(p); }
};

absl::Status CudaError(cudaError_t e, const char* what) {
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

absl::Status NcclError(ncclResult_t r, const char* what) {
  const absl::StatusCode code = r == ncclRemoteError || r == ncclSystemError
                                    ? absl::StatusCode::kUnavailable
                                    : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat(what, ": ", ncclGetErrorString(r)));
}

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(int rank, int size, int device, ncclComm_t comm, cudaStream_t stream,
                   std::unique_ptr<CUstream_st, StreamDeleter> own_stream,
                   std::unique_ptr<float, DeviceFloatDeleter> scratch, absl::Duration timeout)
      : Communicator(rank, size),
        device_(device),
        comm_(comm),
        stream_(stream),
        own_stream_(std::move(own_stream)),
        scratch_(std::move(scratch)),
        timeout_(timeout) {}

  ~NcclCommunicator() override {
    cudaSetDevice(device_);
    if (aborted_) return;
    if (health().ok()) {
      ncclCommDestroy(comm_);
    } else {
      ncclCommAbort(comm_);
    }
  }

  const char* kind() const override { return "nccl"; }

 protected:
  absl::Status DoAllReduceSum(float* data, size_t count) override {
    cudaSetDevice(device_);
    ncclResult_t r = ncclAllReduce(data, data, count, ncclFloat32, ncclSum, comm_, stream_);
    if (r != ncclSuccess) return NcclError(r, "ncclAllReduce");
    return Wait(timeout_);
  }

  absl::Status DoAllGather(const void* in, void* out, size_t bytes) override {
    cudaSetDevice(device_);
    ncclResult_t r = ncclAllGather(in, out, bytes, ncclChar, comm_, stream_);
    if (r != ncclSuccess) return NcclError(r, "ncclAllGather");
    return Wait(timeout_);
  }

  absl::Status DoBroadcast(void* data, size_t bytes, int root,
                           std::optional<absl::Duration> timeout) override {
    cudaSetDevice(device_);
    ncclResult_t r = ncclBroadcast(data, data, bytes, ncclChar, root, comm_, stream_);
    if (r != ncclSuccess) return NcclError(r, "ncclBroadcast");
    return Wait(timeout.value_or(timeout_));
  }

  absl::Status DoBarrier() override {
    cudaSetDevice(device_);
    ncclResult_t r =
        ncclAllReduce(scratch_.get(), scratch_.get(), 1, ncclFloat32, ncclSum, comm_, stream_);
    if (r != ncclSuccess) return NcclError(r, "ncclAllReduce (barrier)");
    return Wait(timeout_);
  }

 private:
  // Waits for the stream, polling NCCL for a failed peer; aborts the communicator at the
  // deadline (a kernel waiting for a dead peer never finishes on its own).
  absl::Status Wait(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) return absl::OkStatus();
      if (e != cudaErrorNotReady) return CudaError(e, "waiting for the collective");
      ncclResult_t async = ncclSuccess;
      ncclResult_t r = ncclCommGetAsyncError(comm_, &async);
      if (r != ncclSuccess) return NcclError(r, "ncclCommGetAsyncError");
      if (async != ncclSuccess && async != ncclInProgress) {
        ncclCommAbort(comm_);
        aborted_ = true;
        return NcclError(async, "a peer failed");
      }
      if (absl::Now() >= deadline) {
        ncclCommAbort(comm_);
        aborted_ = true;
        return absl::DeadlineExceededError(
            absl::StrCat("timed out after ", absl::FormatDuration(timeout)));
      }
      std::this_thread::yield();
    }
  }

  int device_;
  ncclComm_t comm_;
  cudaStream_t stream_;
  std::unique_ptr<CUstream_st, StreamDeleter> own_stream_;
  std::unique_ptr<float, DeviceFloatDeleter> scratch_;  // one float for the barrier
  absl::Duration timeout_;
  bool aborted_ = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(Communicator& bootstrap,
                                                                     const NcclOptions& options) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || options.device < 0 ||
      options.device >= devices) {
    return absl::FailedPreconditionError(absl::StrCat("NCCL rank ", bootstrap.rank(),
                                                      ": no CUDA device ", options.device, " (",
                                                      devices, " visible)"));
  }
  ncclUniqueId id{};
  if (bootstrap.rank() == 0) {
    ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) return NcclError(r, "ncclGetUniqueId");
  }
  absl::Status sent = bootstrap.Broadcast(&id, sizeof(id), 0);
  if (!sent.ok()) return sent;
  cudaError_t e = cudaSetDevice(options.device);
  if (e != cudaSuccess) return CudaError(e, "cudaSetDevice");
  std::unique_ptr<CUstream_st, StreamDeleter> own_stream;
  cudaStream_t stream = static_cast<cudaStream_t>(options.stream);
  if (stream == nullptr) {
    e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) return CudaError(e, "cudaStreamCreate");
    own_stream.reset(stream);
  }
  float* scratch = nullptr;
  e = cudaMalloc(&scratch, sizeof(float));
  if (e != cudaSuccess) return CudaError(e, "cudaMalloc");
  std::unique_ptr<float, DeviceFloatDeleter> scratch_owner(scratch);
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRank(&comm, bootstrap.size(), id, bootstrap.rank());
  if (r != ncclSuccess) return NcclError(r, "ncclCommInitRank");
  return std::unique_ptr<Communicator>(
      new NcclCommunicator(bootstrap.rank(), bootstrap.size(), options.device, comm, stream,
                           std::move(own_stream), std::move(scratch_owner), options.timeout));
}

bool NcclBuilt() { return true; }

}  // namespace tandem::collective
