// Collectives over a fixed group of ranks: what tensor parallelism needs (all-reduce, all-gather,
// broadcast, barrier), behind one interface with a Gloo (CPU, TCP) and an NCCL (GPU)
// implementation.
//
// Every rank of a group calls the same collectives in the same order. A call returns once this
// rank's part is done, or an error: the group's timeout passed (DeadlineExceeded), or a peer went
// away (Unavailable: its process died and its connections closed). A communicator that failed
// once stays failed, returning that first error from every later call, because a collective that
// was interrupted leaves the ranks out of step.
//
//   TANDEM_ASSIGN_OR_RETURN(auto comm, CreateGlooCommunicator({.rank = r, .size = 2, ...}));
//   TANDEM_RETURN_IF_ERROR(comm->AllReduceSum(partial, n));  // every rank now holds the sum
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tandem::collective {

// What the collectives of one communicator have cost since it was created (for metrics).
struct CollectiveStats {
  uint64_t calls = 0;
  uint64_t bytes = 0;  // payload bytes this rank contributed or received per call, added up
  double seconds = 0;  // wall time spent inside collectives
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // "gloo" or "nccl".
  virtual const char* kind() const = 0;

  // Sums data[0, count) over every rank, in place: afterwards every rank holds the same sums,
  // bit for bit. `data` is memory of this communicator's device (host memory for Gloo).
  absl::Status AllReduceSum(float* data, size_t count);
  // Concatenates each rank's `bytes` bytes of `in` into out[size() * bytes], rank r's at
  // offset r * bytes, on every rank. `in` and `out` do not overlap.
  absl::Status AllGather(const void* in, void* out, size_t bytes);
  // Every rank's `mine` (at most `max_bytes`; InvalidArgument past it), rank r's at [r], on
  // every rank: one all-gather of fixed slots of a length and max_bytes bytes.
  absl::StatusOr<std::vector<std::string>> AllGatherBytes(std::string_view mine,
                                                          size_t max_bytes);
  // Copies root's data[0, bytes) into every other rank's `data`. `timeout` overrides the
  // group's for this call; absl::InfiniteDuration() waits for as long as the root takes (a
  // follower waiting for the next step of an idle leader), still failing at once when the
  // root's process goes away.
  absl::Status Broadcast(void* data, size_t bytes, int root,
                         std::optional<absl::Duration> timeout = std::nullopt);
  // Returns once every rank has called it.
  absl::Status Barrier();

  // The first error, or OK while the communicator works.
  absl::Status health() const { return failed_; }
  const CollectiveStats& stats() const { return stats_; }

 protected:
  Communicator(int rank, int size) : rank_(rank), size_(size) {}
  virtual absl::Status DoAllReduceSum(float* data, size_t count) = 0;
  virtual absl::Status DoAllGather(const void* in, void* out, size_t bytes) = 0;
  virtual absl::Status DoBroadcast(void* data, size_t bytes, int root,
                                   std::optional<absl::Duration> timeout) = 0;
  virtual absl::Status DoBarrier() = 0;

 private:
  // Runs one collective: refuses after a failure, times and counts it, keeps its error.
  template <typename F>
  absl::Status Run(const char* name, uint64_t bytes, F&& op);

  int rank_;
  int size_;
  absl::Status failed_;
  CollectiveStats stats_;
};

}  // namespace tandem::collective
