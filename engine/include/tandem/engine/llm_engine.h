// One engine instance: checkpoint, tokenizer, KV cache, scheduler, runner and sampler.
#pragma once

#include <array>
#include <chrono>
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
#include "tandem/engine/block_manager.h"
#include "tandem/engine/checkpoint.h"
#include "tandem/engine/handoff.h"
#include "tandem/engine/model_runner.h"
#include "tandem/engine/request.h"
#include "tandem/engine/sampler.h"
#include "tandem/engine/sampling_params.h"
#include "tandem/engine/scheduler.h"
#include "tandem/engine/speculative.h"
#include "tandem/engine/step_latency_model.h"
#include "tandem/engine/step_telemetry.h"
#include "tandem/engine/step_trace.h"
#include "tandem/grammar/matcher.h"
#include "tandem/kernels/backend.h"
#include "tandem/text/chat_template.h"
#include "tandem/text/tokenizer.h"

namespace tandem::engine {
namespace internal {
class DisaggRole;
class GrammarMaskPrefetch;
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

// A token drawn by the backend and what it returned with it (ModelRunner::backend_samples).
struct DrawnToken {
  kernels::TokenLogprob token;
  std::span<const kernels::TokenLogprob> top;  // the most likely, as many as params.logprobs
};

// Where an engine runs its model: the CPU backend, or the CUDA backend on GPU 0 (fp32 weights,
// activations and KV cache in device memory; docs/architecture.md). Rank r of a tensor-parallel
// group of N > 1 runs on GPU r % D, D the CUDA devices its process sees.
enum class Device { kCpu, kCuda };

// Where an engine draws its tokens (`--sampling-device`). kBackend: in the backend
// (Backend::SampleRows), so that only token ids and log-probabilities leave a GPU; a sample
// with a structured-output constraint, speculative drafts or a logit_bias naming a token twice
// is still drawn on the host, from its own rows of logits, in the same step. kAuto: kBackend
// on CUDA, kHost on the CPU, whose backend would run the same code. Outputs are the same
// either way (on CUDA up to the rounding of its sums).
enum class SamplingDevice { kAuto, kHost, kBackend };

struct EngineOptions {
  std::string model_dir;
  Device device = Device::kCpu;
  int num_threads = 0;                   // 0: one per core
  // `--cpu-isa`: the CPU backend's instruction set (kAuto: the widest that keeps activations
  // exact to about fp32; kAvx512Bf16Round must be asked for). Device::kCpu only.
  kernels::CpuIsa cpu_isa = kernels::CpuIsa::kAuto;
  int64_t kv_cache_bytes = 512ll << 20;  // KV capacity is derived from this budget
  int block_size = 16;
  // `--dtype`: the element type projection weights are held in (kF32, kBF16, kF16); unset
  // (auto): the checkpoint's torch_dtype. Activations and accumulation stay fp32.
  std::optional<DType> dtype;
  // `--kv-cache-dtype`: the KV cache's element type (also kF8E4M3, kF8E5M2); unset (auto): the
  // weight dtype. The block count follows its element size.
  std::optional<DType> kv_cache_dtype;
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
  // `--enable-prefix-caching` / `--no-enable-prefix-caching`: full KV blocks stay cached after
  // their request ends, named by a hash of their tokens (and the request's cache_salt), and a
  // request whose prompt begins with cached blocks computes only the rest; the samples of an
  // n > 1 request share their prompt's blocks. Outputs are the same either way.
  bool enable_prefix_caching = true;
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
  // Speculative decoding (`--speculative-method`, `--num-speculative-tokens`, `--ngram-min`,
  // `--ngram-max`; docs/architecture.md, "Speculative decoding"): decoding sequences (decode
  // and colocated roles) run proposed tokens after their last one and keep those the target
  // model's own sampling accepts, so outputs are distributed exactly as without.
  SpeculativeOptions speculative;
  // `--tensor-parallel-size`: the group this engine is rank 0 (the leader) of, not owned, which
  // must outlive the engine; null: the whole model here. The engine schedules and samples; its
  // runner sends each step's plan to the other ranks, whose runners (ModelRunner::RunFollower)
  // hold the other shards. A prefill or decode worker's followers also move their KV heads'
  // pages (worker/tensor_parallel_kv.h). It carries the step plans (host memory); on the CPU
  // backend the activations too. With Device::kCuda every rank's engine or follower joins an
  // NCCL group over it, on its backend's stream and GPU (rank % devices), which carries the
  // activations (ModelRunnerOptions::device_collective).
  collective::Communicator* tensor_parallel = nullptr;
  // With tensor_parallel, the side channel of each step (ModelRunner::set_step_attachment):
  // called on the engine thread once a step is scheduled, before it runs, with what it will
  // write; the bytes returned go to every follower with the step's plan (empty: none, and no
  // reports). After such a step, `tensor_parallel_step_reports` gets each follower's report
  // (rank r's at [r - 1]). A prefill worker's group tells its followers here which pages to
  // push, and learns whether they landed.
  std::function<std::string(std::span<const KvWritten> written)> tensor_parallel_step_attachment;
  std::function<void(std::span<const std::string> reports)> tensor_parallel_step_reports;
  // The grammar masks of a step's constrained samples are computed on a thread of their own
  // while the forward pass runs (docs/architecture.md, "One engine step"); false computes each
  // when its sample is drawn, after the forward pass (benchmarks compare the two). Outputs are
  // the same either way.
  bool overlap_grammar_masks = true;
  SamplingDevice sampling_device = SamplingDevice::kAuto;
  // On CUDA, decode and speculative verification steps replay CUDA graphs captured per padded
  // token count (ModelRunnerOptions::graph_batch_sizes: 1, 2, 4, then multiples of 8 up to
  // max_num_seqs x (1 + draft tokens) and at most 512); true runs every step eagerly
  // (`--enforce-eager`, vLLM's name). No effect on the CPU backend, which has no launch
  // overhead to save.
  bool enforce_eager = false;
  // What the engine times its own steps and draft passes by (the latency model, the SLO
  // controllers and adaptive speculation read those times); null: std::chrono::steady_clock.
  // Tests pass a clock that advances by a fixed amount per reading, so that what the engine
  // decides from its timings does not depend on how fast or loaded the machine is.
  std::function<std::chrono::steady_clock::time_point()> clock;
};

// The step sizes (tokens) an engine captures decode step graphs for, when a step has at most
// `max_tokens` of them (max_num_seqs, times 1 + the draft tokens with speculation).
std::vector<int> DecodeGraphBatchSizes(int max_tokens);

// Single-threaded: one caller drives AddRequest / Abort / Step.
//   TANDEM_ASSIGN_OR_RETURN(auto engine, LlmEngine::Create({.model_dir = dir}));
//   TANDEM_RETURN_IF_ERROR(engine->AddRequest({"r1", engine->tokenizer().Encode("Hi", true), {}}));
//   while (engine->has_unfinished()) for (auto& out : engine->Step().value()) { ... }
class LlmEngine {
 public:
  static absl::StatusOr<std::unique_ptr<LlmEngine>> Create(const EngineOptions& options);
  ~LlmEngine();

  // Refuses (InvalidArgument, naming the field) an empty prompt, a token id outside the
  // vocabulary, bad sampling parameters, a structured-output constraint that does not compile
  // (or whose replayed prompt tokens it does not accept), a prompt that with max_tokens overruns
  // the context length, or one that could never fit in the KV cache; AlreadyExists for a
  // duplicate id.
  absl::Status AddRequest(GenerateRequest request);
  // The checks of AddRequest that do not depend on engine state; safe from any thread. Compiles
  // a structured-output constraint for this engine's vocabulary (once per kind and source: the
  // grammar cache), so a caller that validates on its own thread keeps that off the engine's.
  absl::Status Validate(const GenerateRequest& request) const;
  // Compiles the grammar of params.structured for this engine's vocabulary, or finds it in the
  // cache (a no-op when unconstrained); safe from any thread. A caller that will hand the
  // request to the engine's thread calls it first, so that thread finds the grammar compiled.
  absl::Status PrepareConstraint(const SamplingParams& params) const {
    return CompiledConstraint(params).status();
  }
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
  // Allocates blocks for the prompt KV of a request about to be prefilled elsewhere. Given the
  // prompt (all num_tokens of it) and its cache_salt, the table begins with the cached blocks
  // of the prompt's longest cached prefix, shared (their KV is already here), and
  // `*num_cached_tokens` says how many tokens they hold (a multiple of the block size; 0
  // without prefix caching): only the blocks after them need the prompt's KV.
  absl::StatusOr<BlockTable> ReserveBlocks(int num_tokens, std::span<const int32_t> prompt = {},
                                           std::string_view cache_salt = "",
                                           int* num_cached_tokens = nullptr);
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

  // The KV block manager: the prefix cache's hashes and its events, which a worker publishes
  // for KV-aware routing (BlockManager::RecordEvents). The engine's thread only.
  BlockManager& block_manager() { return *blocks_; }
  const BlockManager& block_manager() const { return *blocks_; }

  // The KV cache, for registration with a transfer agent.
  // Device memory with Device::kCuda (kv_cache_on_host() false): only a CUDA-aware transfer
  // backend ("cuda_ipc") can send it.
  // With a tensor-parallel group, between steps: ModelRunner::SideChannel.
  absl::StatusOr<std::vector<std::string>> TensorParallelSideChannel(std::string bytes) {
    return runner_->SideChannel(std::move(bytes));
  }
  void* kv_cache() { return runner_->kv_cache(); }
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
  // Grammars compiled so far (structured outputs; a cached grammar is compiled once).
  size_t grammar_compilations() const { return grammar_cache_->compilations(); }

 private:
  struct Choice;
  struct Request;
  LlmEngine() = default;
  // A request of n choices, each a sequence holding the prompt, with its detokenizer and, when
  // constrained, its grammar matcher past the replayed prompt tokens; the caller sets what
  // differs (random stream, prefilled state). Moves request.params.
  absl::StatusOr<std::unique_ptr<Request>> NewRequest(GenerateRequest& request);
  // The compiled grammar of a request's constraint (null when unconstrained), from the cache.
  absl::StatusOr<std::shared_ptr<const grammar::CompiledGrammar>> CompiledConstraint(
      const SamplingParams& params) const;
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
  // Sets the draft tokens of every decoding sequence (speculative decoding) before Schedule;
  // early exit reserves their places, filled by DraftStep once the step is planned.
  void ProposeDrafts();
  // Sets spec_tokens_, the draft length of the coming step, for the running batch.
  void ChooseSpeculationLength();
  // Early exit and draft-model speculation: the draft passes that fill in the step's draft
  // tokens (a draft model first catches its own KV up with the sequence's tokens).
  absl::Status DraftStep(const SchedulerStep& step);
  // Samples the logit rows of one sampling sequence of the step (1 + its draft tokens, from
  // `rows`): verifies its draft tokens in order, processing each token, until one is rejected
  // or the choice ends; gives back the rejected tokens' KV.
  // `grammar_mask`: the sequence's first row's grammar mask when prefetched, else null.
  // `drawn`: the token the backend drew for its one row (backend sampling), or null.
  void SampleSequence(const ScheduledSequence& s, std::span<const float> rows,
                      std::vector<float>& row, const grammar::TokenMask* grammar_mask,
                      RequestOutput& out, const DrawnToken* drawn = nullptr);
  // Backend sampling: when the engine samples in the backend and some sampling sequence of
  // the step can (no drafts, no grammar), hands the runner every logit row (taking the draws
  // of those sequences from their streams; the others' rows come back as logits) and returns
  // true; step_in_backend_ then says whose tokens come from runner_->backend_samples().
  bool PlanBackendSampling(const SchedulerStep& step);
  // Starts the grammar masks of the step's constrained samples on mask_prefetch_ (they fill
  // while the forward pass runs) and sets step_mask_index_; false when none was started.
  bool StartGrammarMasks(const SchedulerStep& step);
  absl::StatusOr<std::span<const float>> ExecuteStep(const SchedulerStep& step);
  // The runner's final hidden states of the step's logit rows when an embedding request
  // (RequestTask::kEmbed) samples in it; empty otherwise (nothing copied back).
  absl::StatusOr<std::span<const float>> PooledHidden(const SchedulerStep& step);
  // Samples every sampling sequence of the step from its rows of `logits`; an embedding
  // request's sequence instead takes its row of `hidden` [rows, hidden_size] and finishes.
  void SampleStep(const SchedulerStep& step, std::span<const float> logits,
                  std::span<const float> hidden, std::vector<RequestOutput>& outputs);
  // Finishes an embedding request's one sequence with its final hidden state `hidden` of the
  // last prompt token, L2-normalised into out.embedding; no token is produced.
  void FinishEmbedding(const ScheduledSequence& s, std::span<const float> hidden,
                       RequestOutput& out);
  void FinishOutputs(std::vector<RequestOutput>& outputs);

  EngineOptions options_;
  std::unique_ptr<Checkpoint> checkpoint_;
  std::unique_ptr<text::Tokenizer> tokenizer_;
  std::unique_ptr<text::ChatFormatter> chat_formatter_;
  std::unique_ptr<kernels::Backend> backend_;
  // Tensor parallelism on a device backend: the activations' NCCL group, on backend_'s stream
  // (destroyed after runner_, before backend_).
  std::unique_ptr<collective::Communicator> device_collective_;
  std::unique_ptr<BlockManager> blocks_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<ModelRunner> runner_;
  // SpeculativeMethod::kDraftModel: the draft's checkpoint and runner (its KV cache indexed by
  // the same block ids as runner_'s), and its own backend on a device.
  std::unique_ptr<Checkpoint> draft_checkpoint_;
  std::unique_ptr<kernels::Backend> draft_backend_;
  std::unique_ptr<ModelRunner> draft_runner_;
  std::unique_ptr<Sampler> sampler_;
  bool backend_sampling_ = false;  // SamplingDevice resolved
  bool step_sampled_in_backend_ = false;  // the current step's tokens are the backend's
  int64_t backend_sampled_tokens_ = 0;    // EngineStats::backend_sampled_tokens
  int64_t host_sampled_tokens_ = 0;       // EngineStats::host_sampled_tokens
  std::vector<bool> step_in_backend_;  // per step.seqs entry, with step_sampled_in_backend_
  std::vector<kernels::SampleRowParams> sample_rows_;  // PlanBackendSampling's scratch
  std::vector<kernels::LogitEdit> sample_edits_;
  std::vector<int32_t> sample_host_rows_;
  std::vector<float> draft_row_;  // DraftStep's scratch copy of a draft logits row
  // The tokenizer's vocabulary as bytes (EOS ids end a grammar) and the grammars compiled for
  // it, shared by every constrained request; the cache is thread-safe (Validate runs anywhere).
  std::shared_ptr<const grammar::TokenVocabulary> grammar_vocab_;
  std::unique_ptr<grammar::GrammarCache> grammar_cache_;
  // With options_.overlap_grammar_masks and a vocabulary for grammars.
  std::unique_ptr<internal::GrammarMaskPrefetch> mask_prefetch_;
  std::vector<int> step_mask_index_;  // per step.seqs entry: its prefetched mask, or -1
  int max_model_len_ = 0;
  int64_t next_seq_id_ = 0;
  std::map<std::string, std::unique_ptr<Request>> requests_;
  // What the role (prefill, decode, colocated) changes: hand-offs held, first tokens of
  // prefilled requests, which SLO controller runs.
  std::unique_ptr<internal::DisaggRole> role_;
  std::vector<KvWritten> step_writes_;          // of the running step, for on_layer_kv_written
  int decode_batch_limit_ = 0;  // the TPOT controller's cap; 0 without one
  std::unique_ptr<NgramProposer> ngram_;  // with SpeculativeMethod::kNgram
  // The draft length of the coming step (speculation on): fixed, or chosen by spec_length_.
  int spec_tokens_ = 0;
  std::unique_ptr<SpeculationLength> spec_length_;  // with options_.speculative.adaptive
  // Speculative decoding counters (EngineStats::spec_*).
  int64_t spec_proposed_ = 0;
  int64_t spec_accepted_ = 0;
  int64_t spec_verify_steps_ = 0;
  std::vector<int64_t> spec_proposed_by_position_, spec_accepted_by_position_;
  StepTelemetry telemetry_{nullptr, "colocated"};  // set up by Create
};

// Runs `requests` to completion on `engine` and returns, per request in order, the final
// output of each choice (all tokens, all text). For offline use and tests.
absl::StatusOr<std::vector<RequestOutput>> GenerateAll(LlmEngine& engine,
                                                       std::vector<GenerateRequest> requests);

// Runs rank options.tensor_parallel->rank() (> 0) of a tensor-parallel group whose rank 0 runs
// an LlmEngine: loads this rank's shard of options.model_dir on options.device (num_threads,
// device; the leader decides the rest: blocks, batch sizes, dtypes) and runs the steps the
// leader sends. Returns OK when the leader's engine is destroyed, or the group's error (a rank
// died, a collective timed out) at once.
absl::Status RunTensorParallelFollower(const EngineOptions& options);

// The same in two parts, for a follower that prepares its runner before it runs the steps (a
// worker's rank registers its KV cache with a transfer agent and sets the runner's follower step
// hooks):
//   TANDEM_ASSIGN_OR_RETURN(auto follower, TensorParallelFollower::Create(options));
//   follower->runner().set_follower_step_hooks(...);
//   return follower->Run();
class TensorParallelFollower {
 public:
  static absl::StatusOr<std::unique_ptr<TensorParallelFollower>> Create(
      const EngineOptions& options);
  ~TensorParallelFollower();
  ModelRunner& runner() { return *runner_; }
  // ModelRunner::RunFollower.
  absl::Status Run();

 private:
  TensorParallelFollower() = default;
  std::unique_ptr<Checkpoint> checkpoint_;
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<collective::Communicator> device_collective_;  // as LlmEngine's
  std::unique_ptr<ModelRunner> runner_;
};

}  // namespace tandem::engine
