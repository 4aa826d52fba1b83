// One sequence being generated: a request's prompt and one of its `n` samples.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tandem/engine/block_manager.h"
#include "tandem/engine/request.h"
#include "tandem/engine/sampling_params.h"
#include "tandem/grammar/matcher.h"

namespace tandem::engine {

enum class SequenceStatus { kWaiting, kRunning, kFinished };

// Per-sequence random stream (xoshiro256**). Deterministic for a seed, independent of what
// else is batched with the sequence.
class SamplerRng {
 public:
  explicit SamplerRng(uint64_t seed);
  uint64_t Next();
  // Uniform in [0, 1).
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }

  // The full state, so a sequence handed from a prefill to a decode engine keeps its stream.
  std::array<uint64_t, 4> state() const { return {s_[0], s_[1], s_[2], s_[3]}; }
  static SamplerRng FromState(const std::array<uint64_t, 4>& state);

 private:
  SamplerRng() = default;
  uint64_t s_[4];
};

// A sampled draft token's proposal distribution: `probs` (summing to 1) over `ids`.
struct DraftDistribution {
  std::vector<int32_t> ids;
  std::vector<float> probs;
  // q(id): 0 for a token not among ids.
  double Probability(int32_t id) const {
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] == id) return probs[i];
    }
    return 0.0;
  }
};

struct Sequence {
  int64_t seq_id = 0;
  std::string request_id;
  int choice_index = 0;         // which of the request's n samples
  std::vector<int32_t> tokens;  // prompt followed by generated tokens
  int num_prompt_tokens = 0;
  int num_computed_tokens = 0;  // tokens whose KV is in the cache
  BlockTable block_table;
  SequenceStatus status = SequenceStatus::kWaiting;
  FinishReason finish_reason = FinishReason::kNone;
  std::shared_ptr<const SamplingParams> params;
  SamplerRng rng{0};
  int num_preemptions = 0;
  // The grammar state of a constrained sample (params->structured), advanced with every token
  // it generates; null when unconstrained.
  std::unique_ptr<grammar::GrammarMatcher> matcher;
  // Prefix cache: the root of this sequence's hash chain (from the request's cache_salt) and
  // the hashes of its full blocks computed so far (see ExtendBlockHashes).
  uint64_t prefix_root = 0;
  std::vector<uint64_t> block_hashes;
  // Another sample of the same request (its sample 0) whose prompt KV this one shares instead of
  // computing it: it waits until that prompt is computed, then forks its blocks and recomputes
  // only the last prompt token, for its own logits. Null: computes its own prompt.
  const Sequence* prompt_source = nullptr;
  // Speculative decoding: tokens proposed to follow `tokens`, verified by the next step (which
  // runs them after the last sampled token; the scheduler drops those that do not fit). Empty
  // outside a speculative step.
  std::vector<int32_t> draft_tokens;
  // Per draft token, the distribution it was drawn from (Sampler::SampleDraft: a draft model
  // or early exit proposing for a sampled sequence); shorter, or an entry empty: that draft is
  // a point mass (greedy sequences, the n-gram proposer).
  std::vector<DraftDistribution> draft_dists;
  // A draft model's KV cache holds the draft's KV of this many leading tokens (in this
  // sequence's blocks); it catches up before proposing.
  int draft_kv_tokens = 0;
  // A probe while speculation is off caught the draft up over recent tokens only: its KV from
  // this position up to where that catch-up began is stale, and is recomputed (draft_kv_tokens
  // goes back here) before the draft proposes outside a probe. -1: none is.
  int draft_kv_stale_from = -1;

  // Sampler outputs of the latest step that sampled (filled when params->logprobs >= 0).
  float last_logprob = 0.0f;
  std::vector<TokenLogprob> last_top_logprobs;

  int num_output_tokens() const { return static_cast<int>(tokens.size()) - num_prompt_tokens; }
  // Tokens not yet in the KV cache; a decode step has one.
  int num_uncomputed_tokens() const {
    return static_cast<int>(tokens.size()) - num_computed_tokens;
  }
  bool finished() const { return status == SequenceStatus::kFinished; }
};

}  // namespace tandem::engine
