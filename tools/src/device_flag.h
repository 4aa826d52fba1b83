// --device (where an engine runs) and the --kv-backend that fits it, shared by every command
// that creates an engine.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "tandem/engine/llm_engine.h"
#include "tandem/tools/args.h"

namespace tandem::tools {

// Declares --device cuda|cpu, --cpu-isa, --sampling-device and --enforce-eager.
void DeclareDeviceFlag(Args& args);

// The --cpu-isa value (default auto). An unknown name is an InvalidArgument, an instruction set
// this CPU lacks a FailedPrecondition, each one line naming the flag.
absl::StatusOr<kernels::CpuIsa> CpuIsaFlag(const Args& args);

// The --sampling-device value (default auto); another name is an InvalidArgument.
absl::StatusOr<engine::SamplingDevice> SamplingDeviceFlag(const Args& args);

// The --device value; without the flag, cuda when this build has the CUDA backend and a GPU is
// present, else cpu. `--device cuda` where it cannot run is a FailedPrecondition whose message
// is one line: "COMMAND: --device cuda: <why>".
absl::StatusOr<engine::Device> DeviceFlag(const Args& args);

// The --kv-backend value for engines on `device` (default: cuda_ipc on cuda, ucx on cpu). The
// host-memory transports (ucx, local) cannot send a device KV cache and cuda_ipc sends only
// device memory, so a mismatch is an InvalidArgument naming both flags.
absl::StatusOr<std::string> KvBackendFlag(const Args& args, engine::Device device);

}  // namespace tandem::tools
