// The operator conformance suite (backend_conformance_test.cc) on the CPU backend, once per
// instruction set; those this CPU lacks are skipped.
#include <string>
#include <vector>

#include "kernels/src/backend_conformance.h"
#include "kernels/src/cpu/simd_kernels.h"
#include "tandem/kernels/backend.h"

namespace tandem::kernels::conformance {

std::vector<ConformanceBackend> ConformanceBackends() {
  std::vector<ConformanceBackend> backends;
  for (auto [isa, name] :
       {std::pair{CpuIsa::kPortable, "Portable"}, std::pair{CpuIsa::kAvx2, "Avx2"},
        std::pair{CpuIsa::kAvx512, "Avx512"}, std::pair{CpuIsa::kAvx512Bf16, "Avx512Bf16"},
        std::pair{CpuIsa::kAvx512Bf16Round, "Avx512Bf16Round"}}) {
    backends.push_back({
        .name = name,
        .unavailable =
            [isa, name] {
              return cpu::CpuSupports(isa) ? std::string() : std::string("this CPU lacks ") + name;
            },
        // Two threads: the work is split between them, as in serving.
        .create = [isa] { return CreateCpuBackend({.num_threads = 2, .isa = isa}); },
    });
  }
  return backends;
}

}  // namespace tandem::kernels::conformance
