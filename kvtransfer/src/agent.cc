#include "tandem/kvtransfer/agent.h"

#include "absl/strings/str_cat.h"
#include "kvtransfer/src/cuda_ipc/cuda_ipc_agent.h"
#include "kvtransfer/src/internal.h"
#include "kvtransfer/src/local/local_agent.h"
#include "kvtransfer/src/ucx/ucx_agent.h"

#if defined(__SANITIZE_THREAD__)
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

namespace tandem::kvtransfer {

void AcquireTransferred([[maybe_unused]] const void* region_base) {
#if defined(__SANITIZE_THREAD__)
  __tsan_acquire(const_cast<void*>(region_base));
#endif
}

namespace internal {
void ReleaseTransferred([[maybe_unused]] const void* region_base) {
#if defined(__SANITIZE_THREAD__)
  __tsan_release(const_cast<void*>(region_base));
#endif
}
}  // namespace internal

absl::StatusOr<std::unique_ptr<Agent>> Agent::Create(const AgentOptions& options) {
  if (options.backend == "local") return local::CreateLocalAgent(options);
  if (options.backend == "ucx") return ucx::CreateUcxAgent(options);
  if (options.backend == "cuda_ipc") return cuda_ipc::CreateCudaIpcAgent(options);
  return absl::InvalidArgumentError(
      absl::StrCat("unknown kvtransfer backend \"", options.backend,
                   "\" (expected \"local\", \"ucx\" or \"cuda_ipc\")"));
}

}  // namespace tandem::kvtransfer
