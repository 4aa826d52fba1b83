// The data plane under the "nccl" backend: one two-rank link per connected pair of agents, with
// NCCL's point-to-point semantics. The agent (nccl_agent.cc) runs the control protocol over a
// TCP connection and calls this interface; nccl_link.cc implements it with NCCL on the agent's
// CUDA device.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tandem::kvtransfer::nccl {

// `bytes` bytes at `data`, in memory the link's factory accepted (CheckMemory).
struct Span {
  char* data = nullptr;
  uint64_t bytes = 0;
};

// One end of a link between two ranks (0: the agent that connected, 1: the one it connected to).
// Operations are matched in order, as NCCL matches sends and receives between two ranks: the
// n-th span that one end sends lands in the n-th span the other end receives, and both have
// the same size. One thread uses a link at a time, except Abort, which any thread may call.
class PairLink {
 public:
  virtual ~PairLink() = default;

  // Queues one send (to the other rank) or one receive (from it) per span, in order, and
  // returns a ticket for the batch. An error means the link is no longer usable.
  virtual absl::StatusOr<uint64_t> Post(bool send, const std::vector<Span>& spans) = 0;

  // OK once every operation of batch `ticket` (and of every batch before it) has finished on
  // this end; an error once the link has failed; nullopt while in flight.
  virtual std::optional<absl::Status> Poll(uint64_t ticket) = 0;

  // Ends the link: operations in flight stop (their batches report an error) and later Posts
  // fail. Used when the peer is gone or a transfer outlived its deadline.
  virtual void Abort() = 0;
};

// Makes the links of one agent.
class PairLinkFactory {
 public:
  virtual ~PairLinkFactory() = default;

  // OK if [base, base + bytes) is memory this kind of link can move (NCCL: device memory of
  // the agent's device); InvalidArgument saying why not otherwise.
  virtual absl::Status CheckMemory(const void* base, size_t bytes) = 0;

  // A fresh rendezvous id; rank 0 makes it and sends it to rank 1 over the control connection.
  virtual absl::StatusOr<std::string> NewLinkId() = 0;

  // Joins link `id` as `rank`; returns once both ranks have joined. Fails with
  // DeadlineExceeded at `deadline`, Cancelled as soon as `cancel` turns true, or with the
  // reason the link cannot be made.
  virtual absl::StatusOr<std::unique_ptr<PairLink>> Join(const std::string& id, int rank,
                                                         absl::Time deadline,
                                                         const std::atomic<bool>& cancel) = 0;
};

}  // namespace tandem::kvtransfer::nccl
