// Test support: the CPU backend claiming its memory is not host memory. Every call goes to the
// CPU backend, whose memory the wrapper hands out; a ModelRunner on it then takes the paths it
// takes on the CUDA backend (uploads, copies back into staging memory), on the CPU.
#pragma once

#include <memory>
#include <string_view>

#include "gtest/gtest.h"
#include "kernels/src/forwarding_backend.h"
#include "tandem/kernels/backend.h"

namespace tandem::testing {

class DeviceLikeBackend : public kernels::test_support::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  std::string_view name() const override { return "device-like"; }
  bool host_memory() const override { return false; }
};

inline std::unique_ptr<kernels::Backend> DeviceLike() {
  auto cpu = kernels::CreateCpuBackend({.num_threads = 1});
  EXPECT_TRUE(cpu.ok()) << cpu.status();
  return std::make_unique<DeviceLikeBackend>(std::move(cpu).value());
}

}  // namespace tandem::testing
