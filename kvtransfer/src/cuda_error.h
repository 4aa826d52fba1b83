// The backends built with CUDA (cuda_ipc, nccl's links) report a CUDA runtime error alike.
// Private to kvtransfer; include only where CUDA is built.
#pragma once

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace tandem::kvtransfer::internal {

// Internal "what: cudaErrorName (description)".
inline absl::Status CudaError(cudaError_t error, absl::string_view what) {
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorName(error), " (", cudaGetErrorString(error), ")"));
}

}  // namespace tandem::kvtransfer::internal
