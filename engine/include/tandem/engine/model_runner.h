// Runs the decoder forward pass for one scheduled step over the paged KV cache.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/engine/checkpoint.h"
#include "tandem/engine/scheduler.h"
#include "tandem/kernels/backend.h"

namespace tandem::engine {

struct ModelRunnerOptions {
  int max_num_batched_tokens = 2048;
  int max_num_seqs = 64;
  int num_kv_blocks = 0;
  int block_size = 16;
};

// One contiguous byte range of a KV copy between two caches (offsets from each cache's start).
struct KvCopyRange {
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
  uint64_t bytes = 0;
};

// The byte ranges that copy the K and V of `src_blocks` (in a cache laid out as `src`) into
// `dst_blocks` (of `dst`), for every layer. Both caches must agree on block size, KV heads and
// head_dim; every block id is checked against its cache (InvalidArgument otherwise).
absl::StatusOr<std::vector<KvCopyRange>> KvBlockCopyRanges(const kernels::KvLayout& src,
                                                           const kernels::KvLayout& dst,
                                                           int num_layers,
                                                           const BlockTable& src_blocks,
                                                           const BlockTable& dst_blocks);

// Owns the weights (converted to fp32 and packed for the backend), the KV cache and every
// activation buffer, all sized up front so a step never allocates.
//   TANDEM_ASSIGN_OR_RETURN(auto runner, ModelRunner::Create(*ckpt, backend.get(), options));
//   TANDEM_ASSIGN_OR_RETURN(std::span<const float> logits, runner->Execute(step));
class ModelRunner {
 public:
  static absl::StatusOr<std::unique_ptr<ModelRunner>> Create(const Checkpoint& checkpoint,
                                                             kernels::Backend* backend,
                                                             const ModelRunnerOptions& options);
  ~ModelRunner();

  // Bytes of KV cache one block takes across all layers (fp32).
  static int64_t KvBytesPerBlock(const ModelConfig& config, int block_size);

  // Runs the step and returns logits [number of sampling sequences, vocab], one row per
  // sequence with `samples` set, in step order. The span is valid until the next call.
  absl::StatusOr<std::span<const float>> Execute(const SchedulerStep& step);

  // Called by Execute on its own thread as soon as layer `layer`'s K and V of every token of
  // the step are in the cache, before the next layer runs: lets a prefill worker push a
  // layer's pages while the later layers are still being computed. Empty: no call.
  void set_layer_written_hook(std::function<void(int layer)> hook) {
    layer_written_hook_ = std::move(hook);
  }

  const ModelConfig& config() const { return config_; }
  const kernels::KvLayout& kv_layout() const { return kv_layout_; }
  // The whole cache, [layers][2][num_blocks][block_size][num_kv_heads][head_dim], for
  // registration with a KV transfer agent.
  float* kv_cache() { return kv_cache_.get(); }
  size_t kv_cache_bytes() const {
    return static_cast<size_t>(config_.num_layers) * kv_layout_.LayerElements() * sizeof(float);
  }
  // One layer's cache: [2][num_blocks][block_size][num_kv_heads][head_dim].
  float* layer_cache(int layer) { return kv_cache_.get() + layer * kv_layout_.LayerElements(); }

 private:
  struct Layer;
  ModelRunner() = default;
  absl::Status LoadWeights(const Checkpoint& checkpoint);
  void CopyBlock(int32_t src, int32_t dst);

  ModelConfig config_;
  ModelRunnerOptions options_;
  std::function<void(int layer)> layer_written_hook_;
  kernels::Backend* backend_ = nullptr;  // not owned
  kernels::KvLayout kv_layout_;
  std::vector<float> inv_freq_;  // [head_dim / 2]

  std::vector<float> embed_;  // [vocab, hidden]
  std::vector<std::unique_ptr<Layer>> layers_;
  std::vector<float> final_norm_;  // [hidden]
  std::unique_ptr<kernels::PackedWeight> lm_head_;

  // [layers][2][num_blocks][block_size][kv_heads][head_dim]. Left uninitialised: a slot is
  // read only after its token was written, and untouched pages cost no memory.
  std::unique_ptr<float[]> kv_cache_;

  // Step inputs (host) and activations, sized for max_num_batched_tokens.
  std::vector<int32_t> token_ids_, positions_, slots_, query_start_, context_len_, block_table_,
      sample_rows_;
  std::vector<float> residual_, hidden_, qkv_, q_, k_, v_, attn_, proj_, gate_up_, act_,
      sampled_hidden_, logits_;
};

}  // namespace tandem::engine
