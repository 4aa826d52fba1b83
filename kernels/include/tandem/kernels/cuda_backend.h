// The CUDA backend: the Backend operators as CUDA kernels (cuBLAS for Linear).
//
// Always declared; in a build without CUDA (TANDEM_CUDA=OFF, or no nvcc) the library
// tandem::kernels_cuda holds only cuda_unavailable.cc, so CreateCudaBackend fails with a
// reason and CudaDeviceCount is 0, and callers need no #ifdef.
//
// Every tensor pointer given to it is device memory: activations, the KV cache, positions,
// token ids, slot mappings and inv_freq. The exceptions are PackWeight's source (host; it is
// uploaded) and PagedAttentionBatch's arrays (host, as Backend says; uploaded per call into
// workspace sized by CudaBackendOptions). Operators are queued on the backend's stream and
// return at once; an error (a failed launch, an unsupported head_dim) is kept and returned by
// the next Synchronize. Linear runs cuBLAS, whose kernel choice depends on m, so unlike the CPU
// backend its rows are not batch invariant.
//
//   TANDEM_ASSIGN_OR_RETURN(auto gpu, CreateCudaBackend({.device = 0}));
//   gpu->RmsNorm(d_x, d_weight, 1e-5f, rows, dim, d_y);
//   TANDEM_RETURN_IF_ERROR(gpu->Synchronize());
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/kernels/backend.h"

namespace tandem::kernels {

// The most merge workspace CudaAttentionWorkspaceBytes asks for: a call with more split-KV rows
// than it holds runs in several launches.
inline constexpr int64_t kAttentionWorkspaceBudgetBytes = int64_t{256} << 20;

struct CudaBackendOptions {
  int device = 0;
  // Bounds on one PagedAttention call's batch, for the metadata workspace.
  int max_seqs = 256;
  int max_blocks_per_seq = 8192;
  // Workspace merging split-KV partitions: num_heads * partitions * (head_dim + 2) floats per
  // query row, partitions = ceil(longest context / 512). A call runs in launches of as many rows
  // as it holds; one whose single row does not fit fails with ResourceExhausted.
  int64_t attention_workspace_bytes = kAttentionWorkspaceBudgetBytes;
  // Linear's 16-bit GEMMs past decode sizes (more than 4 rows). kAuto: Tandem's skinny
  // tensor-core GEMM up to 16 rows, cuBLASLt past it (the bias in the GEMM's epilogue, an
  // algorithm per m bucket chosen when a weight of a new shape is packed). kCublasLt: cuBLASLt
  // for every m; kCublas: cublasGemmEx and a bias kernel (both for comparison:
  // tandem_bench_cuda_kernels times all three).
  enum class Gemm { kAuto, kCublasLt, kCublas };
  Gemm gemm = Gemm::kAuto;
};

// Backend::Synchronize waits for the stream and returns the first error since the previous call.
class CudaBackend : public Backend {
 public:
  // The cudaStream_t every operator and copy is queued on, for work that must follow them in
  // order (a tensor-parallel group's NCCL collectives on the activations).
  virtual void* stream() const = 0;
  // The CUDA device the backend runs on (CudaBackendOptions::device).
  virtual int device() const = 0;
};

// Fails (FailedPrecondition) when no CUDA device is present, or when this build has no CUDA.
absl::StatusOr<std::unique_ptr<CudaBackend>> CreateCudaBackend(const CudaBackendOptions& options);

// CudaBackendOptions::attention_workspace_bytes for PagedAttention calls of at most `max_tokens`
// query rows of `num_heads` heads over contexts of at most `max_context` tokens: every row in one
// launch where that takes at most kAttentionWorkspaceBudgetBytes, else that budget (launches of
// fewer rows), and never less than one row's.
int64_t CudaAttentionWorkspaceBytes(int max_tokens, int num_heads, int head_dim, int max_context);

// The number of CUDA devices this process can use: 0 when there is none, no driver, or when
// this build has no CUDA backend (see CudaBuilt).
int CudaDeviceCount();

// Whether this build includes the CUDA backend (configured with CUDA; see TANDEM_CUDA).
bool CudaBuilt();

}  // namespace tandem::kernels
