// Speculative decoding: a cheap proposer guesses the next tokens of a decoding sequence, and one
// target step verifies them all at once (docs/architecture.md, "Speculative decoding").
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tandem/engine/step_latency_model.h"

namespace tandem::engine {

// How the draft tokens are proposed. kNone: no speculation. kNgram: prompt lookup, the tokens
// that followed the most recent earlier occurrence of the sequence's last n tokens.
// kEarlyExit: self-speculation, the target's own first draft_layers layers with its final norm
// and LM head as the draft model (greedy), over the target's own KV of those layers.
// kDraftModel: a smaller model with the target's vocabulary (draft_model, a checkpoint
// directory) proposes greedily, over a KV cache of its own indexed by the target's block tables.
enum class SpeculativeMethod { kNone, kNgram, kEarlyExit, kDraftModel };

struct SpeculativeOptions {
  SpeculativeMethod method = SpeculativeMethod::kNone;
  // `--num-speculative-tokens`: draft tokens proposed per sequence and step (the most).
  int num_speculative_tokens = 0;
  // `--ngram-min` / `--ngram-max`: the suffix lengths the n-gram proposer tries, longest first.
  int ngram_min = 1;
  int ngram_max = 3;
  // `--draft-layers`: the early-exit draft's layers (fewer than the model has).
  int draft_layers = 0;
  // `--speculative-model`: the draft model's checkpoint directory (kDraftModel).
  std::string draft_model;
  // `--speculative-adaptive` (the default) / `--no-speculative-adaptive`: each step's draft
  // length is chosen by SpeculationLength from the measured acceptance and the step latency
  // model, 0 (off) where speculating would lower the tokens per second; otherwise always
  // num_speculative_tokens. Outputs are exact either way; a seeded sampled stream is
  // reproducible run to run only with a fixed length (the length decides how many random
  // numbers a step draws).
  bool adaptive = true;

  bool enabled() const { return method != SpeculativeMethod::kNone && num_speculative_tokens > 0; }
  // InvalidArgument naming the field for values no proposer can run with.
  absl::Status Validate() const;
};

// "none" / "ngram" / "early-exit" / "draft-model", and back (false for an unknown name).
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

// The draft length controller: after each step, the acceptance it saw per draft position; before
// each step, the length k in [0, max] that maximises the expected tokens per sequence-step
// (1 + sum over j < k of the chance that drafts 0..j are all accepted, from decayed per-position
// acceptance rates) over the step's time: what the latency model predicts for the running batch
// with k draft tokens each, plus k draft passes at their measured time (a model's draft, early
// exit's; nothing for n-gram lookup). k = 0 is speculation off; while off, a probe step still
// proposes one draft token now and then (after 32 steps off, then twice as long after each
// probe that leaves it off, up to 512), so that the acceptance it measures stays current at
// little cost.
class SpeculationLength {
 public:
  explicit SpeculationLength(int max_tokens);
  // One sequence-step proposed `proposed` draft tokens and the first `accepted` were accepted.
  void Observe(int proposed, int accepted);
  // The length for a step of `num_seqs` sequences reading `context` tokens in all, where a
  // draft pass (one proposed token for each of them) takes `draft_pass_seconds` and the
  // latency model predicts the target's step alone. Until the model is ready, a target step of
  // any length is taken to cost `last_step_seconds` (the last one's, without its draft passes;
  // 0: unknown, and the longest length is chosen), so that a draft that costs more than its
  // acceptance saves is switched off from the first steps.
  int Choose(const StepLatencyModel& model, int num_seqs, int64_t context,
             double draft_pass_seconds = 0, double last_step_seconds = 0);
  // Whether the last Choose returned a probe (speculation is off; one draft token now and then).
  bool probing() const { return probing_; }
  // The decayed share of proposals at `position` accepted when every earlier one was.
  double acceptance(int position) const;
  // Expected tokens one sequence-step yields with k draft tokens.
  double ExpectedTokens(int k) const;

 private:
  int max_;
  std::vector<double> proposed_;  // [max], decayed counts
  std::vector<double> accepted_;  // [max]
  static constexpr int kFirstProbeInterval = 32;
  static constexpr int kLastProbeInterval = 512;
  int steps_off_ = 0;
  int probe_interval_ = kFirstProbeInterval;
  bool probing_ = false;
};

// Tokens a draft model catches up over before a probe (SpeculationLength::probing): catching up
// everything since its last pass would cost a fixed share of the target's compute however
// rarely it probes, so the older KV is left stale (it only shapes proposals) until the draft
// proposes for real.
inline constexpr int kProbeCatchUpTokens = 64;

}  // namespace tandem::engine
