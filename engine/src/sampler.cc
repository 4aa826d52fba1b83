#include "tandem/engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"

namespace tandem::engine {

namespace {
uint64_t SplitMix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
uint64_t Rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

// A draw from ids[0..n) with weights probs (summing to `mass`). Should rounding put the draw past
// the last sum: the last id with any weight.
int32_t Draw(const int32_t* ids, const float* probs, int n, double mass, SamplerRng& rng) {
  const double u = rng.Uniform() * mass;
  int32_t chosen = ids[n - 1];
  for (int i = n - 1; i >= 0; --i) {
    if (probs[i] > 0) {
      chosen = ids[i];
      break;
    }
  }
  double cum = 0;
  for (int i = 0; i < n; ++i) {
    cum += probs[i];
    if (u < cum) return ids[i];
  }
  return chosen;
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
                      double* mass_out) {
  const int vocab = static_cast<int>(logits.size());
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  // Candidates sorted by logit (ties by id), truncated by top-k, then softmax.
  if (!constrained) {
    candidates_.resize(vocab);
    for (int i = 0; i < vocab; ++i) candidates_[i] = i;
  }
  const int num = static_cast<int>(candidates_.size());
  auto by_logit = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  int keep = num;
  if (p.top_k > 0 && p.top_k < num) keep = p.top_k;
  if (p.top_p < 1.0f || keep < num) {
    std::partial_sort(candidates_.begin(), candidates_.begin() + keep, candidates_.end(),
                      by_logit);
  } else {
    // Only the maximum is needed for a stable softmax; order does not matter for the draw
    // as long as it is fixed, and id order is fixed.
    keep = num;
  }
  candidates_.resize(keep);
  float max = kNegInf;
  for (int32_t c : candidates_) max = std::max(max, logits[c]);
  probs_.resize(keep);
  double sum = 0;
  const double inv_t = 1.0 / p.temperature;
  for (int i = 0; i < keep; ++i) {
    double e = std::exp((static_cast<double>(logits[candidates_[i]]) - max) * inv_t);
    probs_[i] = static_cast<float>(e);
    sum += e;
  }
  for (int i = 0; i < keep; ++i) probs_[i] = static_cast<float>(probs_[i] / sum);
  if (p.top_p < 1.0f) {
    // Smallest prefix (by descending probability) whose mass reaches top_p.
    double cum = 0;
    int cut = keep;
    for (int i = 0; i < keep; ++i) {
      cum += probs_[i];
      if (cum >= p.top_p) {
        cut = i + 1;
        break;
      }
    }
    keep = cut;
  }
  if (p.min_p > 0.0f) {
    float top = 0;
    for (int i = 0; i < keep; ++i) top = std::max(top, probs_[i]);
    float threshold = p.min_p * top;
    int w = 0;
    for (int i = 0; i < keep; ++i) {
      if (probs_[i] >= threshold) {
        candidates_[w] = candidates_[i];
        probs_[w] = probs_[i];
        ++w;
      }
    }
    keep = w;
  }
  double mass = 0;
  for (int i = 0; i < keep; ++i) mass += probs_[i];
  *mass_out = mass;
  return keep;
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
    float max = *std::max_element(logits.begin(), logits.end());
    double sum = 0;
    for (float l : logits) sum += std::exp(static_cast<double>(l - max));
    log_z = max + static_cast<float>(std::log(sum));
    seq.last_top_logprobs.clear();
    if (p.logprobs > 0) {
      candidates_.resize(vocab);
      for (int i = 0; i < vocab; ++i) candidates_[i] = i;
      int k = std::min(p.logprobs, vocab);
      std::partial_sort(candidates_.begin(), candidates_.begin() + k, candidates_.end(),
                        [&](int32_t a, int32_t b) {
                          return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
                        });
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
      for (int i = 0; i < vocab; ++i) {
        if (logits[i] > best) {
          best = logits[i];
          chosen = i;
        }
      }
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
