#include "tandem/collective/communicator.h"

#include <chrono>

#include "absl/strings/str_cat.h"

namespace tandem::collective {

template <typename F>
absl::Status Communicator::Run(const char* name, uint64_t bytes, F&& op) {
  if (!failed_.ok()) return failed_;
  const auto start = std::chrono::steady_clock::now();
  absl::Status status = op();
  stats_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  stats_.calls += 1;
  stats_.bytes += bytes;
  if (!status.ok()) {
    failed_ = absl::Status(status.code(), absl::StrCat(kind(), " ", name, " on rank ", rank_,
                                                       " of ", size_, ": ", status.message()));
  }
  return failed_;
}

absl::Status Communicator::AllReduceSum(float* data, size_t count) {
  if (size_ == 1) return failed_;
  return Run("all-reduce", count * sizeof(float), [&] { return DoAllReduceSum(data, count); });
}

absl::Status Communicator::AllGather(const void* in, void* out, size_t bytes) {
  return Run("all-gather", bytes * static_cast<uint64_t>(size_),
             [&] { return DoAllGather(in, out, bytes); });
}

absl::Status Communicator::Broadcast(void* data, size_t bytes, int root,
                                     std::optional<absl::Duration> timeout) {
  if (root < 0 || root >= size_) {
    return absl::InvalidArgumentError(
        absl::StrCat("broadcast root ", root, " outside the group of ", size_));
  }
  if (size_ == 1) return failed_;
  return Run("broadcast", bytes, [&] { return DoBroadcast(data, bytes, root, timeout); });
}

absl::Status Communicator::Barrier() {
  if (size_ == 1) return failed_;
  return Run("barrier", 0, [&] { return DoBarrier(); });
}

}  // namespace tandem::collective
