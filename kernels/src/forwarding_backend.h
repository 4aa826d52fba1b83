// Test support: a Backend that passes every call to another one, for tests that change one
// thing about a real backend (inject a fault into one operator, or claim its memory is not host
// memory) by overriding just that. Its memory is the inner backend's, handed out through
// Allocate.
#pragma once

#include <map>
#include <memory>
#include <string_view>
#include <utility>

#include "tandem/kernels/backend.h"

namespace tandem::kernels::test_support {

class ForwardingBackend : public Backend {
 public:
  explicit ForwardingBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}

  std::string_view name() const override { return inner_->name(); }
  bool host_memory() const override { return inner_->host_memory(); }
  void CopyToDevice(void* dst, const void* src, size_t bytes) override {
    inner_->CopyToDevice(dst, src, bytes);
  }
  void CopyToHost(void* dst, const void* src, size_t bytes) override {
    inner_->CopyToHost(dst, src, bytes);
  }
  void CopyRows(void* dst, size_t dst_stride, const void* src, size_t src_stride,
                size_t row_bytes, int rows) override {
    inner_->CopyRows(dst, dst_stride, src, src_stride, row_bytes, rows);
  }
  absl::Status Synchronize() override { return inner_->Synchronize(); }
  std::unique_ptr<PackedWeight> PackWeight(const void* w, DType dtype, int n, int k) override {
    return inner_->PackWeight(w, dtype, n, k);
  }
  std::unique_ptr<PackedWeight> PackQuantizedWeight(const QuantizedWeightView& w) override {
    return inner_->PackQuantizedWeight(w);
  }
  bool LinearRoundsX(int m, DType w_dtype) const override {
    return inner_->LinearRoundsX(m, w_dtype);
  }
  bool LinearSplitsX(DType w_dtype, WeightQuant quant) const override {
    return inner_->LinearSplitsX(w_dtype, quant);
  }
  bool LinearCarriesXInBytes(WeightQuant quant) const override {
    return inner_->LinearCarriesXInBytes(quant);
  }
  DType ActivationDType(int m, const PackedWeight& w) const override {
    return inner_->ActivationDType(m, w);
  }
  void Linear(const void* x, DType x_dtype, int m, const PackedWeight& w, const float* bias,
              float* y) override {
    inner_->Linear(x, x_dtype, m, w, bias, y);
  }
  bool LinearAdds(int m, const PackedWeight& w) const override { return inner_->LinearAdds(m, w); }
  void LinearAdd(const void* x, DType x_dtype, int m, const PackedWeight& w, const float* bias,
                 float* y) override {
    inner_->LinearAdd(x, x_dtype, m, w, bias, y);
  }
  void RmsNorm(const float* x, const float* weight, float eps, int rows, int dim, void* y,
               DType y_dtype) override {
    inner_->RmsNorm(x, weight, eps, rows, dim, y, y_dtype);
  }
  void AddRmsNorm(float* residual, const float* x, const float* weight, float eps, int rows,
                  int dim, void* y, DType y_dtype) override {
    inner_->AddRmsNorm(residual, x, weight, eps, rows, dim, y, y_dtype);
  }
  void Rope(float* x, const int32_t* positions, int tokens, int heads, int head_dim,
            const float* inv_freq) override {
    inner_->Rope(x, positions, tokens, heads, head_dim, inv_freq);
  }
  void SiluMul(const float* gate_up, int rows, int inter, void* out, DType out_dtype) override {
    inner_->SiluMul(gate_up, rows, inter, out, out_dtype);
  }
  void Embedding(const void* table, DType table_dtype, const int32_t* ids, int tokens, int dim,
                 float* out) override {
    inner_->Embedding(table, table_dtype, ids, tokens, dim, out);
  }
  void WriteKv(const float* k, const float* v, const int32_t* slot_mapping, int tokens,
               const KvLayout& layout, void* layer_cache) override {
    inner_->WriteKv(k, v, slot_mapping, tokens, layout, layer_cache);
  }
  bool PagedAttentionRoundsQ(DType cache_dtype, int head_dim, int q_len) const override {
    return inner_->PagedAttentionRoundsQ(cache_dtype, head_dim, q_len);
  }
  void PagedAttention(const float* q, const void* layer_cache, const KvLayout& layout,
                      const PagedAttentionBatch& batch, int num_heads, float scale, void* out,
                      DType out_dtype) override {
    inner_->PagedAttention(q, layer_cache, layout, batch, num_heads, scale, out, out_dtype);
  }
  void GatherAdd(const float* a, const float* b, const int32_t* rows, int num_rows, int dim,
                 float* out) override {
    inner_->GatherAdd(a, b, rows, num_rows, dim, out);
  }
  void AttentionInputs(const float* qkv, int tokens, int num_heads, const float* q_norm,
                       const float* k_norm, float eps, const int32_t* positions,
                       const float* inv_freq, const int32_t* slot_mapping, const KvLayout& layout,
                       void* layer_cache, float* q, float* k, float* v) override {
    inner_->AttentionInputs(qkv, tokens, num_heads, q_norm, k_norm, eps, positions, inv_freq,
                            slot_mapping, layout, layer_cache, q, k, v);
  }
  void SampleRows(float* logits, int rows, int vocab, const SampleRowParams* params,
                  const LogitEdit* edits, int num_edits, int max_logprobs, void* scratch,
                  TokenLogprob* sampled, TokenLogprob* top) override {
    inner_->SampleRows(logits, rows, vocab, params, edits, num_edits, max_logprobs, scratch,
                       sampled, top);
  }
  size_t SampleRowsScratchBytes(int rows, int vocab, int max_edits) const override {
    return inner_->SampleRowsScratchBytes(rows, vocab, max_edits);
  }

 protected:
  absl::StatusOr<void*> AllocateBytes(size_t bytes) override {
    absl::StatusOr<DeviceBuffer> buffer = inner_->Allocate(bytes);
    if (!buffer.ok()) return buffer.status();
    void* data = buffer->data();
    buffers_.emplace(data, std::move(buffer).value());
    return data;
  }
  void FreeBytes(void* data) override { buffers_.erase(data); }

  Backend& inner() { return *inner_; }

 private:
  std::unique_ptr<Backend> inner_;
  std::map<void*, DeviceBuffer> buffers_;  // declared after inner_: freed before it
};

}  // namespace tandem::kernels::test_support
