#include "tandem/engine/request.h"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"

namespace tandem::engine {

const char* FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kNone:
      return "";
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kAbort:
      return "abort";
    case FinishReason::kPrefilled:
      return "prefilled";
  }
  return "";
}

absl::Status ValidateRequest(const GenerateRequest& request, const text::ModelConfig& config,
                             int max_model_len) {
  TANDEM_RETURN_IF_ERROR(request.params.Validate(config.vocab_size));
  const int prompt_len = static_cast<int>(request.prompt_tokens.size());
  if (prompt_len == 0) return absl::InvalidArgumentError("prompt must not be empty");
  TANDEM_RETURN_IF_ERROR(request.params.structured.Validate(prompt_len));
  for (int32_t id : request.prompt_tokens) {
    if (id < 0 || id >= config.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt token id ", id, " is outside the vocabulary [0, ", config.vocab_size, ")"));
    }
  }
  if (request.task == RequestTask::kEmbed) {
    if (request.params.n != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("n must be 1 for an embedding request, got ", request.params.n));
    }
    if (request.params.structured.active()) {
      return absl::InvalidArgumentError("an embedding request takes no structured output");
    }
    if (prompt_len > max_model_len) {
      return absl::InvalidArgumentError(absl::StrCat("this model's maximum context length is ",
                                                     max_model_len, " tokens, but the input has ",
                                                     prompt_len, " tokens; shorten the input"));
    }
    return absl::OkStatus();
  }
  const int64_t total = static_cast<int64_t>(prompt_len) + request.params.max_tokens;
  if (total > max_model_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("this model's maximum context length is ", max_model_len,
                     " tokens, but the prompt has ", prompt_len, " tokens and max_tokens is ",
                     request.params.max_tokens, " (", total, " in all)"));
  }
  return absl::OkStatus();
}

void AccumulateDelta(ChoiceDelta& total, const ChoiceDelta& delta) {
  total.token_ids.insert(total.token_ids.end(), delta.token_ids.begin(), delta.token_ids.end());
  total.text += delta.text;
  total.logprobs.insert(total.logprobs.end(), delta.logprobs.begin(), delta.logprobs.end());
  total.top_logprobs.insert(total.top_logprobs.end(), delta.top_logprobs.begin(),
                            delta.top_logprobs.end());
  if (delta.finish_reason != FinishReason::kNone) total.finish_reason = delta.finish_reason;
}

}  // namespace tandem::engine
