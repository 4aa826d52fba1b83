// The backends the operator conformance suite (backend_conformance_test.cc) runs on.
//
// The suite is one table of operator cases (shapes, tolerance, seed), each run on a backend
// against the scalar reference ops with NaN-poisoned outputs and guard regions around every
// tensor. It is compiled into one test binary per backend family; each binary defines
// ConformanceBackends() to say which backends it checks:
//
//   std::vector<ConformanceBackend> ConformanceBackends() {
//     return {{.name = "Cpu",
//              .unavailable = [] { return std::string(); },
//              .create = [] { return CreateCpuBackend({.num_threads = 2}); }}};
//   }
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/kernels/backend.h"

namespace tandem::kernels::conformance {

struct ConformanceBackend {
  // Part of every test name: letters and digits only ("Avx2", "Cuda").
  std::string name;
  // Empty when the backend can run on this machine, else why not (its tests skip with it).
  std::function<std::string()> unavailable;
  std::function<absl::StatusOr<std::unique_ptr<Backend>>()> create;
  // The head_dims its PagedAttention implements; empty: any.
  std::vector<int> attention_head_dims;
};

// Defined by each conformance test binary.
std::vector<ConformanceBackend> ConformanceBackends();

}  // namespace tandem::kernels::conformance
