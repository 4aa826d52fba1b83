// The "nccl" backend: pushes between regions of CUDA device memory of agents on different GPUs,
// on one node or across nodes, with NCCL point-to-point sends and receives.
//
// NCCL is two-sided, so the receiving agent takes part in every transfer; the agents run a
// small control protocol over a TCP connection for it:
// - Connect dials the peer's listener (`listen_host`:`listen_port`), exchanges hellos (the
//   address carries the peer's incarnation, so a restarted peer is not reached through an old
//   address), sends a fresh NCCL unique id, and both sides join a two-rank communicator on
//   their own device (the connecting agent is rank 0). Two agents on one GPU cannot form one:
//   NCCL refuses it, and Connect reports NCCL's reason.
// - Submit checks the ranges against both regions, then sends the receiver a header (region,
//   registration generation, destination ranges). The receiver checks them against its region
//   as registered now and answers accept or refuse; on accept both sides queue one ncclSend /
//   ncclRecv per coalesced range in one group, in header order (so the n-th send meets the n-th
//   receive). The receiver reports done when its receives have completed; the handle is OK
//   once both the receiver's done and the sender's own sends have completed.
// - A hang-up of the control connection (the peer's agent or process is gone) aborts the
//   communicator and fails what is in flight with Unavailable; DeregisterMemory force-closes a
//   connection whose transfer on the region is past its deadline, as the other backends do.
// RegisterMemory takes device memory of the agent's device (the current device when the agent
// was created) only. In a build without CUDA or NCCL, Create fails with InvalidArgument
// "nccl backend not built".
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "kvtransfer/src/nccl/pair_link.h"
#include "tandem/kvtransfer/agent.h"

namespace tandem::kvtransfer::nccl {

// An agent of the "nccl" backend on the current CUDA device.
absl::StatusOr<std::unique_ptr<Agent>> CreateNcclAgent(const AgentOptions& options);

// The same agent on the links `links` makes (the NCCL factory in the product; tests pass their
// own to drive the control protocol without GPUs).
absl::StatusOr<std::unique_ptr<Agent>> CreateNcclAgentWith(const AgentOptions& options,
                                                           std::unique_ptr<PairLinkFactory> links);

// The NCCL links of the current CUDA device (nccl_link.cc; nccl_unavailable.cc says it is not
// built).
absl::StatusOr<std::unique_ptr<PairLinkFactory>> NewNcclLinkFactory();

}  // namespace tandem::kvtransfer::nccl
