#include "tandem/kvtransfer/agent.h"

#include "absl/strings/str_cat.h"
#include "kvtransfer/src/cuda_ipc/cuda_ipc_agent.h"
#include "kvtransfer/src/local/local_agent.h"
#include "kvtransfer/src/nccl/nccl_agent.h"
#include "kvtransfer/src/ucx/ucx_agent.h"
#include "tandem/base/tsan.h"

namespace tandem::kvtransfer {

void AcquireTransferred(const void* region_base) { TsanAcquire(region_base); }

absl::StatusOr<std::unique_ptr<Agent>> Agent::Create(const AgentOptions& options) {
  if (options.backend == "local") return local::CreateLocalAgent(options);
  if (options.backend == "ucx") return ucx::CreateUcxAgent(options);
  if (options.backend == "cuda_ipc") return cuda_ipc::CreateCudaIpcAgent(options);
  if (options.backend == "nccl") return nccl::CreateNcclAgent(options);
  return absl::InvalidArgumentError(
      absl::StrCat("unknown kvtransfer backend \"", options.backend,
                   "\" (expected \"local\", \"ucx\", \"cuda_ipc\" or \"nccl\")"));
}

}  // namespace tandem::kvtransfer
