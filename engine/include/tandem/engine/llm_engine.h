// One engine instance: checkpoint, tokenizer, KV cache, scheduler, runner and sampler.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/engine/block_manager.h"
#include "tandem/text/chat_template.h"
#include "tandem/engine/checkpoint.h"
#include "tandem/engine/model_runner.h"
#include "tandem/engine/sampler.h"
#include "tandem/engine/sampling_params.h"
#include "tandem/engine/scheduler.h"
#include "tandem/engine/step_latency_model.h"
#include "tandem/engine/step_telemetry.h"
#include "tandem/engine/step_trace.h"
#include "tandem/text/tokenizer.h"
#include "tandem/kernels/backend.h"

namespace tandem::engine {
namespace internal {
class DisaggRole;
}  // namespace internal

// Tokens [begin, end) of one sample whose K and V a step has just written in one layer; see
// EngineOptions::on_layer_kv_written. `blocks` is the sample's block table (valid during the
// call only).
struct KvWritten {
  std::string_view request_id;
  int choice_index = 0;
  int begin = 0;
  int end = 0;
  const BlockTable* blocks = nullptr;
};

// Where an engine runs its model: the CPU backend, or the CUDA backend on GPU 0 (fp32 weights,
// activations and KV cache in device memory; docs/architecture.md).
enum class Device { kCpu, kCuda };

struct EngineOptions {
  std::string model_dir;
  Device device = Device::kCpu;
  int num_threads = 0;                   // 0: one per core
  int64_t kv_cache_bytes = 512ll << 20;  // KV capacity is derived from this budget
  int block_size = 16;
  int max_num_seqs = 64;
  int max_num_batched_tokens = 512;  // also the prefill chunk size
  int max_model_len = 0;             // 0: max_position_embeddings of the model
  EngineRole role = EngineRole::kColocated;
  // SLO controllers (docs/architecture.md, "SLO-driven batch sizing"); 0 turns one off. With a
  // TPOT target, each step runs at most as many sequences as the step latency model predicts
  // fit in 0.9 x the target (decode and colocated roles). With a TTFT target, each step takes
  // at most as many tokens as the model predicts fit in a quarter of the target (prefill and
  // colocated roles), so a request arriving mid-step waits at most that for its first chunk.
  double tpot_slo_seconds = 0;
  double ttft_slo_seconds = 0;
  // Admission order of waiting requests.
  QueuePolicy queue_policy = QueuePolicy::kFcfs;
  // Called on the engine thread, inside Step(), once per layer as soon as that layer's KV of
  // the step's tokens is in the cache (the later layers are not yet computed). A prefill worker
  // pushes those pages to the decode worker from here, overlapping transfer with compute. Must
  // not call back into the engine.
  std::function<void(int layer, std::span<const KvWritten> written)> on_layer_kv_written;
  // When set, every step and every request's first-token latency are written to it (see
  // step_trace.h); several engines may share one trace.
  std::shared_ptr<StepTrace> step_trace;
  // Called on the engine thread at the start of every Step() that has work, before the step is
  // scheduled; when it returns false the step is skipped (Step() returns only outputs already
  // pending, and the engine's state is unchanged). Tests pause the engine here
  // (tests/engine/step_gate.h) to catch a request in the middle of its work on purpose, while
  // the owner's loop goes on taking commands; `--step-delay-ms` sleeps here (fault injection:
  // a slower device).
  std::function<bool()> before_step;
};

struct GenerateRequest {
  std::string request_id;
  std::vector<int32_t> prompt_tokens;
  SamplingParams params;
  // When the request reached the engine's owner (AsyncEngine::Submit, a worker's RPC), for the
  // step trace's first-token time, which then includes the wait for the step running at that
  // moment; unset (the epoch): when AddRequest took it.
  std::chrono::steady_clock::time_point arrival{};
};

// What one of a request's samples produced since the previous Step().
struct ChoiceDelta {
  int index = 0;
  std::vector<int32_t> token_ids;
  // Text that is final: complete UTF-8, never part of a stop string. It can lag the tokens.
  std::string text;
  std::vector<float> logprobs;                          // per token, when requested
  std::vector<std::vector<TokenLogprob>> top_logprobs;  // per token, when logprobs > 0
  FinishReason finish_reason = FinishReason::kNone;
};

struct RequestOutput {
  std::string request_id;
  std::vector<ChoiceDelta> choices;  // only choices that progressed
  bool finished = false;             // every choice has finished
  int num_prompt_tokens = 0;
  int num_generation_tokens = 0;  // over all choices, so far
};

// A sequence whose prompt a prefill-role engine has computed, ready to continue on a decode
// engine: its first token, the sampler stream, and the blocks holding its prompt KV (valid
// until LlmEngine::ReleaseHandoff).
struct PrefillHandoff {
  std::string request_id;
  int choice_index = 0;
  int32_t first_token = 0;
  float first_logprob = 0.0f;
  std::vector<TokenLogprob> first_top_logprobs;
  std::array<uint64_t, 4> rng_state{};
  BlockTable blocks;  // prefill engine's blocks: KV of the prompt tokens
};

// What a decode-role engine needs of one sample to continue it (see AddPrefilled).
struct PrefilledChoice {
  int32_t first_token = 0;
  float first_logprob = 0.0f;
  std::vector<TokenLogprob> first_top_logprobs;
  std::array<uint64_t, 4> rng_state{};
  BlockTable blocks;  // this engine's reserved blocks, now holding the prompt KV
  // A continuation of a sample another decode engine parked (Park): every token it generated
  // so far (first_token is then not used), and how many tokens of prompt + generated have their
  // KV in `blocks` (at least one, fewer than all). The sample goes on from the next token.
  std::vector<int32_t> generated;
  int num_kv_tokens = 0;
};

// An unfinished sample taken out of a decode engine with its KV (LlmEngine::Park), in the form
// AddPrefilled takes to continue it: `state.generated`, `state.num_kv_tokens`,
// `state.rng_state` and `state.blocks` (now the caller's: free them with FreeReservation).
// num_kv_tokens is 0 and blocks empty when the sample had been preempted (no KV to move).
struct ParkedSample {
  int choice_index = 0;
  PrefilledChoice state;
};

struct EngineStats {
  int running = 0;
  int waiting = 0;
  int kv_blocks_total = 0;
  int kv_blocks_used = 0;
  int64_t preemptions = 0;
  // The batch cap (max_num_seqs unless the TPOT controller lowered it; sequences that already
  // run keep running above it, new ones wait) and the token budget of a step
  // (max_num_batched_tokens unless the TTFT controller lowered it).
  int batch_limit = 0;
  int token_budget = 0;
  // Steps run, and the last one's measured time (Schedule through sampling) and its prediction
  // made before it ran (0 while the latency model is not ready).
  int64_t steps = 0;
  double last_step_seconds = 0;
  double last_predicted_step_seconds = 0;
  // Recent mean time between one step's end and the next one's start while work was pending
  // (the caller's loop: streaming, RPCs); the TPOT controller leaves it out of the step budget.
  double step_gap_seconds = 0;
  // The step latency model: coefficients (indexed by StepLatencyModel::Term), observations, and
  // recent mean |predicted - measured| / measured.
  StepCoefficients step_model;
  int64_t step_model_samples = 0;
  double step_model_error_ratio = 0;
};

// Single-threaded: one caller drives AddRequest / Abort / Step.
//   TANDEM_ASSIGN_OR_RETURN(auto engine, LlmEngine::Create({.model_dir = dir}));
//   TANDEM_RETURN_IF_ERROR(engine->AddRequest({"r1", engine->tokenizer().Encode("Hi", true), {}}));
//   while (engine->has_unfinished()) for (auto& out : engine->Step().value()) { ... }
class LlmEngine {
 public:
  static absl::StatusOr<std::unique_ptr<LlmEngine>> Create(const EngineOptions& options);
  ~LlmEngine();

  // Refuses (InvalidArgument, naming the field) an empty prompt, a token id outside the
  // vocabulary, bad sampling parameters, a prompt that with max_tokens overruns the context
  // length, or one that could never fit in the KV cache; AlreadyExists for a duplicate id.
  absl::Status AddRequest(GenerateRequest request);
  // The checks of AddRequest that do not depend on engine state; safe from any thread.
  absl::Status Validate(const GenerateRequest& request) const;
  // Ends a request at once and frees its KV blocks; unknown ids are ignored.
  void Abort(const std::string& request_id);
  // Runs one scheduler step and returns what each progressed request produced.
  absl::StatusOr<std::vector<RequestOutput>> Step();
  bool has_unfinished() const;

  // --- prefill role ---
  // Hand-offs of the samples that finished their prefill since the last call. Their blocks
  // stay allocated until ReleaseHandoff.
  std::vector<PrefillHandoff> TakeHandoffs();
  // Frees the blocks of a hand-off once its KV has been copied (or the request was cancelled).
  void ReleaseHandoff(const PrefillHandoff& handoff);

  // --- decode role ---
  // Allocates blocks for the prompt KV of a request about to be prefilled elsewhere.
  absl::StatusOr<BlockTable> ReserveBlocks(int num_tokens);
  // Returns reserved blocks that will not be used (e.g. the prefill failed).
  void FreeReservation(BlockTable& blocks);
  // Continues `request` (its prompt and params, n == choices.size()) from prefilled samples
  // whose KV is already in their reserved blocks. The first tokens appear in the next Step().
  // A choice with `generated` set continues a parked sample instead (see PrefilledChoice): its
  // sequence is prompt + generated, the detokenizer and held-back text are rebuilt from them
  // without being emitted, and it first appears in Step() with its next new token.
  absl::Status AddPrefilled(GenerateRequest request, std::vector<PrefilledChoice> choices);
  // Takes a running request out of the engine without freeing the KV of its unfinished
  // samples, which are returned (finished samples are not). Nothing of it is emitted any more.
  // NotFound for an unknown request; FailedPrecondition while first tokens of AddPrefilled are
  // still to be returned by Step() (call it right after a Step()).
  absl::StatusOr<std::vector<ParkedSample>> Park(const std::string& request_id);

  // The KV cache, for registration with a transfer agent.
  // Device memory with Device::kCuda (kv_cache_on_host() false): only a CUDA-aware transfer
  // backend ("cuda_ipc") can send it.
  float* kv_cache() { return runner_->kv_cache(); }
  bool kv_cache_on_host() const { return runner_->kv_cache_on_host(); }
  size_t kv_cache_bytes() const { return runner_->kv_cache_bytes(); }
  const kernels::KvLayout& kv_layout() const { return runner_->kv_layout(); }
  // Every byte offset of kv_cache() (what KV transfers and handoffs address).
  const KvCacheLayout& cache_layout() const { return runner_->cache_layout(); }

  const text::ModelConfig& config() const { return checkpoint_->config(); }
  const text::Tokenizer& tokenizer() const { return *tokenizer_; }
  const text::ChatFormatter& chat_formatter() const { return *chat_formatter_; }
  int max_model_len() const { return max_model_len_; }
  EngineStats stats() const;
  const StepLatencyModel& step_latency_model() const { return telemetry_.latency_model(); }

 private:
  struct Choice;
  struct Request;
  LlmEngine() = default;
  // A request of n choices, each a sequence holding the prompt, with its detokenizer; the
  // caller sets what differs (random stream, prefilled state). Moves request.params.
  std::unique_ptr<Request> NewRequest(GenerateRequest& request);
  // Applies one sampled token to a choice: stop checks, detokenization, delta.
  void ProcessToken(Request& request, Choice& choice, int32_t token, ChoiceDelta& delta);
  void FinishChoice(Choice& choice, FinishReason reason, ChoiceDelta& delta);
  // The one point where KV blocks change hands: the choice's sequence leaves the scheduler with
  // its blocks kept (finish reason kPrefilled), and they are returned, now the caller's. Used by
  // a prefill hand-off and by Park.
  BlockTable HandOver(Choice& choice);
  // Moves the part of `choice.held` that can no longer begin a stop string into `text`.
  void ReleaseHeld(const Request& request, Choice& choice, std::string& text);
  // Sets the scheduler's dynamic limits from the SLO targets and the latency model.
  void ApplySloLimits();
  // The stages of Step(): plan the step, run the forward pass (and commit the KV), sample and
  // process each sampling sequence's token into `outputs`, mark finished requests.
  absl::StatusOr<SchedulerStep> ScheduleStep();
  absl::StatusOr<std::span<const float>> ExecuteStep(const SchedulerStep& step);
  void SampleStep(const SchedulerStep& step, std::span<const float> logits,
                  std::vector<RequestOutput>& outputs);
  void FinishOutputs(std::vector<RequestOutput>& outputs);

  EngineOptions options_;
  std::unique_ptr<Checkpoint> checkpoint_;
  std::unique_ptr<text::Tokenizer> tokenizer_;
  std::unique_ptr<text::ChatFormatter> chat_formatter_;
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<BlockManager> blocks_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<ModelRunner> runner_;
  std::unique_ptr<Sampler> sampler_;
  int max_model_len_ = 0;
  int64_t next_seq_id_ = 0;
  std::map<std::string, std::unique_ptr<Request>> requests_;
  // What the role (prefill, decode, colocated) changes: hand-offs held, first tokens of
  // prefilled requests, which SLO controller runs.
  std::unique_ptr<internal::DisaggRole> role_;
  std::vector<KvWritten> step_writes_;          // of the running step, for on_layer_kv_written
  int decode_batch_limit_ = 0;  // the TPOT controller's cap; 0 without one
  StepTelemetry telemetry_{nullptr, "colocated"};  // set up by Create
};

// The checks of a request that need only the model (so a router without an engine makes them
// too): sampling fields, token ids inside the vocabulary, a non-empty prompt, and prompt plus
// max_tokens within max_model_len. InvalidArgument naming the field otherwise.
absl::Status ValidateRequest(const GenerateRequest& request, const text::ModelConfig& config,
                             int max_model_len);

// Appends one step's delta of a choice to what that choice produced so far.
void AccumulateDelta(ChoiceDelta& total, const ChoiceDelta& delta);

// Runs `requests` to completion on `engine` and returns, per request in order, the final
// output of each choice (all tokens, all text). For offline use and tests.
absl::StatusOr<std::vector<RequestOutput>> GenerateAll(LlmEngine& engine,
                                                       std::vector<GenerateRequest> requests);

}  // namespace tandem::engine
