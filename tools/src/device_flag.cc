#include "device_flag.h"

#include <optional>

#include "absl/strings/str_cat.h"
#include "tandem/kernels/cuda_backend.h"

namespace tandem::tools {

void DeclareDeviceFlag(Args& args) {
  args.Declare("device", "cuda|cpu",
               "where the model runs (default: cuda when this build has CUDA and a GPU is "
               "present, else cpu)");
  args.Declare("cpu-isa", "auto|portable|avx2|avx512|avx512-bf16|avx512-bf16-round",
               "the CPU kernels' instruction set with --device cpu (default auto: the widest this "
               "CPU has that keeps activations exact to about fp32; avx512-bf16-round multiplies "
               "bf16 weights by activations rounded to bf16, about twice as fast in prefill; "
               "avx512 widens bf16 weights to fp32, faster than auto in batched decode on CPUs "
               "with AVX-512 BF16, see docs/operations.md)");
  args.Declare("sampling-device", "auto|host|backend",
               "where tokens are drawn: backend draws them on the device, so only token ids and "
               "log-probabilities come back (samples with a structured output or speculative "
               "drafts are still drawn on the host); host copies every logit row back (default auto: "
               "backend with --device cuda, host with --device cpu)");
  args.DeclareSwitch("enforce-eager",
                     "with --device cuda, run every decode step kernel by kernel instead of "
                     "replaying captured CUDA graphs (for debugging or timing the two)");
}

absl::StatusOr<engine::SamplingDevice> SamplingDeviceFlag(const Args& args) {
  const std::string name = args.GetOr("sampling-device", "auto");
  if (name == "auto") return engine::SamplingDevice::kAuto;
  if (name == "host") return engine::SamplingDevice::kHost;
  if (name == "backend") return engine::SamplingDevice::kBackend;
  return absl::InvalidArgumentError(absl::StrCat(
      args.command(), ": --sampling-device must be auto, host or backend, got ", name));
}

absl::StatusOr<kernels::CpuIsa> CpuIsaFlag(const Args& args) {
  const std::string name = args.GetOr("cpu-isa", "auto");
  const std::optional<kernels::CpuIsa> isa = kernels::CpuIsaFromName(name);
  if (!isa.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        args.command(), ": --cpu-isa must be auto, portable, avx2, avx512, avx512-bf16 or avx512-bf16-round, "
        "got ",
        name));
  }
  if (!kernels::CpuIsaSupported(*isa)) {
    return absl::FailedPreconditionError(
        absl::StrCat(args.command(), ": --cpu-isa ", name, ": this CPU lacks it"));
  }
  return *isa;
}

absl::StatusOr<engine::Device> DeviceFlag(const Args& args) {
  if (!args.Has("device")) {
    return kernels::CudaDeviceCount() > 0 ? engine::Device::kCuda : engine::Device::kCpu;
  }
  const std::string device = *args.Get("device");
  if (device == "cpu") return engine::Device::kCpu;
  if (device != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat(args.command(), ": --device must be cuda or cpu, got ", device));
  }
  if (!kernels::CudaBuilt()) {
    return absl::FailedPreconditionError(
        absl::StrCat(args.command(),
                     ": --device cuda: this build has no CUDA backend (configure with "
                     "-DTANDEM_CUDA=ON where nvcc is installed)"));
  }
  if (kernels::CudaDeviceCount() == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(args.command(), ": --device cuda: no CUDA device is visible to this process"));
  }
  return engine::Device::kCuda;
}

absl::StatusOr<std::string> KvBackendFlag(const Args& args, engine::Device device) {
  const bool cuda = device == engine::Device::kCuda;
  const std::string backend = args.GetOr("kv-backend", cuda ? "cuda_ipc" : "ucx");
  if (backend != "ucx" && backend != "local" && backend != "cuda_ipc" && backend != "nccl") {
    return absl::InvalidArgumentError(absl::StrCat(
        args.command(), ": --kv-backend must be ucx, local, cuda_ipc or nccl, got ", backend));
  }
  const bool device_backend = backend == "cuda_ipc" || backend == "nccl";
  if (cuda && !device_backend) {
    return absl::InvalidArgumentError(
        absl::StrCat(args.command(), ": --kv-backend ", backend,
                     ": ucx/local kv backends need a host KV cache (--device cpu); with "
                     "--device cuda use --kv-backend cuda_ipc (one node) or nccl"));
  }
  if (!cuda && device_backend) {
    return absl::InvalidArgumentError(absl::StrCat(
        args.command(), ": --kv-backend ", backend,
        " sends device memory only (needs --device cuda)"));
  }
  return backend;
}

}  // namespace tandem::tools
