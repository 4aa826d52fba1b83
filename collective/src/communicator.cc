#include "tandem/collective/communicator.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"

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

absl::StatusOr<std::vector<std::string>> Communicator::AllGatherBytes(std::string_view mine,
                                                                      size_t max_bytes) {
  if (mine.size() > max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(mine.size(), " bytes exceed the all-gather's slots of ", max_bytes));
  }
  // Fixed-size slots: a length, then the bytes.
  const size_t slot = sizeof(uint32_t) + max_bytes;
  std::vector<char> in(slot, 0);
  const uint32_t length = static_cast<uint32_t>(mine.size());
  std::memcpy(in.data(), &length, sizeof(length));
  std::memcpy(in.data() + sizeof(length), mine.data(), mine.size());
  std::vector<char> out(slot * static_cast<size_t>(size_));
  TANDEM_RETURN_IF_ERROR(AllGather(in.data(), out.data(), slot));
  std::vector<std::string> all;
  for (int r = 0; r < size_; ++r) {
    const char* at = out.data() + slot * static_cast<size_t>(r);
    uint32_t n = 0;
    std::memcpy(&n, at, sizeof(n));
    all.emplace_back(at + sizeof(n), std::min<size_t>(n, max_bytes));
  }
  return all;
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
