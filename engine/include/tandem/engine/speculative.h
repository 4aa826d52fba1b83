// Speculative decoding: a cheap proposer guesses the next tokens of a decoding sequence, and one
// target step verifies them all at once (docs/architecture.md, "Speculative decoding").
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace tandem::engine {

// How the draft tokens are proposed. kNone: no speculation. kNgram: prompt lookup, the tokens
// that followed the most recent earlier occurrence of the sequence's last n tokens.
// kEarlyExit: self-speculation, the target's own first draft_layers layers with its final norm
// and LM head as the draft model (greedy), over the target's own KV of those layers.
enum class SpeculativeMethod { kNone, kNgram, kEarlyExit };

struct SpeculativeOptions {
  SpeculativeMethod method = SpeculativeMethod::kNone;
  // `--num-speculative-tokens`: draft tokens proposed per sequence and step (the most).
  int num_speculative_tokens = 0;
  // `--ngram-min` / `--ngram-max`: the suffix lengths the n-gram proposer tries, longest first.
  int ngram_min = 1;
  int ngram_max = 3;
  // `--draft-layers`: the early-exit draft's layers (fewer than the model has).
  int draft_layers = 0;

  bool enabled() const { return method != SpeculativeMethod::kNone && num_speculative_tokens > 0; }
  // InvalidArgument naming the field for values no proposer can run with.
  absl::Status Validate() const;
};

// "none" / "ngram" / "early-exit", and back (false for an unknown name).
const char* SpeculativeMethodName(SpeculativeMethod method);
bool ParseSpeculativeMethod(const std::string& name, SpeculativeMethod* method);

// Prompt lookup: for n from ngram_max down to ngram_min, finds the most recent earlier
// occurrence of the last n tokens of `tokens` and proposes up to `max_tokens` of the tokens that
// followed it. Empty when no suffix recurs. Plain host code over the sequence's own tokens.
//   NgramProposer proposer(/*ngram_min=*/1, /*ngram_max=*/3);
//   std::vector<int32_t> draft = proposer.Propose(seq.tokens, /*max_tokens=*/4);
class NgramProposer {
 public:
  NgramProposer(int ngram_min, int ngram_max) : ngram_min_(ngram_min), ngram_max_(ngram_max) {}
  std::vector<int32_t> Propose(std::span<const int32_t> tokens, int max_tokens) const;

 private:
  int ngram_min_;
  int ngram_max_;
};

}  // namespace tandem::engine
