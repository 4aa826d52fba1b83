// The operator conformance suite (backend_conformance_test.cc) on the CUDA backend. Without a
// CUDA device every case skips, saying so; ctest runs it only with label gpu.
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/src/backend_conformance.h"
#include "tandem/kernels/backend.h"
#include "tandem/kernels/cuda_backend.h"

namespace tandem::kernels::conformance {

std::vector<ConformanceBackend> ConformanceBackends() {
  return {{
      .name = "Cuda",
      .unavailable =
          [] { return CudaDeviceCount() > 0 ? std::string() : std::string("no CUDA device"); },
      .create = []() -> absl::StatusOr<std::unique_ptr<Backend>> {
        // A smaller merge workspace than the default: the largest case needs well under 1 MiB.
        auto backend = CreateCudaBackend({.attention_workspace_bytes = int64_t{16} << 20});
        if (!backend.ok()) return backend.status();
        return std::unique_ptr<Backend>(std::move(backend).value());
      },
      .attention_head_dims = {64, 128},
  }};
}

}  // namespace tandem::kernels::conformance
