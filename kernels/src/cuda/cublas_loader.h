// cuBLAS and cuBLASLt, loaded with dlopen when the first CUDA backend needs them, so that a
// process that never uses the GPU does not map libcublas and libcublasLt (about 60 MB resident
// on CUDA 13).
//
//   TANDEM_ASSIGN_OR_RETURN(const CublasApi* cublas, LoadCublas());
//   cublasHandle_t handle = nullptr;
//   cublas->create(&handle);
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>

#include "absl/status/statusor.h"

namespace tandem::kernels::cuda {

// The cuBLAS entry points the CUDA backend calls (the symbols cublas_v2.h's names stand for).
struct CublasApi {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSetMathMode) set_math_mode = nullptr;
  decltype(&cublasSetWorkspace_v2) set_workspace = nullptr;
  decltype(&cublasSgemm_v2) sgemm = nullptr;
  // The C entry point (cublas_api.h also declares a C++ overload of the name).
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                            const void*, const void*, cudaDataType, int, const void*, cudaDataType,
                            int, const void*, void*, cudaDataType, int, cublasComputeType_t,
                            cublasGemmAlgo_t) = nullptr;
  decltype(&cublasGetStatusName) status_name = nullptr;
};

// The cuBLASLt entry points of Linear's 16-bit GEMMs (gemm_lt.h).
struct CublasLtApi {
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtDestroy) destroy = nullptr;
  decltype(&cublasLtGetStatusName) status_name = nullptr;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) preference_create = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) preference_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) preference_set = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
};

// Loads libcublas.so.<major of the cuBLAS this build was compiled against> once: first by its
// name (LD_LIBRARY_PATH, the executable's run path, the loader's cache), then from the CUDA
// toolkit the build used. FailedPrecondition naming the library and the loader's reason when it
// cannot be loaded or lacks an entry point; the same answer on every later call.
absl::StatusOr<const CublasApi*> LoadCublas();

// The same for libcublasLt.so.<major> (on which libcublas itself depends).
absl::StatusOr<const CublasLtApi*> LoadCublasLt();

}  // namespace tandem::kernels::cuda
