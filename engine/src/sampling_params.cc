#include "tandem/engine/sampling_params.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace tandem::engine {
namespace {

absl::Status RangeError(const char* field, const std::string& range, double got) {
  return absl::InvalidArgumentError(absl::StrCat(field, " must be ", range, ", got ", got));
}

}  // namespace

absl::Status SamplingParams::Validate(int vocab_size) const {
  if (!(temperature >= 0.0f && temperature <= 2.0f)) {
    return RangeError("temperature", "in [0, 2]", temperature);
  }
  if (!(top_p > 0.0f && top_p <= 1.0f)) return RangeError("top_p", "in (0, 1]", top_p);
  if (top_k < -1) return RangeError("top_k", "-1, 0 (off) or positive", top_k);
  if (!(min_p >= 0.0f && min_p <= 1.0f)) return RangeError("min_p", "in [0, 1]", min_p);
  if (!(repetition_penalty > 0.0f && repetition_penalty <= 10.0f)) {
    return RangeError("repetition_penalty", "in (0, 10]", repetition_penalty);
  }
  if (!(presence_penalty >= -2.0f && presence_penalty <= 2.0f)) {
    return RangeError("presence_penalty", "in [-2, 2]", presence_penalty);
  }
  if (!(frequency_penalty >= -2.0f && frequency_penalty <= 2.0f)) {
    return RangeError("frequency_penalty", "in [-2, 2]", frequency_penalty);
  }
  if (max_tokens < 1) return RangeError("max_tokens", "at least 1", max_tokens);
  if (min_tokens < 0 || min_tokens > max_tokens) {
    return RangeError("min_tokens", "in [0, max_tokens]", min_tokens);
  }
  if (n < 1 || n > kMaxSamplesPerRequest) {
    return RangeError("n", absl::StrCat("in [1, ", kMaxSamplesPerRequest, "]"), n);
  }
  if (logprobs < -1 || logprobs > kMaxTopLogprobs) {
    return RangeError("logprobs", absl::StrCat("in [0, ", kMaxTopLogprobs, "]"), logprobs);
  }
  if (stop.size() > static_cast<size_t>(kMaxStopStrings)) {
    return absl::InvalidArgumentError(
        absl::StrCat("stop may hold at most ", kMaxStopStrings, " strings, got ", stop.size()));
  }
  for (const std::string& s : stop) {
    if (s.empty() || s.size() > static_cast<size_t>(kMaxStopStringBytes)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "each stop string must be 1 to ", kMaxStopStringBytes, " bytes, got ", s.size()));
    }
  }
  if (stop_token_ids.size() > static_cast<size_t>(kMaxStopTokenIds)) {
    return absl::InvalidArgumentError(
        absl::StrCat("stop_token_ids may hold at most ", kMaxStopTokenIds, " ids"));
  }
  for (int32_t id : stop_token_ids) {
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stop_token_ids: id ", id, " is outside the vocabulary [0, ", vocab_size, ")"));
    }
  }
  if (logit_bias.size() > static_cast<size_t>(kMaxLogitBias)) {
    return absl::InvalidArgumentError(absl::StrCat("logit_bias may hold at most ", kMaxLogitBias,
                                                   " tokens, got ", logit_bias.size()));
  }
  for (const TokenBias& b : logit_bias) {
    if (b.token < 0 || b.token >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "logit_bias: token id ", b.token, " is outside the vocabulary [0, ", vocab_size, ")"));
    }
    if (!(b.bias >= -kMaxLogitBiasValue && b.bias <= kMaxLogitBiasValue)) {
      return absl::InvalidArgumentError(absl::StrCat("logit_bias: the bias of token ", b.token,
                                                     " must be in [-100, 100], got ", b.bias));
    }
  }
  return absl::OkStatus();
}

}  // namespace tandem::engine
