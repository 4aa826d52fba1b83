// The "local" backend: agents in one process, found through a process-wide registry by
// address. Submit copies with memcpy on the caller's thread, so its handle is finished when
// Submit returns. Used by the colocated mode and by tests as the reference backend.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "tandem/kvtransfer/agent.h"

namespace tandem::kvtransfer::local {

absl::StatusOr<std::unique_ptr<Agent>> CreateLocalAgent(const AgentOptions& options);

}  // namespace tandem::kvtransfer::local
