#include "kernels/src/cuda/cublas_loader.h"

#include <dlfcn.h>

#include <mutex>
#include <string>
#include <type_traits>

#include "absl/strings/str_cat.h"

namespace tandem::kernels::cuda {
namespace {

template <typename Api>
struct Loaded {
  Api api;
  absl::Status status;
};

// Opens lib<stem>.so.<cuBLAS major>, then from the build's toolkit, and gives `fill` a
// function that resolves one symbol into one of the table's pointers. Never closed: handles
// created from the library may live until the process exits.
template <typename Api, typename Fill>
Loaded<Api> Load(const char* stem, Fill fill) {
  Loaded<Api> out;
  const std::string name = absl::StrCat(stem, ".so.", CUBLAS_VER_MAJOR);
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
  auto resolve = [&](auto& fn, const char* symbol) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, symbol));
    if (fn == nullptr && out.status.ok()) {
      out.status = absl::FailedPreconditionError(
          absl::StrCat(name, " has no ", symbol, " (a cuBLAS older than this build's)"));
    }
  };
  fill(out.api, resolve);
  return out;
}

}  // namespace

absl::StatusOr<const CublasApi*> LoadCublas() {
  static const auto* loaded = new Loaded<CublasApi>(
      Load<CublasApi>("libcublas", [](CublasApi& api, auto& resolve) {
        resolve(api.create, "cublasCreate_v2");
        resolve(api.destroy, "cublasDestroy_v2");
        resolve(api.set_stream, "cublasSetStream_v2");
        resolve(api.set_math_mode, "cublasSetMathMode");
        resolve(api.set_workspace, "cublasSetWorkspace_v2");
        resolve(api.sgemm, "cublasSgemm_v2");
        resolve(api.gemm_ex, "cublasGemmEx");
        resolve(api.status_name, "cublasGetStatusName");
      }));
  if (!loaded->status.ok()) return loaded->status;
  return &loaded->api;
}

absl::StatusOr<const CublasLtApi*> LoadCublasLt() {
  static const auto* loaded = new Loaded<CublasLtApi>(
      Load<CublasLtApi>("libcublasLt", [](CublasLtApi& api, auto& resolve) {
        resolve(api.create, "cublasLtCreate");
        resolve(api.destroy, "cublasLtDestroy");
        resolve(api.status_name, "cublasLtGetStatusName");
        resolve(api.desc_create, "cublasLtMatmulDescCreate");
        resolve(api.desc_destroy, "cublasLtMatmulDescDestroy");
        resolve(api.desc_set, "cublasLtMatmulDescSetAttribute");
        resolve(api.layout_create, "cublasLtMatrixLayoutCreate");
        resolve(api.layout_destroy, "cublasLtMatrixLayoutDestroy");
        resolve(api.preference_create, "cublasLtMatmulPreferenceCreate");
        resolve(api.preference_destroy, "cublasLtMatmulPreferenceDestroy");
        resolve(api.preference_set, "cublasLtMatmulPreferenceSetAttribute");
        resolve(api.heuristic, "cublasLtMatmulAlgoGetHeuristic");
        resolve(api.matmul, "cublasLtMatmul");
      }));
  if (!loaded->status.ok()) return loaded->status;
  return &loaded->api;
}

}  // namespace tandem::kernels::cuda
