#include "tandem/kernels/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace tandem::kernels {

int32_t ArgmaxToken(const float* logits, int vocab) {
  float best = -std::numeric_limits<float>::infinity();
  int32_t chosen = 0;
  for (int i = 0; i < vocab; ++i) {
    if (logits[i] > best) {
      best = logits[i];
      chosen = i;
    }
  }
  return chosen;
}

float LogSumExp(const float* logits, int vocab) {
  const float max = *std::max_element(logits, logits + vocab);
  double sum = 0;
  for (int i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(logits[i] - max));
  return max + static_cast<float>(std::log(sum));
}

int TopTokens(const float* logits, int vocab, int k, std::vector<int32_t>& ids) {
  ids.resize(vocab);
  for (int i = 0; i < vocab; ++i) ids[i] = i;
  k = std::min(k, vocab);
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  return k;
}

int TruncateCandidates(const float* logits, int vocab, float temperature, int top_k, float top_p,
                       float min_p, bool constrained, std::vector<int32_t>& candidates,
                       std::vector<float>& probs, double* mass_out) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  if (!constrained) {
    candidates.resize(vocab);
    for (int i = 0; i < vocab; ++i) candidates[i] = i;
  }
  const int num = static_cast<int>(candidates.size());
  auto by_logit = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  int keep = num;
  if (top_k > 0 && top_k < num) keep = top_k;
  // Unsorted, only the maximum is needed for a stable softmax; the draw's order is then id
  // order, which is just as fixed.
  if (top_p < 1.0f || keep < num) {
    std::partial_sort(candidates.begin(), candidates.begin() + keep, candidates.end(), by_logit);
  }
  candidates.resize(keep);
  float max = kNegInf;
  for (int32_t c : candidates) max = std::max(max, logits[c]);
  probs.resize(keep);
  double sum = 0;
  const double inv_t = 1.0 / temperature;
  for (int i = 0; i < keep; ++i) {
    const double e = std::exp((static_cast<double>(logits[candidates[i]]) - max) * inv_t);
    probs[i] = static_cast<float>(e);
    sum += e;
  }
  for (int i = 0; i < keep; ++i) probs[i] = static_cast<float>(probs[i] / sum);
  if (top_p < 1.0f) {
    // The shortest prefix (by descending probability) whose mass reaches top_p.
    double cum = 0;
    int cut = keep;
    for (int i = 0; i < keep; ++i) {
      cum += probs[i];
      if (cum >= top_p) {
        cut = i + 1;
        break;
      }
    }
    keep = cut;
  }
  if (min_p > 0.0f) {
    float top = 0;
    for (int i = 0; i < keep; ++i) top = std::max(top, probs[i]);
    const float threshold = min_p * top;
    int w = 0;
    for (int i = 0; i < keep; ++i) {
      if (probs[i] >= threshold) {
        candidates[w] = candidates[i];
        probs[w] = probs[i];
        ++w;
      }
    }
    keep = w;
  }
  double mass = 0;
  for (int i = 0; i < keep; ++i) mass += probs[i];
  *mass_out = mass;
  return keep;
}

int32_t DrawCandidate(const int32_t* ids, const float* probs, int n, double mass,
                      double uniform) {
  const double u = uniform * mass;
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

TokenLogprob SampleRowReference(float* logits, int vocab, const SampleRowParams& p,
                                const LogitEdit* edits, SampleRowScratch& scratch,
                                TokenLogprob* top) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  // Log-probabilities describe the model's own distribution: taken before any edit.
  float log_z = 0.0f;
  if (p.num_logprobs >= 0) {
    scratch.raw.assign(logits, logits + vocab);
    log_z = LogSumExp(logits, vocab);
    if (p.num_logprobs > 0) {
      const std::vector<int32_t>& ids = scratch.candidates;
      const int k = TopTokens(logits, vocab, p.num_logprobs, scratch.candidates);
      for (int i = 0; i < k; ++i) top[i] = {ids[i], logits[ids[i]] - log_z};
    }
  }
  for (int e = p.edits_begin; e < p.edits_end; ++e) {
    const LogitEdit& edit = edits[e];
    float& l = logits[edit.token];
    if (edit.mask != 0) l = kNegInf;
    if (edit.repetition != 1.0f) l = l > 0 ? l / edit.repetition : l * edit.repetition;
    l -= edit.subtract;
    l += edit.bias;
  }
  int32_t chosen = 0;
  if (p.temperature == 0.0f) {
    chosen = ArgmaxToken(logits, vocab);
  } else {
    double mass = 0;
    const int keep = TruncateCandidates(logits, vocab, p.temperature, p.top_k, p.top_p, p.min_p,
                                        /*constrained=*/false, scratch.candidates, scratch.probs,
                                        &mass);
    chosen = DrawCandidate(scratch.candidates.data(), scratch.probs.data(), keep, mass, p.uniform);
  }
  TokenLogprob result{chosen, 0.0f};
  if (p.num_logprobs >= 0) result.logprob = scratch.raw[chosen] - log_z;
  return result;
}

}  // namespace tandem::kernels
