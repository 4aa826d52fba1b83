// Test support: step graphs on the CPU, with the CUDA backend's rules. A device-like CPU backend
// (DeviceLikeBackend) whose CaptureGraph records each operator `record` queues, with its
// arguments as they were at the call, instead of running it; Launch runs the recording again.
// So a replay reads whatever the buffers hold then and nothing else, as a CUDA graph does: a
// runner that planned anything into an operator's host-side arguments, or uploaded a step's
// values inside the capture, replays stale values and its outputs differ from an eager run.
// Copies between host and operator memory, Synchronize and PagedAttention over a host batch
// fail the capture, as they do on CUDA.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "device_like_backend.h"
#include "tandem/kernels/backend.h"

namespace tandem::testing {

class GraphRecordingBackend : public DeviceLikeBackend {
 public:
  using DeviceLikeBackend::DeviceLikeBackend;

  int captures() const { return captures_; }
  int launches() const { return launches_; }

  absl::StatusOr<std::unique_ptr<StepGraph>> CaptureGraph(
      const std::function<absl::Status()>& record) override {
    if (recording_ != nullptr) return absl::FailedPreconditionError("nested capture");
    auto ops = std::make_shared<std::vector<std::function<void()>>>();
    recording_ = ops.get();
    refused_ = absl::OkStatus();
    absl::Status status = record();
    recording_ = nullptr;
    if (status.ok()) status = refused_;
    if (!status.ok()) return status;
    ++captures_;
    return std::unique_ptr<StepGraph>(new Graph(std::move(ops), &launches_));
  }

  void CopyToDevice(void* dst, const void* src, size_t bytes) override {
    if (!Refused("CopyToDevice")) DeviceLikeBackend::CopyToDevice(dst, src, bytes);
  }
  void CopyToHost(void* dst, const void* src, size_t bytes) override {
    if (!Refused("CopyToHost")) DeviceLikeBackend::CopyToHost(dst, src, bytes);
  }
  absl::Status Synchronize() override {
    if (Refused("Synchronize")) return refused_;
    return DeviceLikeBackend::Synchronize();
  }
  void SampleRows(float* logits, int rows, int vocab, const kernels::SampleRowParams* params,
                  const kernels::LogitEdit* edits, int num_edits, int max_logprobs,
                  void* scratch, kernels::TokenLogprob* sampled,
                  kernels::TokenLogprob* top) override {
    if (Refused("SampleRows")) return;
    DeviceLikeBackend::SampleRows(logits, rows, vocab, params, edits, num_edits, max_logprobs,
                                  scratch, sampled, top);
  }

  void CopyRows(void* dst, size_t dst_stride, const void* src, size_t src_stride,
                size_t row_bytes, int rows) override {
    Queue([=, this] { inner().CopyRows(dst, dst_stride, src, src_stride, row_bytes, rows); });
  }
  void Linear(const void* x, DType x_dtype, int m, const kernels::PackedWeight& w,
              const float* bias, float* y) override {
    Queue([=, this, &w] { inner().Linear(x, x_dtype, m, w, bias, y); });
  }
  void RmsNorm(const float* x, const float* weight, float eps, int rows, int dim, void* y,
               DType y_dtype) override {
    Queue([=, this] { inner().RmsNorm(x, weight, eps, rows, dim, y, y_dtype); });
  }
  void AddRmsNorm(float* residual, const float* x, const float* weight, float eps, int rows,
                  int dim, void* y, DType y_dtype) override {
    Queue([=, this] { inner().AddRmsNorm(residual, x, weight, eps, rows, dim, y, y_dtype); });
  }
  void Rope(float* x, const int32_t* positions, int tokens, int heads, int head_dim,
            const float* inv_freq) override {
    Queue([=, this] { inner().Rope(x, positions, tokens, heads, head_dim, inv_freq); });
  }
  void SiluMul(const float* gate_up, int rows, int inter, void* out, DType out_dtype) override {
    Queue([=, this] { inner().SiluMul(gate_up, rows, inter, out, out_dtype); });
  }
  void Embedding(const void* table, DType table_dtype, const int32_t* ids, int tokens, int dim,
                 float* out) override {
    Queue([=, this] { inner().Embedding(table, table_dtype, ids, tokens, dim, out); });
  }
  void WriteKv(const float* k, const float* v, const int32_t* slot_mapping, int tokens,
               const kernels::KvLayout& layout, void* layer_cache) override {
    Queue([=, this] { inner().WriteKv(k, v, slot_mapping, tokens, layout, layer_cache); });
  }
  void AttentionInputs(const float* qkv, int tokens, int num_heads, const float* q_norm,
                       const float* k_norm, float eps, const int32_t* positions,
                       const float* inv_freq, const int32_t* slot_mapping,
                       const kernels::KvLayout& layout, void* layer_cache, float* q, float* k,
                       float* v) override {
    Queue([=, this] {
      inner().AttentionInputs(qkv, tokens, num_heads, q_norm, k_norm, eps, positions, inv_freq,
                              slot_mapping, layout, layer_cache, q, k, v);
    });
  }
  void PagedAttention(const float* q, const void* layer_cache, const kernels::KvLayout& layout,
                      const kernels::PagedAttentionBatch& batch, int num_heads, float scale,
                      void* out, DType out_dtype) override {
    if (recording_ != nullptr && !batch.on_device) {
      Refused("PagedAttention over a host batch");
      return;
    }
    Queue([=, this] {
      inner().PagedAttention(q, layer_cache, layout, batch, num_heads, scale, out, out_dtype);
    });
  }
  void GatherAdd(const float* a, const float* b, const int32_t* rows, int num_rows, int dim,
                 float* out) override {
    Queue([=, this] { inner().GatherAdd(a, b, rows, num_rows, dim, out); });
  }

 private:
  class Graph : public StepGraph {
   public:
    Graph(std::shared_ptr<std::vector<std::function<void()>>> ops, int* launches)
        : ops_(std::move(ops)), launches_(launches) {}
    absl::Status Launch() override {
      for (const auto& op : *ops_) op();
      ++*launches_;
      return absl::OkStatus();
    }

   private:
    std::shared_ptr<std::vector<std::function<void()>>> ops_;
    int* launches_;
  };

  // Runs `op` now, or records it during a capture.
  void Queue(std::function<void()> op) {
    if (recording_ != nullptr) {
      recording_->push_back(std::move(op));
    } else {
      op();
    }
  }
  // True (and the capture failed) when called during a capture.
  bool Refused(const std::string& what) {
    if (recording_ == nullptr) return false;
    if (refused_.ok()) refused_ = absl::FailedPreconditionError(what + " inside a capture");
    return true;
  }

  std::vector<std::function<void()>>* recording_ = nullptr;
  absl::Status refused_;
  int captures_ = 0;
  int launches_ = 0;
};

inline std::unique_ptr<GraphRecordingBackend> GraphRecording() {
  auto cpu = kernels::CreateCpuBackend({.num_threads = 1});
  EXPECT_TRUE(cpu.ok()) << cpu.status();
  return std::make_unique<GraphRecordingBackend>(std::move(cpu).value());
}

}  // namespace tandem::testing
