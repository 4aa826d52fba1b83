#include "tandem/engine/speculative.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace tandem::engine {

absl::Status SpeculativeOptions::Validate() const {
  if (method == SpeculativeMethod::kNone) return absl::OkStatus();
  if (num_speculative_tokens < 1 || num_speculative_tokens > 32) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_speculative_tokens must be in [1, 32], got ", num_speculative_tokens));
  }
  if (method == SpeculativeMethod::kNgram &&
      (ngram_min < 1 || ngram_max < ngram_min || ngram_max > 64)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ngram_min and ngram_max must satisfy 1 <= ngram_min <= ngram_max <= 64, got ", ngram_min,
        " and ", ngram_max));
  }
  if (method == SpeculativeMethod::kEarlyExit && draft_layers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("early-exit speculation needs draft_layers >= 1, got ", draft_layers));
  }
  return absl::OkStatus();
}

const char* SpeculativeMethodName(SpeculativeMethod method) {
  switch (method) {
    case SpeculativeMethod::kNone:
      return "none";
    case SpeculativeMethod::kNgram:
      return "ngram";
    case SpeculativeMethod::kEarlyExit:
      return "early-exit";
  }
  return "none";
}

bool ParseSpeculativeMethod(const std::string& name, SpeculativeMethod* method) {
  if (name == "none") {
    *method = SpeculativeMethod::kNone;
  } else if (name == "ngram") {
    *method = SpeculativeMethod::kNgram;
  } else if (name == "early-exit") {
    *method = SpeculativeMethod::kEarlyExit;
  } else {
    return false;
  }
  return true;
}

std::vector<int32_t> NgramProposer::Propose(std::span<const int32_t> tokens,
                                            int max_tokens) const {
  const int size = static_cast<int>(tokens.size());
  if (max_tokens <= 0) return {};
  for (int n = std::min(ngram_max_, size - 1); n >= ngram_min_; --n) {
    const std::span<const int32_t> suffix = tokens.last(n);
    // The most recent earlier occurrence: its continuation is what the text last did here.
    for (int start = size - n - 1; start >= 0; --start) {
      if (!std::equal(suffix.begin(), suffix.end(), tokens.begin() + start)) continue;
      const int from = start + n;
      const int count = std::min(max_tokens, size - from);
      return std::vector<int32_t>(tokens.begin() + from, tokens.begin() + from + count);
    }
  }
  return {};
}

}  // namespace tandem::engine
