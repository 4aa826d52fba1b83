#include "kernels/src/cuda/gemm_lt.h"

#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/src/cuda/cublas_loader.h"
#include "tandem/base/status_macros.h"

namespace tandem::kernels::cuda {
namespace {

// Whether cuBLASLt refused the problem: NOT_SUPPORTED (no algorithm), and INVALID_VALUE
// treated alike. Either way the caller falls back to another GEMM, which reports a real
// mistake in the arguments itself.
bool NoAlgorithm(cublasStatus_t status) {
  return status == CUBLAS_STATUS_NOT_SUPPORTED || status == CUBLAS_STATUS_INVALID_VALUE;
}

absl::Status LtStatus(const CublasLtApi& api, cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", api.status_name(status)));
}

// The descriptors of one GEMM shape, destroyed with it.
class Described {
 public:
  explicit Described(const CublasLtApi& api) : api_(api) {}
  ~Described() {
    for (cublasLtMatrixLayout_t layout : {a_, b_, d_}) {
      if (layout != nullptr) api_.layout_destroy(layout);
    }
    if (desc_ != nullptr) api_.desc_destroy(desc_);
    if (preference_ != nullptr) api_.preference_destroy(preference_);
  }
  Described(const Described&) = delete;
  Described& operator=(const Described&) = delete;

  // Row-major y[m, n] = x w^T is column-major y^T[n, m] = op(W)[n, k] x^T[k, m], W stored
  // column-major [k, n] and transposed: A = W (k x n, ld k, op T), B = x (k x m, ld k),
  // C = D = y (n x m, ld n, fp32).
  absl::Status Describe(int n, int k, int m, cudaDataType_t type, bool bias) {
    TANDEM_RETURN_IF_ERROR(LtStatus(
        api_, api_.desc_create(&desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDesc"));
    const int32_t transpose = CUBLAS_OP_T;
    const int32_t keep = CUBLAS_OP_N;
    TANDEM_RETURN_IF_ERROR(Set(CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)));
    TANDEM_RETURN_IF_ERROR(Set(CUBLASLT_MATMUL_DESC_TRANSB, &keep, sizeof(keep)));
    if (bias) {
      const uint32_t epilogue = CUBLASLT_EPILOGUE_BIAS;
      const int32_t bias_type = CUDA_R_32F;
      TANDEM_RETURN_IF_ERROR(Set(CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
      TANDEM_RETURN_IF_ERROR(
          Set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
    }
    TANDEM_RETURN_IF_ERROR(LtStatus(api_, api_.layout_create(&a_, type, k, n, k), "A layout"));
    TANDEM_RETURN_IF_ERROR(LtStatus(api_, api_.layout_create(&b_, type, k, m, k), "B layout"));
    return LtStatus(api_, api_.layout_create(&d_, CUDA_R_32F, n, m, n), "D layout");
  }

  absl::Status SetBias(const float* bias) {
    const void* pointer = bias;
    return Set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, &pointer, sizeof(pointer));
  }

  absl::Status Prefer(size_t workspace_bytes, int alignment) {
    TANDEM_RETURN_IF_ERROR(
        LtStatus(api_, api_.preference_create(&preference_), "cublasLtMatmulPreference"));
    const uint64_t bytes = workspace_bytes;
    TANDEM_RETURN_IF_ERROR(LtStatus(
        api_,
        api_.preference_set(preference_, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &bytes,
                            sizeof(bytes)),
        "workspace preference"));
    const uint32_t align = alignment;
    for (cublasLtMatmulPreferenceAttributes_t attribute :
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
      TANDEM_RETURN_IF_ERROR(LtStatus(
          api_, api_.preference_set(preference_, attribute, &align, sizeof(align)),
          "alignment preference"));
    }
    return absl::OkStatus();
  }

  cublasLtMatmulDesc_t desc() const { return desc_; }
  cublasLtMatrixLayout_t a() const { return a_; }
  cublasLtMatrixLayout_t b() const { return b_; }
  cublasLtMatrixLayout_t d() const { return d_; }
  cublasLtMatmulPreference_t preference() const { return preference_; }

 private:
  absl::Status Set(cublasLtMatmulDescAttributes_t attribute, const void* value, size_t bytes) {
    return LtStatus(api_, api_.desc_set(desc_, attribute, value, bytes),
                    "cublasLtMatmulDescSetAttribute");
  }

  const CublasLtApi& api_;
  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t a_ = nullptr;
  cublasLtMatrixLayout_t b_ = nullptr;
  cublasLtMatrixLayout_t d_ = nullptr;
  cublasLtMatmulPreference_t preference_ = nullptr;
};

}  // namespace

int LtGemm::BucketRows(int m) {
  int bucket = kMinBucketRows;
  while (bucket < m && bucket < (1 << 30)) bucket *= 2;
  return bucket;
}

int LtGemm::Alignment(const void* const* pointers, int count) {
  int alignment = 16;
  for (int i = 0; i < count; ++i) {
    if (pointers[i] == nullptr) continue;
    const auto address = reinterpret_cast<uintptr_t>(pointers[i]);
    while (alignment > 2 && address % alignment != 0) alignment /= 2;
  }
  return alignment;
}

absl::StatusOr<std::unique_ptr<LtGemm>> LtGemm::Create(void* workspace, size_t workspace_bytes) {
  TANDEM_ASSIGN_OR_RETURN(const CublasLtApi* api, LoadCublasLt());
  cublasLtHandle_t handle = nullptr;
  TANDEM_RETURN_IF_ERROR(LtStatus(*api, api->create(&handle), "cublasLtCreate"));
  return std::unique_ptr<LtGemm>(new LtGemm(api, handle, workspace, workspace_bytes));
}

LtGemm::~LtGemm() { api_->destroy(handle_); }

absl::StatusOr<LtGemm::Choice> LtGemm::Ask(const Key& key) const {
  const auto [n, k, type, bias, alignment, rows] = key;
  Described described(*api_);
  // A negative rows is one m's own choice.
  TANDEM_RETURN_IF_ERROR(described.Describe(n, k, rows < 0 ? -rows : rows,
                                            static_cast<cudaDataType_t>(type), bias));
  TANDEM_RETURN_IF_ERROR(described.Prefer(workspace_bytes_, alignment));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status =
      api_->heuristic(handle_, described.desc(), described.a(), described.b(), described.d(),
                      described.d(), described.preference(), 1, &result, &found);
  Choice choice;
  if (NoAlgorithm(status) || (status == CUBLAS_STATUS_SUCCESS && found == 0)) return choice;
  TANDEM_RETURN_IF_ERROR(LtStatus(*api_, status, "cublasLtMatmulAlgoGetHeuristic"));
  choice.found = result.state == CUBLAS_STATUS_SUCCESS;
  choice.algo = result.algo;
  return choice;
}

absl::StatusOr<LtGemm::Choice> LtGemm::Choose(const Key& key) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = choices_.find(key); it != choices_.end()) return it->second;
  }
  // Asked outside the lock: two threads may both ask, and keep the same answer.
  TANDEM_ASSIGN_OR_RETURN(Choice choice, Ask(key));
  std::lock_guard<std::mutex> lock(mu_);
  return choices_.emplace(key, choice).first->second;
}

absl::Status LtGemm::Prepare(int n, int k, cudaDataType_t type) {
  for (bool bias : {false, true}) {
    for (int rows = kMinBucketRows; rows <= kPreparedRows; rows *= 2) {
      TANDEM_RETURN_IF_ERROR(Choose(Key{n, k, type, bias, 16, rows}).status());
    }
  }
  return absl::OkStatus();
}

absl::Status LtGemm::Run(const LtGemmCall& call, cudaStream_t stream) {
  if (call.m <= 0 || call.n <= 0) return absl::OkStatus();
  const void* pointers[] = {call.x16, call.w, call.y, call.bias};
  const int alignment = Alignment(pointers, 4);
  const bool bias = call.bias != nullptr;
  Key key{call.n, call.k, call.type, bias, alignment, BucketRows(call.m)};
  TANDEM_ASSIGN_OR_RETURN(Choice choice, Choose(key));
  Described described(*api_);
  TANDEM_RETURN_IF_ERROR(described.Describe(call.n, call.k, call.m, call.type, bias));
  if (bias) TANDEM_RETURN_IF_ERROR(described.SetBias(call.bias));
  const float one = 1.0f;
  const float beta = call.accumulate ? 1.0f : 0.0f;
  auto run = [&](const Choice& c) {
    return api_->matmul(handle_, described.desc(), &one, call.w, described.a(), call.x16,
                        described.b(), &beta, call.y, described.d(), call.y, described.d(), &c.algo,
                        workspace_, workspace_bytes_, stream);
  };
  cublasStatus_t status = choice.found ? run(choice) : CUBLAS_STATUS_NOT_SUPPORTED;
  if (NoAlgorithm(status)) {
    // The bucket's algorithm does not take this m (or the bucket has none): one for this m.
    std::get<5>(key) = -call.m;
    TANDEM_ASSIGN_OR_RETURN(Choice exact, Choose(key));
    if (!exact.found) {
      return absl::UnimplementedError(absl::StrCat("cuBLASLt has no algorithm for a ", call.m,
                                                   " x ", call.n, " x ", call.k, " GEMM"));
    }
    status = run(exact);
    if (NoAlgorithm(status)) {
      return absl::UnimplementedError(absl::StrCat("cuBLASLt refused its own algorithm for a ",
                                                   call.m, " x ", call.n, " x ", call.k,
                                                   " GEMM"));
    }
  }
  return LtStatus(*api_, status, "cublasLtMatmul");
}

int LtGemm::choices() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(choices_.size());
}

int LtGemm::choices_without_algorithm() const {
  std::lock_guard<std::mutex> lock(mu_);
  int none = 0;
  for (const auto& [key, choice] : choices_) none += choice.found ? 0 : 1;
  return none;
}

}  // namespace tandem::kernels::cuda
