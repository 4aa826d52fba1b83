#include "kernels/src/cuda/cublas_loader.h"

#include <dlfcn.h>

#include <mutex>
#include <string>

#include "absl/strings/str_cat.h"

namespace tandem::kernels::cuda {
namespace {

struct Loaded {
  CublasApi api;
  absl::Status status;
};

Loaded Load() {
  Loaded out;
  const std::string name = absl::StrCat("libcublas.so.", CUBLAS_VER_MAJOR);
  void* lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  std::string why = lib == nullptr ? dlerror() : "";
#ifdef TANDEM_CUDA_LIBRARY_DIR
  if (lib == nullptr) {
    const std::string path = absl::StrCat(TANDEM_CUDA_LIBRARY_DIR, "/", name);
    lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) absl::StrAppend(&why, "; ", dlerror());
  }
#endif
  if (lib == nullptr) {
    out.status = absl::FailedPreconditionError(
        absl::StrCat("the CUDA backend needs cuBLAS: cannot load ", name, " (", why, ")"));
    return out;
  }
  // Never closed: handles created from it may live until the process exits.
  auto resolve = [&](auto& fn, const char* symbol) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, symbol));
    if (fn == nullptr && out.status.ok()) {
      out.status = absl::FailedPreconditionError(
          absl::StrCat(name, " has no ", symbol, " (a cuBLAS older than this build's)"));
    }
  };
  resolve(out.api.create, "cublasCreate_v2");
  resolve(out.api.destroy, "cublasDestroy_v2");
  resolve(out.api.set_stream, "cublasSetStream_v2");
  resolve(out.api.set_math_mode, "cublasSetMathMode");
  resolve(out.api.set_workspace, "cublasSetWorkspace_v2");
  resolve(out.api.sgemm, "cublasSgemm_v2");
  resolve(out.api.gemm_ex, "cublasGemmEx");
  resolve(out.api.status_name, "cublasGetStatusName");
  return out;
}

}  // namespace

absl::StatusOr<const CublasApi*> LoadCublas() {
  static const Loaded* loaded = new Loaded(Load());
  if (!loaded->status.ok()) return loaded->status;
  return &loaded->api;
}

}  // namespace tandem::kernels::cuda
