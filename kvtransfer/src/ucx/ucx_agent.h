// The "ucx" backend: one UCP context and worker per agent, driven by a progress thread that
// owns every UCX call; a listener so peers connect by "host:port"; ucp_put_nbx of each range
// followed by ucp_ep_flush_nbx, so a transfer is complete only once its bytes are remote.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "tandem/kvtransfer/agent.h"

namespace tandem::kvtransfer::ucx {

// The transports used when neither AgentOptions::ucx_transports nor UCX_TLS names any: TCP,
// shared memory and self, which need no RDMA hardware. (With peer-failure detection on, UCX 1.13
// does not use cma for puts, so same-host pushes go over TCP loopback; see docs/kvtransfer.md.)
inline constexpr char kDefaultTransports[] = "tcp,sm,self";

absl::StatusOr<std::unique_ptr<Agent>> CreateUcxAgent(const AgentOptions& options);

}  // namespace tandem::kvtransfer::ucx
