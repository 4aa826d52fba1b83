// The sampling arithmetic the engine's Sampler and Backend::SampleRows share, so that a token
// drawn on the host and one drawn by a backend are the same token.
#pragma once

#include <cstdint>
#include <vector>

#include "tandem/kernels/backend.h"

namespace tandem::kernels {

// The first id of the largest logit of [0, vocab); 0 when none is above -inf.
int32_t ArgmaxToken(const float* logits, int vocab);

// log sum exp of logits[0, vocab) (max + log of the sum in double of exp(logit - max)): the
// normaliser of the raw log-probabilities.
float LogSumExp(const float* logits, int vocab);

// The min(k, vocab) largest logits' ids in ids[0..) (ids is resized to vocab, the rest in no
// order), by logit descending, ties to the lowest id; returns min(k, vocab). The top
// log-probabilities' tokens.
int TopTokens(const float* logits, int vocab, int k, std::vector<int32_t>& ids);

// Temperature, top-k, top-p and min-p over `candidates` (constrained: the ids a caller already
// put there, in id order; else all of [0, vocab), which this fills). Sorted by logit
// (descending, ties by id) when top-k or top-p truncates, else left in id order. On return the
// first (returned) entries of candidates and probs are the distribution and *mass their sum;
// probs is exp in double of (logit - max) / temperature over the (top-k) candidates,
// normalised in double and rounded to float.
int TruncateCandidates(const float* logits, int vocab, float temperature, int top_k, float top_p,
                       float min_p, bool constrained, std::vector<int32_t>& candidates,
                       std::vector<float>& probs, double* mass);

// The first of ids[0..n) whose running sum of probs passes uniform * mass (probs summing to
// `mass`); past the end by rounding: the last id with any weight.
int32_t DrawCandidate(const int32_t* ids, const float* probs, int n, double mass, double uniform);

// Reused buffers of SampleRowReference.
struct SampleRowScratch {
  std::vector<int32_t> candidates;
  std::vector<float> probs;
  std::vector<float> raw;
};

// Backend::SampleRows for one row on the host: logits [vocab] (overwritten), `edits` the row's
// (edits[params.edits_begin, params.edits_end)), top: [params.num_logprobs] when it is > 0.
TokenLogprob SampleRowReference(float* logits, int vocab, const SampleRowParams& params,
                                const LogitEdit* edits, SampleRowScratch& scratch,
                                TokenLogprob* top);

}  // namespace tandem::kernels
