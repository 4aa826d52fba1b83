// Pieces shared by the backends: the descriptor wire format, range checks, and the completion
// state behind every TransferHandle. Private to kvtransfer.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tandem/kvtransfer/agent.h"

namespace tandem::kvtransfer::internal {

enum class BackendKind : uint8_t { kLocal = 1, kUcx = 2, kCudaIpc = 3, kNccl = 4 };

const char* BackendName(BackendKind kind);

// What a peer needs to write into a registered region. Serialised with a magic, a version and a
// checksum so that a truncated or garbled descriptor is refused instead of trusted.
struct RegionDescriptor {
  BackendKind backend = BackendKind::kLocal;
  // The incarnation of the agent that registered the region (see NewInstanceId).
  uint64_t owner_instance = 0;
  uint64_t region_id = 0;
  // Distinguishes successive registrations of the same region id.
  uint64_t generation = 0;
  // The region's address in the owner's address space and its size.
  uint64_t base = 0;
  uint64_t bytes = 0;
  // Backend-specific bytes (UCX: the packed remote key).
  std::string payload;
};

std::string EncodeDescriptor(const RegionDescriptor& descriptor);

// Parses and verifies a descriptor; InvalidArgument (saying what is wrong) if it is garbled or
// was made by another backend than `expected`.
absl::StatusOr<RegionDescriptor> DecodeDescriptor(const std::string& encoded, BackendKind expected);

// InvalidArgument naming the first range that does not fit in [0, src_bytes) on the source or
// [0, dst_bytes) on the destination (overflow-safe).
absl::Status CheckRanges(const std::vector<Range>& ranges, uint64_t src_bytes, uint64_t dst_bytes);

// Drops empty ranges and merges each range into the one before it when both its source and its
// destination continue that one, so consecutive KV blocks go out as one message.
std::vector<Range> CoalesceRanges(const std::vector<Range>& ranges);

// The cuda_ipc descriptor payload: the allocation's cudaIpcMemHandle_t (opaque bytes here, so
// this stays buildable without CUDA), the owner's process id and CUDA device ordinal.
struct CudaIpcPayload {
  static constexpr size_t kHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t)
  std::string handle;                         // kHandleBytes bytes
  uint64_t pid = 0;
  int32_t device = 0;
};
std::string EncodeCudaIpcPayload(const CudaIpcPayload& payload);
// InvalidArgument unless `payload` is exactly one encoded CudaIpcPayload.
absl::StatusOr<CudaIpcPayload> DecodeCudaIpcPayload(const std::string& payload);

// Whether `base` is CUDA device memory. Always false in a build without CUDA; defined by the
// cuda_ipc backend's sources, so the host-memory backends can refuse a device KV cache with a
// clear error instead of crashing inside memcpy or UCX.
bool IsDeviceMemory(const void* base);

// A random 64-bit id for one agent incarnation, never 0.
uint64_t NewInstanceId();

// Completion state of one transfer, shared by the backend (which finishes it) and the handle
// (which reports it). Thread-safe.
class TransferState {
 public:
  explicit TransferState(absl::Time deadline) : deadline_(deadline) {}

  // Records the outcome; the first call wins.
  void Finish(absl::Status status);
  bool finished() const;
  absl::Time deadline() const { return deadline_; }

  // TransferHandle semantics: the outcome, DeadlineExceeded after the deadline, or nullopt.
  std::optional<absl::Status> Poll();
  absl::Status Wait();

 private:
  std::optional<absl::Status> PollLocked();

  const absl::Time deadline_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::optional<absl::Status> result_;
  // What the handle has reported; sticky, so a late completion cannot turn a reported timeout
  // into success.
  std::optional<absl::Status> reported_;
};

// The TransferHandle every backend returns.
class StateHandle : public TransferHandle {
 public:
  explicit StateHandle(std::shared_ptr<TransferState> state) : state_(std::move(state)) {}
  std::optional<absl::Status> Poll() override { return state_->Poll(); }
  absl::Status Wait() override { return state_->Wait(); }

 private:
  std::shared_ptr<TransferState> state_;
};

// A handle that has already finished with `status`.
std::unique_ptr<TransferHandle> FinishedHandle(absl::Status status);

}  // namespace tandem::kvtransfer::internal
