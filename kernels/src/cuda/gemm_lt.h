// Linear's 16-bit GEMMs past decode sizes through cuBLASLt: y[m, n] (fp32) = x16[m, k] w[n, k]^T
// (+ bias[n], added in the GEMM's epilogue rather than by a kernel of its own), with x16 and w
// bf16 or fp16 and fp32 accumulation; with `accumulate`, y += that (beta = 1: the residual
// stream added by the GEMM, Backend::LinearAdd).
//
// The algorithm is chosen per m bucket, as cuBLASLt's heuristic ranks them for the bucket's
// largest m (8, 16, 32, ... rows), and kept: Prepare chooses every bucket up to kPreparedRows
// when a weight of a new shape is packed, so a serving step only looks its choice up; larger
// buckets are chosen on first use. A bucket's algorithm runs every m of the bucket (as
// TensorRT-LLM's GEMM profiler uses its choices); should cuBLASLt refuse it for one m, that m
// gets a choice of its own.
//
//   TANDEM_ASSIGN_OR_RETURN(auto lt, LtGemm::Create(workspace, kCublasWorkspaceBytes));
//   TANDEM_RETURN_IF_ERROR(lt->Prepare(n, k, CUDA_R_16BF));  // at load
//   absl::Status s = lt->Run({.x16 = x16, .m = m, .w = w, .type = CUDA_R_16BF, .n = n, .k = k,
//                             .bias = bias, .y = y}, stream);
//   if (absl::IsUnimplemented(s)) { /* no cuBLASLt algorithm: run cublasGemmEx instead */ }
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tandem::kernels::cuda {

struct CublasLtApi;

// One GEMM: device pointers, row-major. bias may be null.
struct LtGemmCall {
  const void* x16 = nullptr;  // [m, k] of type
  int m = 0;
  const void* w = nullptr;  // [n, k] of type
  cudaDataType_t type = CUDA_R_16BF;
  int n = 0;
  int k = 0;
  const float* bias = nullptr;  // [n]
  float* y = nullptr;           // [m, n]
  // y += x w^T (+ bias) rather than y =. The algorithm chosen for the shape serves both: alpha
  // and beta are arguments of the call, not of the descriptors the heuristic ranks.
  bool accumulate = false;
};

class LtGemm {
 public:
  // Buckets hold m in (bucket / 2, bucket], the smallest 8 (Linear takes m > kGemvMaxRows).
  static constexpr int kMinBucketRows = 8;
  static constexpr int kPreparedRows = 8192;
  // The bucket of m: the least power of two >= m, at least kMinBucketRows.
  static int BucketRows(int m);
  // The operands' alignment the choice is made for: the largest of 16, 8, 4 and 2 bytes that
  // divides every pointer given (null ones ignored).
  static int Alignment(const void* const* pointers, int count);

  // A cuBLASLt handle whose GEMMs use `workspace_bytes` of the caller's device memory at
  // `workspace` (cuBLASLt then allocates nothing, inside a captured step graph or out). The
  // workspace must outlive the LtGemm and be used by nothing running at the same time: the
  // CUDA backend shares it with its cuBLAS handle on the same stream.
  static absl::StatusOr<std::unique_ptr<LtGemm>> Create(void* workspace, size_t workspace_bytes);
  ~LtGemm();
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  // Chooses the algorithms of an [n, k] weight of `type` for every bucket up to kPreparedRows,
  // with and without a bias, for 16-byte aligned operands. A shape already prepared costs a
  // lookup. Errors are cuBLASLt's (a bucket without any algorithm is not one).
  absl::Status Prepare(int n, int k, cudaDataType_t type);

  // Queues the GEMM on `stream`. Unimplemented when cuBLASLt has no algorithm for it (the
  // caller then runs another GEMM); other errors are cuBLASLt's. Thread-safe.
  absl::Status Run(const LtGemmCall& call, cudaStream_t stream);

  // Algorithm choices kept so far, and how many of them found none.
  int choices() const;
  int choices_without_algorithm() const;

 private:
  // n, k, type, bias, alignment, rows: a bucket, or -m for one m its bucket's choice failed.
  using Key = std::tuple<int, int, int, bool, int, int>;
  struct Choice {
    bool found = false;
    cublasLtMatmulAlgo_t algo{};
  };

  LtGemm(const CublasLtApi* api, cublasLtHandle_t handle, void* workspace, size_t bytes)
      : api_(api), handle_(handle), workspace_(workspace), workspace_bytes_(bytes) {}
  // The kept choice for `key`, asking cuBLASLt's heuristic for key's rows the first time.
  absl::StatusOr<Choice> Choose(const Key& key);
  absl::StatusOr<Choice> Ask(const Key& key) const;

  const CublasLtApi* api_;
  cublasLtHandle_t handle_;
  void* workspace_;
  size_t workspace_bytes_;
  mutable std::mutex mu_;
  std::map<Key, Choice> choices_;  // guarded by mu_
};

}  // namespace tandem::kernels::cuda
