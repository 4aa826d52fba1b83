// Runs the decoder forward pass for one scheduled step over the paged KV cache.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/collective/communicator.h"
#include "tandem/engine/checkpoint.h"
#include "tandem/engine/kv_cache_layout.h"
#include "tandem/engine/scheduler.h"
#include "tandem/engine/tensor_parallel.h"
#include "tandem/kernels/backend.h"

namespace tandem::engine {

struct ModelRunnerOptions {
  int max_num_batched_tokens = 2048;
  int max_num_seqs = 64;
  int num_kv_blocks = 0;
  int block_size = 16;
  // Element type the projection weights are held in (kF32, kBF16, kF16); unset: the
  // checkpoint's torch_dtype (`--dtype auto`).
  std::optional<DType> weight_dtype;
  // Element type of the KV cache; unset: the weight dtype (`--kv-cache-dtype auto`).
  std::optional<DType> kv_cache_dtype;
  // Logit rows a sequence can ask for in one step: 1, or 1 + the most draft tokens a
  // speculative step verifies.
  int max_logit_rows_per_seq = 1;
  // The tensor-parallel group this runner is one rank of (not owned; must outlive the runner);
  // null: the whole model on this runner. Rank 0 (the leader) is driven by Execute and sends
  // each step's plan to the others, which run RunFollower. A follower takes every other field
  // of these options from the leader, so the shards agree on blocks, sizes and dtypes.
  collective::Communicator* tensor_parallel = nullptr;
  // The communicator that carries the activations of a tensor-parallel step (the row-parallel
  // all-reduces and the all-gather of the vocabulary-parallel logits) in backend memory: the
  // same ranks as `tensor_parallel`, not owned, must outlive the runner. A backend whose memory
  // is not host memory needs one (NCCL on the CUDA backend's stream); `tensor_parallel` then
  // carries only the step plans, attachments and reports, which are host memory. Null: the
  // activations go over `tensor_parallel` too (the CPU backend over Gloo).
  collective::Communicator* device_collective = nullptr;
  // Whether Execute may draw the tokens in the backend (set_backend_sampling); sizes its
  // buffers for max_sample_edits logit edits a step.
  bool backend_sampling = false;
  int max_sample_edits = 1 << 18;
  // Decode steps through captured step graphs (Backend::CaptureGraph, CUDA graphs): a step in
  // which every sequence decodes one token, or verifies draft tokens (its last token and the
  // drafts, each yielding logits), is padded to the smallest of these token counts that holds
  // it and replays that size's graph, one launch instead of a few per layer. A graph is
  // captured per batch size and context bound (the longest context rounded up to a power of
  // two of at least 16 blocks) the first time a step needs it (that step runs eagerly, with
  // the graph's arguments, then is captured). Empty: every step eager; so are
  // sizes above max_num_batched_tokens or the logit rows a step can have, tensor-parallel
  // runners, runners with a layer-written hook, and backends without graphs (CaptureGraph
  // Unimplemented).
  std::vector<int> graph_batch_sizes{};
  // The most blocks a sequence holds, the width of a graph step's block table (the longest
  // context a graph serves is this times block_size; longer steps run eagerly); 0: num_kv_blocks.
  int max_blocks_per_seq = 0;
};

// The dtypes a runner of `options` over a checkpoint of `config` holds its weights and KV cache
// in, or InvalidArgument for a type that cannot hold them (an 8-bit weight type).
struct RunnerDTypes {
  DType weights = DType::kF32;
  DType kv_cache = DType::kF32;
};
absl::StatusOr<RunnerDTypes> ResolveRunnerDTypes(const text::ModelConfig& config,
                                                 std::optional<DType> weight_dtype,
                                                 std::optional<DType> kv_cache_dtype);

// Owns the weights (packed for the backend in their dtype), the KV cache and every
// activation buffer, all in the backend's memory (host memory on the CPU backend, device memory
// on CUDA) and sized up front so a step never allocates. A step is planned on the host (token
// ids, positions, KV slots, sampled rows), uploaded in one copy, and run; only the logits of
// the sampling rows come back.
//   TANDEM_ASSIGN_OR_RETURN(auto runner, ModelRunner::Create(*ckpt, backend.get(), options));
//   TANDEM_ASSIGN_OR_RETURN(std::span<const float> logits, runner->Execute(step));
class ModelRunner {
 public:
  // `backend` is not owned and must outlive the runner.
  static absl::StatusOr<std::unique_ptr<ModelRunner>> Create(const Checkpoint& checkpoint,
                                                             kernels::Backend* backend,
                                                             const ModelRunnerOptions& options);
  ~ModelRunner();

  // Bytes of KV cache one block takes across all layers, in a cache of `kv_dtype` holding the
  // KV heads of one rank of a tensor-parallel group of `tp_size`.
  static int64_t KvBytesPerBlock(const text::ModelConfig& config, int block_size,
                                 DType kv_dtype = DType::kF32, int tp_size = 1);

  // Runs the step and returns logits [rows, vocab] in step order (host memory): for each
  // sequence with `samples` set, 1 + num_draft_tokens rows, its last real token's and then each
  // draft token's (the distributions that verify draft tokens 0.. and the one after them). The span
  // is valid until the next call. When it returns, the step's K and V are in the cache (the device
  // has finished).
  // With a tensor-parallel group, only the leader (rank 0) calls it; the plan goes to every
  // follower first.
  absl::StatusOr<std::span<const float>> Execute(const SchedulerStep& step);
  // Sampling in the backend (Backend::SampleRows; ModelRunnerOptions::backend_sampling): the
  // next Execute draws one token from each of its logit rows by rows[i] (one per logit row, in
  // step order) and `edits`; the tokens are then in backend_samples(), with
  // top[i * kMaxSampleLogprobs ...] row i's most likely tokens. Instead of all the logits,
  // Execute returns only those of the rows `host_rows` names (ascending), [host_rows.size(),
  // vocab] in that order: rows the host samples itself (give them a greedy row without
  // log-probabilities or edits, which leaves their logits as they are). The spans are copied;
  // at most max_sample_edits() edits.
  void set_backend_sampling(std::span<const kernels::SampleRowParams> rows,
                            std::span<const kernels::LogitEdit> edits,
                            std::span<const int32_t> host_rows = {});
  struct BackendSamples {
    std::span<const kernels::TokenLogprob> tokens;  // [rows]
    std::span<const kernels::TokenLogprob> top;     // [rows, kernels::kMaxSampleLogprobs]
  };
  // What the last Execute drew in the backend; valid until the next call of any pass.
  BackendSamples backend_samples() const;
  int max_sample_edits() const {
    return options_.backend_sampling ? options_.max_sample_edits : 0;
  }

  // Step graphs (ModelRunnerOptions::graph_batch_sizes): the step shapes (batch size and
  // context bound) captured so far, and the steps that replayed one.
  int graphs_captured() const { return graphs_captured_; }
  int64_t graph_replays() const { return graph_replays_; }

  // The final hidden states (after the model's final norm, before the LM head) of the last
  // Execute's logit rows, [rows, hidden_size] in the same order, in host memory: what an
  // embedding request pools. Valid until the next call of any pass; copied back from the
  // device only when asked for.
  absl::StatusOr<std::span<const float>> FinalHidden();

  // A draft pass over a step planned with draft tokens (early exit on the target's runner, or a
  // draft model's own runner, whose cache the engine caught up first): for each
  // sequence with more than `offset` draft tokens, runs one token (its last real token when
  // `offset` is 0, else draft token offset - 1, at the position after the last) through the
  // first `num_layers` layers, the final norm and the LM head, and returns one logit row per
  // such sequence, in step order. It writes those layers' KV of that token into the step's own
  // slots and attends over the KV the target computed before, so the draft needs no cache or
  // prefill of its own; Execute then recomputes every layer of those slots. Not with a
  // tensor-parallel group (speculation is refused there).
  // `block_copies` are done first: the step's on the first pass of a step (for early exit,
  // Execute copies them again before the target pass, which rewrites every slot of the step
  // before reading it, so the second copy changes nothing the target reads), none after.
  absl::StatusOr<std::span<const float>> ExecuteDraft(
      const SchedulerStep& step, int offset, int num_layers,
      const std::vector<std::pair<int32_t, int32_t>>& block_copies);

  // A pass over chosen positions of sequences, for the speculative drafts: each run feeds its
  // sequence's tokens at positions [begin, end) (past seq->tokens, its draft_tokens), writes
  // their KV into the sequence's blocks of this runner's cache and attends over what the cache
  // holds before them, through the first `num_layers` layers; runs with `sample` set return the
  // logits of their last position, one row each in run order. `block_copies` are done first.
  // Not with a tensor-parallel group.
  struct TokenRun {
    const Sequence* seq = nullptr;
    int begin = 0;
    int end = 0;
    bool sample = false;
  };
  absl::StatusOr<std::span<const float>> ExecuteRuns(
      std::span<const TokenRun> runs, int num_layers,
      const std::vector<std::pair<int32_t, int32_t>>& block_copies);
  // Copy-on-write block copies {src, dst} of a step this runner did not run (a draft model's
  // cache follows the target's block tables).
  void CopyBlocks(const std::vector<std::pair<int32_t, int32_t>>& block_copies) {
    for (const auto& [src, dst] : block_copies) CopyBlock(src, dst);
  }
  int max_num_batched_tokens() const { return options_.max_num_batched_tokens; }
  int max_num_seqs() const { return options_.max_num_seqs; }

  // On a follower rank of a tensor-parallel group: runs the steps the leader sends until the
  // leader's runner is destroyed (OK) or the group fails (the communicator's error: a rank
  // died, or a collective timed out). Waits for the next step for as long as the leader idles.
  absl::Status RunFollower();

  // This runner's slice of the model (rank 0 of 1 without tensor parallelism).
  const TensorParallelShard& shard() const { return shard_; }

  // The side channel of a tensor-parallel step, for work each rank does on its own shard
  // during the step (a prefill worker's ranks each push their KV heads' pages). On the leader,
  // `set_step_attachment` hands bytes to the next Execute, which sends them to every follower
  // with the step's plan; after a step that carried bytes, each follower answers with a report
  // (at most kMaxStepReportBytes, longer ones are cut), which the leader reads from
  // step_reports() until the next such step. A follower's `begin` hook gets the bytes before
  // the step runs (its layer-written hook is called during it), its `end` hook returns the
  // report once the forward pass is done.
  static constexpr size_t kMaxStepReportBytes = 4096;
  void set_step_attachment(std::string bytes) { step_attachment_ = std::move(bytes); }
  // Follower rank r's report at [r - 1].
  const std::vector<std::string>& step_reports() const { return step_reports_; }
  struct FollowerStepHooks {
    std::function<void(std::string_view attachment)> begin;
    std::function<std::string()> end;
  };
  void set_follower_step_hooks(FollowerStepHooks hooks) { follower_hooks_ = std::move(hooks); }
  // Leader, between steps: sends `bytes` (not empty) to every follower with no step, whose
  // `begin` and then `end` hooks run at once, and returns their reports (rank r's at [r - 1]).
  // For work on the followers' caches outside a step (a draining decode worker's KV handoff).
  absl::StatusOr<std::vector<std::string>> SideChannel(std::string bytes);

  // Called by Execute on its own thread as soon as layer `layer`'s K and V of every token of
  // the step are in the cache, before the next layer runs: lets a prefill worker push a
  // layer's pages while the later layers are still being computed. On a device backend Execute
  // waits for the layer's writes to finish before the call. Empty: no call.
  void set_layer_written_hook(std::function<void(int layer)> hook) {
    layer_written_hook_ = std::move(hook);
  }

  const text::ModelConfig& config() const { return config_; }
  const kernels::KvLayout& kv_layout() const { return kv_layout_; }
  // Every byte offset of the cache (kv_cache()).
  const KvCacheLayout& cache_layout() const { return cache_layout_; }
  // The element type of the projection weights and the embedding table.
  DType weight_dtype() const { return weight_dtype_; }
  // The whole cache, [layers][2][num_blocks][block_size][num_kv_heads][head_dim] of
  // cache_layout().dtype, for registration with a KV transfer agent. Backend memory: device
  // memory unless kv_cache_on_host().
  void* kv_cache() { return kv_cache_.data(); }
  size_t kv_cache_bytes() const { return cache_layout_.total_bytes(); }
  // Whether kv_cache() is host memory (the CPU backend), which host-memory transports (the
  // "local" and "ucx" kvtransfer backends) can send; device memory needs "cuda_ipc".
  bool kv_cache_on_host() const { return backend_->host_memory(); }
  // One layer's cache: [2][num_blocks][block_size][num_kv_heads][head_dim].
  void* layer_cache(int layer) {
    return kv_cache_.as<unsigned char>() + cache_layout_.Offset(layer, 0, 0);
  }
  // Layer `layer`'s view for the kernels, its 8-bit scales included.
  const kernels::KvLayout& layer_kv_layout(int layer) const { return layer_kv_layouts_[layer]; }

 private:
  struct Layer;
  ModelRunner() = default;
  absl::Status LoadWeights(const Checkpoint& checkpoint, DType weight_dtype);
  // Sends (leader) or receives (follower) a step plan; see model_runner.cc.
  absl::Status SendPlan(int tokens, int num_seqs, int num_sampled, int max_blocks,
                        const std::vector<std::pair<int32_t, int32_t>>& block_copies,
                        const std::string& attachment);
  // After a step with an attachment: every rank's report (`mine`) gathered; the leader keeps
  // the followers'.
  absl::Status ExchangeStepReports(std::string mine);
  // Follower: receives an attachment of `bytes` and runs the begin hook on it; after the step,
  // the end hook's report to rank 0.
  absl::Status FollowerReceiveAttachment(int32_t bytes);
  absl::Status FollowerReport();
  bool tensor_parallel() const { return comm_ != nullptr && comm_->size() > 1; }
  // The communicator of the activations: the device one, else the host one.
  collective::Communicator& activations_comm() const {
    return device_comm_ != nullptr ? *device_comm_ : *comm_;
  }
  // Backend memory holding `values` (an empty buffer for an empty vector).
  absl::StatusOr<kernels::DeviceBuffer> Upload(const std::vector<float>& values);
  void CopyBlock(int32_t src, int32_t dst);
  // Runs the step planned in planned_ints_, query_start_, context_len_ and block_table_ (on
  // every rank of a tensor-parallel group alike), after its block copies, through the first
  // `num_layers` layers and returns the logits of its `num_sampled` sample rows (on the leader);
  // with `sample_in_backend`, draws their tokens by sample_rows_ instead (backend_samples) and
  // returns no logits.
  absl::StatusOr<std::span<const float>> Forward(
      int tokens, int num_seqs, int max_blocks, int num_sampled, int num_layers, bool layer_hook,
      const std::vector<std::pair<int32_t, int32_t>>& block_copies,
      bool sample_in_backend = false);
  // One pass's operators, from the embedding to the logits of its sample rows: the metadata in
  // backend memory, the attention batch as the backend takes it.
  struct StepArgs {
    int tokens = 0;
    int num_sampled = 0;
    int num_layers = 0;
    bool layer_hook = false;
    const int32_t* token_ids = nullptr;
    const int32_t* positions = nullptr;
    const int32_t* slots = nullptr;
    const int32_t* sample_rows = nullptr;
    kernels::PagedAttentionBatch batch{};
  };
  absl::Status QueueModel(const StepArgs& args);
  // After QueueModel: draws the tokens of the first num_sampled rows in the backend, or copies
  // their logits back, and waits for the step.
  absl::StatusOr<std::span<const float>> FinishStep(int num_sampled, bool sample_in_backend);
  // Token ids, positions and KV slots of `seq`'s positions [begin, end) (past seq.tokens, its
  // draft_tokens), at [0, end - begin) of each array.
  void PlanTokens(const Sequence& seq, int begin, int end, int32_t* token_ids,
                  int32_t* positions, int32_t* slots) const;
  // The batch size whose step graph runs `step`, or 0 when it runs eagerly.
  int GraphBatchSize(const SchedulerStep& step) const;
  // Runs `step` (GraphBatchSize `padded`) through its size's step graph, padded with tokens that
  // write no KV: planned into graph_ints_, replayed, or run eagerly and captured on first use.
  absl::StatusOr<std::span<const float>> ExecuteGraphStep(const SchedulerStep& step, int padded,
                                                          bool sample_in_backend);
  // The arguments of a graph step of `padded` rows over contexts of at most `context_blocks`
  // blocks, all in graph_ints_.
  StepArgs GraphStepArgs(int padded, int context_blocks) const;

  text::ModelConfig config_;
  ModelRunnerOptions options_;
  std::function<void(int layer)> layer_written_hook_;
  std::string step_attachment_;             // leader: for the next Execute
  std::vector<std::string> step_reports_;   // leader: the followers' of the last such step
  FollowerStepHooks follower_hooks_;
  kernels::Backend* backend_ = nullptr;  // not owned
  collective::Communicator* comm_ = nullptr;  // not owned; null without tensor parallelism
  // Not owned; null unless tensor parallel with ModelRunnerOptions::device_collective.
  collective::Communicator* device_comm_ = nullptr;
  TensorParallelShard shard_;
  std::vector<int32_t> plan_;  // a step plan as sent between ranks
  KvCacheLayout cache_layout_;
  kernels::KvLayout kv_layout_;                      // cache_layout_.kernel_layout()
  std::vector<kernels::KvLayout> layer_kv_layouts_;  // kv_layout_ with each layer's scales

  // Weights, in backend memory unless packed. Matrices and the embedding table hold
  // weight_dtype_ elements; norms, biases and inv_freq fp32.
  DType weight_dtype_ = DType::kF32;
  kernels::DeviceBuffer inv_freq_;  // [head_dim / 2]
  kernels::DeviceBuffer embed_;     // [vocab, hidden] of weight_dtype_
  std::vector<std::unique_ptr<Layer>> layers_;
  kernels::DeviceBuffer final_norm_;  // [hidden]
  std::unique_ptr<kernels::PackedWeight> lm_head_;

  // [layers][2][num_blocks][block_size][kv_heads][head_dim]. Left uninitialised: a slot is
  // read only after its token was written, and untouched host pages cost no memory.
  kernels::DeviceBuffer kv_cache_;

  // The step's per-token metadata in backend memory, packed for one upload:
  // [token_ids (tokens)][positions (tokens)][slots (tokens)][sample_rows (sampled)].
  // Capacity 3 * max_num_batched_tokens + max_logit_rows_.
  kernels::DeviceBuffer step_ints_;
  // Where a step is planned: step_ints_ itself when backend memory is host memory (no copy),
  // otherwise host_step_ints_, uploaded into step_ints_.
  int32_t* planned_ints_ = nullptr;
  std::vector<int32_t> host_step_ints_;
  // PagedAttentionBatch arrays, host memory as the Backend interface takes them.
  std::vector<int32_t> query_start_, context_len_, block_table_;
  // Logit rows one step can return: min(max_num_seqs x max_logit_rows_per_seq, tokens).
  int max_logit_rows_ = 0;

  // Activations in backend memory, sized for max_num_batched_tokens (sampled_hidden_ and logits_
  // for the most sequences a step can have).
  kernels::DeviceBuffer residual_, hidden_, qkv_, q_, k_, v_, attn_, proj_, gate_up_, act_,
      sampled_hidden_, logits_;
  // The logits copied back, when backend memory is not host memory (page-locked for the CUDA
  // backend: the largest copy of a step, 0.5 MB a row at a 128k vocabulary).
  kernels::DeviceBuffer host_logits_;
  // Rows of sampled_hidden_ the last pass filled, and their copy back (FinalHidden) when
  // backend memory is not host memory.
  int last_sampled_rows_ = 0;
  std::vector<float> host_hidden_;
  // Tensor parallelism: this rank's vocabulary slice of the logits [sampled, vocab_stride], and
  // every rank's, all-gathered over activations_comm() [ranks][sampled][vocab_stride], both in
  // backend memory.
  kernels::DeviceBuffer local_logits_, gathered_logits_;
  // Backend sampling: the next Execute's rows and edits (host memory, set_backend_sampling),
  // SampleRows' scratch and results in backend memory, and (backend memory not host memory)
  // their copy back: [max_logit_rows_] tokens, then [max_logit_rows_, kMaxSampleLogprobs] top.
  std::vector<kernels::SampleRowParams> sample_rows_;
  std::vector<kernels::LogitEdit> sample_edits_;
  std::vector<int32_t> sample_host_rows_;  // rows whose logits still come back
  std::vector<float> host_row_logits_;     // their copy, when backend memory is host memory
  bool sample_pending_ = false;
  kernels::DeviceBuffer sample_scratch_, sampled_, host_sampled_;
  int last_backend_rows_ = 0;

  // Step graphs: the batch sizes (ascending), the block table width, the graph of each batch
  // size and context bound in blocks (a power of two of at least kGraphMinContextBlocks, or the
  // table width; the attention's grid is sized for the bound, so a bound far past the step's
  // contexts would launch mostly idle blocks), null after a failed capture (that step shape
  // runs eagerly), and a graph step's metadata in backend
  // memory, laid out for `padded` rows as [token_ids][positions][slots][sample_rows] (padded
  // each), [query_start (padded + 1)][context_len (padded)][block_table (padded x
  // graph_table_width_)], planned on the host in graph_planned_ (graph_ints_ itself when backend
  // memory is host memory).
  std::vector<int> graph_sizes_;
  int graph_table_width_ = 0;
  static constexpr int kGraphMinContextBlocks = 16;
  std::map<std::pair<int, int>, std::unique_ptr<kernels::Backend::StepGraph>> graphs_;
  kernels::DeviceBuffer graph_ints_;
  int32_t* graph_planned_ = nullptr;
  std::vector<int32_t> host_graph_ints_;
  int graphs_captured_ = 0;
  int64_t graph_replays_ = 0;
};

}  // namespace tandem::engine
