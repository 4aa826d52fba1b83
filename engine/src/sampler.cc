#include "tandem/engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"
#include "tandem/kernels/sampling.h"

namespace tandem::engine {

namespace {
uint64_t SplitMix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
uint64_t Rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

int32_t Draw(const int32_t* ids, const float* probs, int n, double mass, SamplerRng& rng) {
  return kernels::DrawCandidate(ids, probs, n, mass, rng.Uniform());
}

}  // namespace

SamplerRng::SamplerRng(uint64_t seed) {
  for (uint64_t& s : s_) s = SplitMix64(seed);
}

SamplerRng SamplerRng::FromState(const std::array<uint64_t, 4>& state) {
  SamplerRng rng;
  for (int i = 0; i < 4; ++i) rng.s_[i] = state[i];
  return rng;
}

uint64_t SamplerRng::Next() {
  uint64_t result = Rotl(s_[1] * 5, 7) * 9;
  uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = Rotl(s_[3], 45);
  return result;
}

void Sampler::AdjustLogits(std::span<float> logits, const Sequence& seq) {
  const SamplingParams& p = *seq.params;
  const int vocab = static_cast<int>(logits.size());
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  if (seq.num_output_tokens() < p.min_tokens) {
    if (!p.ignore_eos) {
      for (int32_t id : eos_token_ids_) {
        if (id >= 0 && id < vocab) logits[id] = kNegInf;
      }
    }
    for (int32_t id : p.stop_token_ids) logits[id] = kNegInf;
  }

  const bool penalties =
      p.repetition_penalty != 1.0f || p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f;
  if (penalties) {
    counts_.resize(vocab, 0);
    const int n_prompt = seq.num_prompt_tokens;
    if (p.repetition_penalty != 1.0f) {
      // Each token that appears anywhere in prompt or output is penalised once.
      for (int32_t t : seq.tokens) {
        if (counts_[t] == 0) {
          logits[t] =
              logits[t] > 0 ? logits[t] / p.repetition_penalty : logits[t] * p.repetition_penalty;
          counts_[t] = -1;
        }
      }
      for (int32_t t : seq.tokens) counts_[t] = 0;
    }
    for (size_t i = n_prompt; i < seq.tokens.size(); ++i) ++counts_[seq.tokens[i]];
    for (size_t i = n_prompt; i < seq.tokens.size(); ++i) {
      int32_t t = seq.tokens[i];
      if (counts_[t] > 0) {
        logits[t] -= p.frequency_penalty * counts_[t] + p.presence_penalty;
        counts_[t] = 0;
      }
    }
  }

  for (const TokenBias& b : p.logit_bias) logits[b.token] += b.bias;
}

int Sampler::Truncate(std::span<const float> logits, const SamplingParams& p, bool constrained,
                      double* mass) {
  return kernels::TruncateCandidates(logits.data(), static_cast<int>(logits.size()), p.temperature,
                                     p.top_k, p.top_p, p.min_p, constrained, candidates_, probs_,
                                     mass);
}

bool Sampler::SamplesInBackend(const Sequence& seq, int vocab) {
  if (seq.matcher != nullptr) return false;
  // A token named twice: slot_ marks each one seen (and is reset to -1 after).
  const std::vector<TokenBias>& bias = seq.params->logit_bias;
  slot_.resize(vocab, -1);
  bool twice = false;
  for (const TokenBias& b : bias) {
    twice = twice || slot_[b.token] >= 0;
    slot_[b.token] = 0;
  }
  for (const TokenBias& b : bias) slot_[b.token] = -1;
  return !twice;
}

kernels::SampleRowParams Sampler::BackendRow(Sequence& seq, int vocab,
                                             std::vector<kernels::LogitEdit>* edits) {
  const SamplingParams& p = *seq.params;
  kernels::SampleRowParams row;
  row.temperature = p.temperature;
  row.top_k = p.top_k;
  row.top_p = p.top_p;
  row.min_p = p.min_p;
  row.num_logprobs = p.logprobs;
  row.edits_begin = static_cast<int32_t>(edits->size());
  // slot_[t]: t's edit in *edits, -1 between calls.
  slot_.resize(vocab, -1);
  auto edit = [&](int32_t token) -> kernels::LogitEdit& {
    if (slot_[token] < 0) {
      slot_[token] = static_cast<int32_t>(edits->size());
      edits->push_back({.token = token});
    }
    return (*edits)[slot_[token]];
  };
  if (seq.num_output_tokens() < p.min_tokens) {
    if (!p.ignore_eos) {
      for (int32_t id : eos_token_ids_) {
        if (id >= 0 && id < vocab) edit(id).mask = 1;
      }
    }
    for (int32_t id : p.stop_token_ids) edit(id).mask = 1;
  }
  if (p.repetition_penalty != 1.0f) {
    for (int32_t t : seq.tokens) edit(t).repetition = p.repetition_penalty;
  }
  if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
    counts_.resize(vocab, 0);
    for (size_t i = seq.num_prompt_tokens; i < seq.tokens.size(); ++i) ++counts_[seq.tokens[i]];
    for (size_t i = seq.num_prompt_tokens; i < seq.tokens.size(); ++i) {
      const int32_t t = seq.tokens[i];
      if (counts_[t] > 0) {
        edit(t).subtract = p.frequency_penalty * counts_[t] + p.presence_penalty;
        counts_[t] = 0;
      }
    }
  }
  for (const TokenBias& b : p.logit_bias) edit(b.token).bias = b.bias;
  row.edits_end = static_cast<int32_t>(edits->size());
  for (int e = row.edits_begin; e < row.edits_end; ++e) slot_[(*edits)[e].token] = -1;
  if (!p.greedy()) row.uniform = seq.rng.Uniform();
  return row;
}

int32_t Sampler::SampleDraft(std::span<float> logits, Sequence& seq, DraftDistribution* q) {
  const SamplingParams& p = *seq.params;
  AdjustLogits(logits, seq);
  double mass = 0;
  const int keep = Truncate(logits, p, /*constrained=*/false, &mass);
  // Its kMaxDraftCandidates most likely tokens (ties to the lowest id), renormalised.
  const int n = std::min(keep, kMaxDraftCandidates);
  order_.resize(keep);
  for (int i = 0; i < keep; ++i) order_[i] = i;
  std::partial_sort(order_.begin(), order_.begin() + n, order_.end(), [&](int a, int b) {
    return probs_[a] > probs_[b] || (probs_[a] == probs_[b] && candidates_[a] < candidates_[b]);
  });
  q->ids.resize(n);
  q->probs.resize(n);
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += probs_[order_[i]];
  for (int i = 0; i < n; ++i) {
    q->ids[i] = candidates_[order_[i]];
    q->probs[i] = static_cast<float>(probs_[order_[i]] / sum);
  }
  double total = 0;
  for (float v : q->probs) total += v;
  return Draw(q->ids.data(), q->probs.data(), n, total, seq.rng);
}

int32_t Sampler::Sample(std::span<float> logits, Sequence& seq, int32_t draft,
                        const grammar::TokenMask* grammar_mask, const DraftDistribution* q) {
  const SamplingParams& p = *seq.params;
  const int vocab = static_cast<int>(logits.size());
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  // Logprobs describe the model's own distribution, so they are taken before any change.
  float log_z = 0.0f;
  if (p.logprobs >= 0) {
    raw_logits_.assign(logits.begin(), logits.end());
    log_z = kernels::LogSumExp(logits.data(), vocab);
    seq.last_top_logprobs.clear();
    if (p.logprobs > 0) {
      const int k = kernels::TopTokens(logits.data(), vocab, p.logprobs, candidates_);
      for (int i = 0; i < k; ++i) {
        seq.last_top_logprobs.push_back({candidates_[i], logits[candidates_[i]] - log_z});
      }
    }
  }

  AdjustLogits(logits, seq);

  // A constrained sequence draws among the tokens its grammar allows (those with a finite
  // logit once min_tokens masked some); with none finite, the lowest allowed id.
  const bool constrained = seq.matcher != nullptr;
  int32_t fallback = -1;
  if (constrained) {
    if (grammar_mask == nullptr) {
      seq.matcher->FillNextTokenMask(mask_);
      grammar_mask = &mask_;
    }
    const grammar::TokenMask& mask = *grammar_mask;
    candidates_.clear();
    for (int w = 0; w * 64 < vocab; ++w) {
      uint64_t bits = w < static_cast<int>(mask.size()) ? mask[w] : 0;
      const int end = std::min(64, vocab - w * 64);
      if (end < 64) bits &= (uint64_t{1} << end) - 1;
      for (int b = 0; b < end; ++b) {
        const int id = w * 64 + b;
        if (((bits >> b) & 1) == 0) {
          logits[id] = kNegInf;
          continue;
        }
        if (fallback < 0) fallback = id;
        if (logits[id] > kNegInf) candidates_.push_back(id);
      }
    }
    if (candidates_.empty()) {
      if (p.logprobs >= 0 && fallback >= 0) seq.last_logprob = raw_logits_[fallback] - log_z;
      return fallback;
    }
  }

  int32_t chosen = 0;
  if (p.greedy()) {
    float best = kNegInf;
    if (constrained) {
      chosen = candidates_.front();
      for (int32_t i : candidates_) {
        if (logits[i] > best) {
          best = logits[i];
          chosen = i;
        }
      }
    } else {
      chosen = kernels::ArgmaxToken(logits.data(), vocab);
    }
  } else {
    double mass = 0;
    int keep = Truncate(logits, p, constrained, &mass);
    // The draft's place among p's candidates; -1: p gives it nothing.
    int at = -1;
    for (int i = 0; draft >= 0 && i < keep; ++i) {
      if (candidates_[i] == draft) at = i;
    }
    if (draft >= 0 && q != nullptr && !q->ids.empty()) {
      // A sampled draft x ~ q: accept with probability min(1, p(x) / q(x)); else draw from the
      // residual max(p - q, 0), renormalised (p's mass here is `mass`, not yet divided out).
      const double p_draft = at >= 0 ? probs_[at] / mass : 0.0;
      const double q_draft = q->Probability(draft);
      if (seq.rng.Uniform() * q_draft < p_draft) {
        if (p.logprobs >= 0) seq.last_logprob = raw_logits_[draft] - log_z;
        return draft;
      }
      // The residual over p's candidates: p where q has nothing, max(p - q, 0) on q's tokens
      // (found through slot_, the index of each candidate, reset to -1 after).
      residual_.resize(keep);
      slot_.resize(vocab, -1);
      for (int i = 0; i < keep; ++i) {
        residual_[i] = static_cast<float>(probs_[i] / mass);
        slot_[candidates_[i]] = i;
      }
      for (size_t j = 0; j < q->ids.size(); ++j) {
        const int i = slot_[q->ids[j]];
        if (i >= 0) residual_[i] = std::max(0.0f, residual_[i] - q->probs[j]);
      }
      double residual = 0;
      for (int i = 0; i < keep; ++i) {
        residual += residual_[i];
        slot_[candidates_[i]] = -1;
      }
      // p <= q everywhere (p = q up to rounding) leaves no residual: draw from p as it is.
      if (residual > 0) {
        std::copy(residual_.begin(), residual_.begin() + keep, probs_.begin());
        mass = residual;
      }
    } else if (draft >= 0) {
      // A point-mass draft: accept with probability p(draft); else draw from p without it.
      if (at >= 0) {
        if (seq.rng.Uniform() * mass < probs_[at]) {
          if (p.logprobs >= 0) seq.last_logprob = raw_logits_[draft] - log_z;
          return draft;
        }
        mass -= probs_[at];
        probs_[at] = 0.0f;
        if (!(mass > 0)) {
          // Rounding left no other token: the draft was p's only token after all.
          if (p.logprobs >= 0) seq.last_logprob = raw_logits_[draft] - log_z;
          return draft;
        }
      }
    }
    chosen = Draw(candidates_.data(), probs_.data(), keep, mass, seq.rng);
  }

  if (p.logprobs >= 0) seq.last_logprob = raw_logits_[chosen] - log_z;
  return chosen;
}

}  // namespace tandem::engine
