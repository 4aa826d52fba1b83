// Turns one sequence's logits into its next token.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "tandem/engine/sequence.h"
#include "tandem/kernels/backend.h"

namespace tandem::engine {

// Order of operations (each skipped when it is a no-op): logprobs of the raw distribution;
// min_tokens masking of EOS and stop ids; repetition penalty (prompt and output tokens),
// presence and frequency penalties (output tokens); logit_bias; the grammar's token mask of a
// constrained sequence (seq.matcher: only tokens the grammar allows next, EOS only where it may
// end); greedy argmax, or temperature, top-k, top-p, min-p and a draw from the sequence's own
// random stream, among the allowed tokens only. Ties resolve to the lowest token id, so results
// never depend on the batch.
class Sampler {
 public:
  explicit Sampler(std::vector<int32_t> eos_token_ids) : eos_token_ids_(std::move(eos_token_ids)) {}

  // logits: [vocab], overwritten as scratch. Fills seq.last_logprob / last_top_logprobs when
  // seq.params->logprobs >= 0. Does not advance seq.matcher (the caller accepts the token).
  // A constrained sequence always gets a token its grammar allows: when min_tokens masked every
  // one of them (the grammar can only end), the lowest allowed id (an EOS); -1 when the grammar
  // allows no token at all (a dead end: it needs bytes no token of the vocabulary holds).
  //
  // Speculative verification: `draft` >= 0 is a token a proposer put at this position with
  // certainty (a point-mass draft distribution q). The result is still an exact draw from the
  // distribution p described above: greedy returns the argmax as always (the draft is accepted
  // when it equals it); a sampled sequence accepts the draft with probability p(draft) and
  // otherwise draws from p with the draft removed, renormalised (the residual max(p - q, 0)).
  // The draft was accepted exactly when the result equals it.
  //
  // `grammar_mask`: seq.matcher's mask for its current state when already computed (the engine
  // computes it during the forward pass); null: computed here.
  //
  // `q`: the distribution a sampled draft was drawn from (SampleDraft); null or empty: the draft
  // is a point mass as above. The draft is then accepted with probability min(1, p(draft) /
  // q(draft)), and otherwise the token is drawn from max(p - q, 0) renormalised: exact
  // rejection sampling, so the result is still an exact draw from p.
  int32_t Sample(std::span<float> logits, Sequence& seq, int32_t draft = -1,
                 const grammar::TokenMask* grammar_mask = nullptr,
                 const DraftDistribution* q = nullptr);

  // A draft model's (or early exit's) proposal for a sampled sequence: `logits` (the draft's
  // row, overwritten as scratch) processed exactly as Sample processes the target's (min_tokens,
  // penalties and logit_bias, with seq.tokens already holding the drafts before this position;
  // then temperature, top-k, top-p and min-p; the grammar is left to verification, which
  // rejects what it forbids), cut to its kMaxDraftCandidates most likely tokens and
  // renormalised into *q; returns a draw from q, from seq.rng.
  int32_t SampleDraft(std::span<float> logits, Sequence& seq, DraftDistribution* q);

  // Whether seq's next token (with no draft) can be drawn by Backend::SampleRows instead:
  // unconstrained, and its logit_bias naming each token once.
  bool SamplesInBackend(const Sequence& seq, int vocab);
  // The row Backend::SampleRows draws seq's next token by, as Sample would draw it: its
  // min_tokens masks, penalties and logit_bias appended to *edits as one edit per token, and a
  // sampled sequence's draw taken from seq.rng here (greedy ones take none, as in Sample).
  kernels::SampleRowParams BackendRow(Sequence& seq, int vocab,
                                      std::vector<kernels::LogitEdit>* edits);

  // Tokens a draft distribution keeps (its most likely), so that a proposal costs a few hundred
  // bytes whatever the vocabulary.
  static constexpr int kMaxDraftCandidates = 64;

 private:
  // min_tokens, the penalties and logit_bias, applied to `logits` in place.
  void AdjustLogits(std::span<float> logits, const Sequence& seq);
  // Temperature, top-k, top-p and min-p over candidates_ (constrained: the grammar's allowed
  // tokens already there; else the whole vocabulary): the first (returned) entries of
  // candidates_ and probs_ are the distribution, *mass their sum.
  int Truncate(std::span<const float> logits, const SamplingParams& p, bool constrained,
               double* mass);

  std::vector<int32_t> eos_token_ids_;
  std::vector<float> probs_;         // scratch [vocab]
  std::vector<float> residual_;      // scratch [vocab]
  std::vector<float> raw_logits_;    // scratch [vocab]
  std::vector<int32_t> candidates_;  // scratch [vocab]
  std::vector<int32_t> counts_;      // scratch [vocab], zero between calls
  std::vector<int32_t> slot_;        // scratch [vocab], -1 between calls
  std::vector<int> order_;           // scratch [vocab]
  grammar::TokenMask mask_;          // scratch [vocab / 64]
};

}  // namespace tandem::engine
