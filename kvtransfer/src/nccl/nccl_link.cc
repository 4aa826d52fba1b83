// PairLink on NCCL: a two-rank communicator per connected pair, non-blocking (so that joins and
// group launches can be bounded by deadlines and cancelled), one stream per link, a CUDA event
// per posted batch.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "kvtransfer/src/cuda_error.h"
#include "kvtransfer/src/nccl/nccl_agent.h"
#include "tandem/base/status_macros.h"

namespace tandem::kvtransfer::nccl {
namespace {

using internal::CudaError;

// NCCL refuses sends and receives of more than this many elements on some versions; larger
// spans go out as several operations (both ends split them the same way).
constexpr uint64_t kMaxOpBytes = uint64_t{1} << 30;
// A group holds at most this many operations; a longer batch is posted as several groups.
constexpr int kMaxGroupOps = 256;
// How long a group may take to launch (the first one also sets up the peer-to-peer channels,
// which needs the other end to post its half).
constexpr absl::Duration kLaunchTimeout = absl::Seconds(30);

absl::Status NcclError(ncclResult_t r, ncclComm_t comm, const char* what) {
  const char* last = ncclGetLastError(comm);
  return absl::UnavailableError(
      absl::StrCat(what, ": ", ncclGetErrorString(r), last != nullptr && *last != '\0' ? " (" : "",
                   last != nullptr ? last : "", last != nullptr && *last != '\0' ? ")" : ""));
}

// Waits for a non-blocking communicator's pending call (init, group end) to settle.
ncclResult_t Settle(ncclComm_t comm, absl::Time deadline, const std::atomic<bool>* cancel) {
  ncclResult_t state = ncclInProgress;
  for (;;) {
    if (ncclResult_t r = ncclCommGetAsyncError(comm, &state); r != ncclSuccess) return r;
    if (state != ncclInProgress) return state;
    if ((cancel != nullptr && cancel->load()) || absl::Now() >= deadline) return ncclInProgress;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

class NcclLink : public PairLink {
 public:
  NcclLink(int device, int rank, ncclComm_t comm, cudaStream_t stream)
      : device_(device), peer_(1 - rank), comm_(comm), stream_(stream) {}

  ~NcclLink() override {
    cudaSetDevice(device_);
    Abort();
    cudaStreamSynchronize(stream_);
    for (auto& [ticket, event] : events_) cudaEventDestroy(event);
    cudaStreamDestroy(stream_);
  }

  absl::StatusOr<uint64_t> Post(bool send, const std::vector<Span>& spans) override {
    if (!failure_.ok()) return failure_;
    cudaSetDevice(device_);
    int in_group = 0;
    bool open = false;
    const auto close_group = [&]() -> absl::Status {
      open = false;
      ncclResult_t r = ncclGroupEnd();
      if (r == ncclInProgress) r = Settle(comm_, absl::Now() + kLaunchTimeout, &aborted_);
      if (r == ncclInProgress) {
        return Fail(absl::UnavailableError("NCCL link: a group of transfers did not launch"));
      }
      if (r != ncclSuccess) return Fail(NcclError(r, comm_, "ncclGroupEnd"));
      return absl::OkStatus();
    };
    for (const Span& span : spans) {
      for (uint64_t done = 0; done < span.bytes; done += kMaxOpBytes) {
        if (!open) {
          ncclGroupStart();
          open = true;
          in_group = 0;
        }
        const size_t bytes = static_cast<size_t>(std::min(kMaxOpBytes, span.bytes - done));
        const ncclResult_t r =
            send ? ncclSend(span.data + done, bytes, ncclUint8, peer_, comm_, stream_)
                 : ncclRecv(span.data + done, bytes, ncclUint8, peer_, comm_, stream_);
        if (r != ncclSuccess && r != ncclInProgress) {
          ncclGroupEnd();
          return Fail(NcclError(r, comm_, send ? "ncclSend" : "ncclRecv"));
        }
        if (++in_group == kMaxGroupOps) TANDEM_RETURN_IF_ERROR(close_group());
      }
    }
    if (open) TANDEM_RETURN_IF_ERROR(close_group());
    cudaEvent_t event = nullptr;
    if (cudaError_t e = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
        e != cudaSuccess) {
      return Fail(CudaError(e, "cudaEventCreate"));
    }
    if (cudaError_t e = cudaEventRecord(event, stream_); e != cudaSuccess) {
      cudaEventDestroy(event);
      return Fail(CudaError(e, "cudaEventRecord"));
    }
    events_[++last_ticket_] = event;
    return last_ticket_;
  }

  std::optional<absl::Status> Poll(uint64_t ticket) override {
    if (!failure_.ok()) return failure_;
    cudaSetDevice(device_);
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(comm_, &async);
    if (async != ncclSuccess && async != ncclInProgress) {
      return Fail(NcclError(async, comm_, "NCCL link"));
    }
    auto it = events_.find(ticket);
    if (it == events_.end()) return absl::OkStatus();  // reported done before
    const cudaError_t q = cudaEventQuery(it->second);
    if (q == cudaErrorNotReady) return std::nullopt;
    if (q != cudaSuccess) return Fail(CudaError(q, "NCCL transfer"));
    // Events fire in stream order: this batch and every one before it are done.
    for (auto e = events_.begin(); e != events_.end() && e->first <= ticket;) {
      cudaEventDestroy(e->second);
      e = events_.erase(e);
    }
    return absl::OkStatus();
  }

  void Abort() override {
    if (aborted_.exchange(true)) return;
    cudaSetDevice(device_);
    ncclCommAbort(comm_);
    if (failure_.ok()) failure_ = absl::CancelledError("the NCCL link was aborted");
  }

 private:
  absl::Status Fail(absl::Status status) {
    if (failure_.ok()) failure_ = status;
    return status;
  }

  const int device_;
  const int peer_;
  const ncclComm_t comm_;
  const cudaStream_t stream_;
  std::atomic<bool> aborted_{false};
  absl::Status failure_;
  uint64_t last_ticket_ = 0;
  std::map<uint64_t, cudaEvent_t> events_;
};

class NcclLinkFactory : public PairLinkFactory {
 public:
  explicit NcclLinkFactory(int device) : device_(device) {}

  absl::Status CheckMemory(const void* base, size_t) override {
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, base) != cudaSuccess ||
        attributes.type != cudaMemoryTypeDevice) {
      cudaGetLastError();
      return absl::InvalidArgumentError(
          "RegisterMemory: nccl registers CUDA device memory only (this is host memory; use the "
          "ucx or local backend)");
    }
    if (attributes.device != device_) {
      return absl::InvalidArgumentError(
          absl::StrCat("RegisterMemory: the memory is on CUDA device ", attributes.device,
                       ", this nccl agent moves memory of device ", device_));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> NewLinkId() override {
    ncclUniqueId id;
    if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
      return NcclError(r, nullptr, "ncclGetUniqueId");
    }
    return std::string(id.internal, sizeof(id.internal));
  }

  absl::StatusOr<std::unique_ptr<PairLink>> Join(const std::string& id, int rank,
                                                 absl::Time deadline,
                                                 const std::atomic<bool>& cancel) override {
    ncclUniqueId unique;
    if (id.size() != sizeof(unique.internal)) {
      return absl::InvalidArgumentError(absl::StrCat("NCCL link id of ", id.size(),
                                                     " bytes, expected ", sizeof(unique.internal)));
    }
    std::copy(id.begin(), id.end(), unique.internal);
    cudaSetDevice(device_);
    cudaStream_t stream = nullptr;
    if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
        e != cudaSuccess) {
      return CudaError(e, "cudaStreamCreate");
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comm = nullptr;
    ncclResult_t r = ncclCommInitRankConfig(&comm, 2, unique, rank, &config);
    if (r == ncclInProgress) r = Settle(comm, deadline, &cancel);
    if (r != ncclSuccess) {
      absl::Status status =
          r == ncclInProgress
              ? (cancel.load() ? absl::CancelledError("NCCL link: join cancelled")
                               : absl::DeadlineExceededError("NCCL link not up by the deadline"))
              : NcclError(r, comm, "ncclCommInitRankConfig");
      if (comm != nullptr) ncclCommAbort(comm);
      cudaStreamDestroy(stream);
      return status;
    }
    return std::make_unique<NcclLink>(device_, rank, comm, stream);
  }

 private:
  const int device_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PairLinkFactory>> NewNcclLinkFactory() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError("nccl: no CUDA device");
  }
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess)
    return CudaError(e, "cudaGetDevice");
  return std::make_unique<NcclLinkFactory>(device);
}

}  // namespace tandem::kvtransfer::nccl
