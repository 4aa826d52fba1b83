// What a request asks of the sampler, validated before it reaches the engine.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tandem/engine/structured_output.h"

namespace tandem::engine {

// Limits that keep one request from exhausting the engine; the API layer reports them.
inline constexpr int kMaxSamplesPerRequest = 16;  // n
inline constexpr int kMaxTopLogprobs = 20;        // top_logprobs
inline constexpr int kMaxStopStrings = 16;        // stop
inline constexpr int kMaxStopStringBytes = 256;   // each stop string
inline constexpr int kMaxStopTokenIds = 64;       // stop_token_ids
inline constexpr int kMaxLogitBias = 300;         // logit_bias entries
inline constexpr float kMaxLogitBiasValue = 100;  // |bias|

// A value added to one token's logit before sampling (OpenAI's logit_bias).
struct TokenBias {
  int32_t token = 0;
  float bias = 0.0f;  // [-100, 100]
  bool operator==(const TokenBias&) const = default;
};

// Sampling settings of one request. temperature == 0 means greedy.
// Logprobs are those of the model's distribution (log-softmax of the raw logits, before
// penalties, temperature and truncation), as the OpenAI API reports them.
struct SamplingParams {
  float temperature = 1.0f;
  float top_p = 1.0f;               // (0, 1]
  int top_k = 0;                    // 0 or -1: off
  float min_p = 0.0f;               // [0, 1]
  float repetition_penalty = 1.0f;  // > 0; applies to prompt and output tokens
  float presence_penalty = 0.0f;    // [-2, 2]; output tokens
  float frequency_penalty = 0.0f;   // [-2, 2]; output tokens
  std::optional<uint64_t> seed;     // same tokens for the same seed, whatever the batch
  int max_tokens = 16;              // >= 1
  int min_tokens = 0;               // EOS and stop ids are masked until this many tokens
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids;
  std::vector<std::string> stop;  // stop strings; never part of the returned text
  bool include_stop_str_in_output = false;
  int n = 1;
  int logprobs = -1;  // -1: none; 0: chosen token only; k: plus top-k
  bool skip_special_tokens = true;
  // What the output must match (structured outputs); kNone: anything.
  StructuredOutput structured;
  // Added to the logits after the penalties, before any grammar mask (which it cannot undo).
  std::vector<TokenBias> logit_bias;

  bool greedy() const { return temperature == 0.0f; }

  // Checks every field; the message names the field and the accepted range, as the API
  // returns it. vocab_size bounds stop_token_ids.
  absl::Status Validate(int vocab_size) const;
};

}  // namespace tandem::engine
