// The nccl backend's links in a build without CUDA or NCCL: it says so.
#include "absl/status/status.h"
#include "kvtransfer/src/nccl/nccl_agent.h"

namespace tandem::kvtransfer::nccl {

absl::StatusOr<std::unique_ptr<PairLinkFactory>> NewNcclLinkFactory() {
  return absl::InvalidArgumentError(
      "nccl backend not built (this build has no CUDA or no NCCL; configure with -DTANDEM_CUDA=ON "
      "where the CUDA toolkit and NCCL are installed)");
}

}  // namespace tandem::kvtransfer::nccl
