// The engine API's requests and outputs: what a caller asks of an engine (or of a pool of
// workers behind the same interface, engine::Generator) and what it streams back. Plain data
// plus the checks that need only the model; the engine's runtime is not needed to use them.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tandem/engine/sampling_params.h"
#include "tandem/engine/step_coefficients.h"
#include "tandem/text/model_config.h"

namespace tandem::engine {

// Why a sequence ended. kPrefilled: a prefill-role engine computed the prompt and the first
// token and the sequence now waits for its KV to be handed to a decode engine.
enum class FinishReason { kNone, kStop, kLength, kAbort, kPrefilled };

// "stop", "length", "abort", ... as the API reports it.
const char* FinishReasonName(FinishReason reason);

// One token and its log-probability (a chosen token or one of the top alternatives).
struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;
};

// What a request computes. kGenerate: tokens, sampled step by step. kEmbed (the API's
// /v1/embeddings): a prefill that samples nothing; its one output, finished, carries the final
// hidden state of the last prompt token (after the model's final norm, before the LM head),
// L2-normalised. An embedding request's sampling params are not used (n must be 1) and its
// prompt alone must fit in the context length.
enum class RequestTask { kGenerate, kEmbed };

struct GenerateRequest {
  std::string request_id;
  std::vector<int32_t> prompt_tokens;
  SamplingParams params;
  // Isolates tenants in the prefix cache (the API's `cache_salt`): a request reuses cached KV
  // only of requests with the same salt. Empty: the shared, unsalted cache.
  std::string cache_salt{};
  RequestTask task = RequestTask::kGenerate;
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
  // RequestTask::kEmbed: the pooled, unit-norm vector [hidden_size], on the finished output
  // (whose one choice ends with kStop and no tokens). Empty otherwise.
  std::vector<float> embedding;
};

// A snapshot of an engine (or, from a Generator, summed over its workers).
struct EngineStats {
  int running = 0;
  int waiting = 0;
  int kv_blocks_total = 0;
  int kv_blocks_used = 0;
  int64_t preemptions = 0;
  // Prefix cache, in tokens since the engine started: looked up as sequences were admitted, and
  // found cached (not computed). Both stay 0 without prefix caching.
  int64_t prefix_cache_queries_tokens = 0;
  int64_t prefix_cache_hits_tokens = 0;
  // Cached blocks given to new tokens since the engine started (their prefix forgotten).
  int64_t prefix_cache_evictions = 0;
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
  // Speculative decoding since the engine started: draft tokens verified and accepted,
  // sequence-steps that verified at least one, and per draft position (0-based) how many
  // sequence-steps proposed a token there and how many had it accepted. All 0 (empty) without
  // speculation.
  int64_t spec_proposed_tokens = 0;
  int64_t spec_accepted_tokens = 0;
  int64_t spec_verify_steps = 0;
  std::vector<int64_t> spec_proposed_by_position;
  std::vector<int64_t> spec_accepted_by_position;
  // Tokens drawn since the engine started: in the backend (EngineOptions::sampling_device) and
  // on the host.
  int64_t backend_sampled_tokens = 0;
  int64_t host_sampled_tokens = 0;
  // Decode steps that replayed a captured step graph (CUDA graphs; EngineOptions::enforce_eager),
  // and the batch sizes captured so far.
  int64_t graph_steps = 0;
  int graphs_captured = 0;
  // Tensor parallelism (rank 0's view, since the engine started): wall time inside collectives
  // (step plans, all-reduces, the logits' all-gather) and their payload bytes. 0 without it.
  double collective_seconds = 0;
  int64_t collective_bytes = 0;
};

// The checks of a request that need only the model (so a router without an engine makes them
// too): sampling fields, token ids inside the vocabulary, a non-empty prompt, and prompt plus
// max_tokens within max_model_len (an embedding request: the prompt alone, and n == 1).
// InvalidArgument naming the field otherwise.
absl::Status ValidateRequest(const GenerateRequest& request, const text::ModelConfig& config,
                             int max_model_len);

// Appends one step's delta of a choice to what that choice produced so far.
void AccumulateDelta(ChoiceDelta& total, const ChoiceDelta& delta);

}  // namespace tandem::engine
