// DeviceBuffer ownership, Backend::Allocate and AllocateHostStaging, and the default
// AttentionInputs (the unfused operators), CaptureGraph (none) and LinearAdd (never taken), shared
// by every backend.
#include <algorithm>
#include <new>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"
#include "tandem/kernels/backend.h"

namespace tandem::kernels {

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : owner_(std::exchange(other.owner_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      host_(std::exchange(other.host_, false)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Free();
    owner_ = std::exchange(other.owner_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    host_ = std::exchange(other.host_, false);
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() { Free(); }

void DeviceBuffer::Free() {
  if (data_ == nullptr) return;
  if (host_) {
    owner_->FreeHostBytes(data_);
  } else {
    owner_->FreeBytes(data_);
  }
}

absl::Status CheckAttentionSequence(const PagedAttentionBatch& batch, int s, int block_size) {
  const int q_len = batch.query_start[s + 1] - batch.query_start[s];
  const int64_t room = int64_t{batch.max_blocks_per_seq} * block_size;
  if (q_len >= 0 && q_len <= batch.context_len[s] && batch.context_len[s] <= room) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("PagedAttention: sequence ", s, " has ", q_len, " queries over a context of ",
                   batch.context_len[s], " tokens and room for ", room));
}

absl::StatusOr<DeviceBuffer> Backend::Allocate(size_t bytes) {
  TANDEM_ASSIGN_OR_RETURN(void* data, AllocateBytes(bytes));
  return DeviceBuffer(this, data, bytes, /*host=*/false);
}

absl::StatusOr<DeviceBuffer> Backend::AllocateHostStaging(size_t bytes) {
  TANDEM_ASSIGN_OR_RETURN(void* data, AllocateHostBytes(bytes));
  return DeviceBuffer(this, data, bytes, /*host=*/true);
}

absl::StatusOr<void*> Backend::AllocateHostBytes(size_t bytes) {
  return ::operator new(std::max<size_t>(bytes, 1), std::align_val_t{64});
}

void Backend::FreeHostBytes(void* data) { ::operator delete(data, std::align_val_t{64}); }

void Backend::AttentionInputs(const float* qkv, int tokens, int num_heads, const float* q_norm,
                              const float* k_norm, float eps, const int32_t* positions,
                              const float* inv_freq, const int32_t* slot_mapping,
                              const KvLayout& layout, void* layer_cache, float* q, float* k,
                              float* v) {
  const int head_dim = layout.head_dim;
  const size_t q_bytes = sizeof(float) * num_heads * head_dim;
  const size_t kv_bytes = sizeof(float) * layout.num_kv_heads * head_dim;
  const size_t row_bytes = q_bytes + 2 * kv_bytes;
  const auto* row = reinterpret_cast<const unsigned char*>(qkv);
  CopyRows(q, q_bytes, row, row_bytes, q_bytes, tokens);
  CopyRows(k, kv_bytes, row + q_bytes, row_bytes, kv_bytes, tokens);
  CopyRows(v, kv_bytes, row + q_bytes + kv_bytes, row_bytes, kv_bytes, tokens);
  if (q_norm != nullptr) RmsNorm(q, q_norm, eps, tokens * num_heads, head_dim, q, DType::kF32);
  if (k_norm != nullptr) {
    RmsNorm(k, k_norm, eps, tokens * layout.num_kv_heads, head_dim, k, DType::kF32);
  }
  Rope(q, positions, tokens, num_heads, head_dim, inv_freq);
  Rope(k, positions, tokens, layout.num_kv_heads, head_dim, inv_freq);
  WriteKv(k, v, slot_mapping, tokens, layout, layer_cache);
}

DType Backend::RoundedActivationDType(int m, const PackedWeight& w) const {
  const bool sixteen = w.dtype() == DType::kBF16 || w.dtype() == DType::kF16;
  return sixteen && w.quant() == WeightQuant::kNone && LinearRoundsX(m, w.dtype()) ? w.dtype()
                                                                                   : DType::kF32;
}

void Backend::LinearAdd(const void*, DType, int m, const PackedWeight& w, const float*, float*) {
  TANDEM_CHECK(false) << "LinearAdd of " << m << " rows with " << DTypeName(w.dtype())
                      << " weights: the " << name() << " backend does not add in Linear";
}

absl::StatusOr<std::unique_ptr<Backend::StepGraph>> Backend::CaptureGraph(
    const std::function<absl::Status()>& record) {
  return absl::UnimplementedError(
      absl::StrCat("the ", std::string(name()), " backend has no step graphs"));
}

}  // namespace tandem::kernels
