#include "tandem/engine/speculative.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace tandem::engine {

absl::Status SpeculativeOptions::Validate() const {
  if (method == SpeculativeMethod::kNone) return absl::OkStatus();
  if (num_speculative_tokens < 1 || num_speculative_tokens > 32) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_speculative_tokens must be in [1, 32], got ", num_speculative_tokens));
  }
  if (method == SpeculativeMethod::kNgram &&
      (ngram_min < 1 || ngram_max < ngram_min || ngram_max > 64)) {
    return absl::InvalidArgumentError(
        absl::StrCat("ngram_min and ngram_max must satisfy 1 <= ngram_min <= ngram_max <= 64, got ",
                     ngram_min, " and ", ngram_max));
  }
  if (method == SpeculativeMethod::kEarlyExit && draft_layers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("early-exit speculation needs draft_layers >= 1, got ", draft_layers));
  }
  if (method == SpeculativeMethod::kDraftModel && draft_model.empty()) {
    return absl::InvalidArgumentError(
        "draft-model speculation needs the draft model's directory (draft_model)");
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
    case SpeculativeMethod::kDraftModel:
      return "draft-model";
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
  } else if (name == "draft-model") {
    *method = SpeculativeMethod::kDraftModel;
  } else {
    return false;
  }
  return true;
}

std::vector<int32_t> NgramProposer::Propose(std::span<const int32_t> tokens, int max_tokens) const {
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

SpeculationLength::SpeculationLength(int max_tokens)
    : max_(max_tokens), proposed_(max_tokens, 0.0), accepted_(max_tokens, 0.0) {}

void SpeculationLength::Observe(int proposed, int accepted) {
  // A memory of about 200 observations per position.
  constexpr double kDecay = 0.995;
  for (int j = 0; j < std::min(proposed, max_); ++j) {
    // Position j was decided only when every earlier draft was accepted.
    if (j > accepted) break;
    proposed_[j] = kDecay * proposed_[j] + 1.0;
    accepted_[j] = kDecay * accepted_[j] + (j < accepted ? 1.0 : 0.0);
  }
}

double SpeculationLength::acceptance(int position) const {
  if (position < 0 || position >= max_ || proposed_[position] < 1.0) {
    // Unmeasured: as likely as the position before it (optimistic at the start).
    return position > 0 && position < max_ ? acceptance(position - 1) : 1.0;
  }
  return accepted_[position] / proposed_[position];
}

double SpeculationLength::ExpectedTokens(int k) const {
  double expected = 1.0;
  double all_accepted = 1.0;
  for (int j = 0; j < std::min(k, max_); ++j) {
    all_accepted *= acceptance(j);
    expected += all_accepted;
  }
  return expected;
}

int SpeculationLength::Choose(const StepLatencyModel& model, int num_seqs, int64_t context,
                              double draft_pass_seconds, double last_step_seconds) {
  probing_ = false;
  if (num_seqs <= 0) return max_;
  const bool flat = !model.ready();
  if (flat && !(last_step_seconds > 0)) return max_;
  int best = 0;
  double best_rate = 0;
  for (int k = 0; k <= max_; ++k) {
    const int64_t tokens = static_cast<int64_t>(num_seqs) * (1 + k);
    const double target =
        flat ? last_step_seconds : model.Predict(tokens, num_seqs, context + tokens - num_seqs);
    if (!(target > 0)) return max_;
    const double seconds = target + k * std::max(0.0, draft_pass_seconds);
    const double rate = ExpectedTokens(k) / seconds;
    if (rate > best_rate) {
      best_rate = rate;
      best = k;
    }
  }
  if (best > 0) {
    steps_off_ = 0;
    probe_interval_ = kFirstProbeInterval;
    return best;
  }
  // Off: probe now and then with one draft token (the cheapest probe), or acceptance would
  // never be measured again; where the first draft is accepted often enough, the longer
  // lengths follow. Each probe that leaves it off doubles the wait for the next, up to
  // kLastProbeInterval steps.
  probing_ = ++steps_off_ >= probe_interval_;
  if (probing_) {
    steps_off_ = 0;
    probe_interval_ = std::min(2 * probe_interval_, kLastProbeInterval);
  }
  return probing_ ? 1 : 0;
}

}  // namespace tandem::engine
