// An online model of one engine step's latency, and the SLO-driven batch limits derived from it.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "tandem/engine/step_coefficients.h"

namespace tandem::engine {

// One measured step, with its weight in a fit.
struct StepObservation {
  double tokens = 0;
  double seqs = 0;
  double context = 0;
  double seconds = 0;
  double weight = 1;
};

struct StepFitOptions {
  // Ridge term, relative to the total weight, over columns scaled to [0, 1]: keeps the fit
  // defined when the shapes seen do not separate the terms. 0: plain least squares, where a
  // term the others explain (or that no step exercised) is left at 0 instead.
  double ridge = 0;
  // Fix a term the fit makes negative at 0 and refit the rest (an offline fit to noisy
  // steps; a negative cost per token would extrapolate badly).
  bool non_negative = false;
};

// Weighted least squares of the four coefficients to `steps`. nullopt when there is nothing to
// fit (no step with positive weight) or the solve fails numerically.
std::optional<StepCoefficients> FitStepCoefficients(std::span<const StepObservation> steps,
                                                    const StepFitOptions& options);

// StepCoefficients learnt online: fitted by weighted least squares over the last `window`
// measured steps, each weighted decay^age so that the fit follows a drifting machine
// (another engine on the same cores, a longer context), refitted on every observation (a 4x4
// solve; nothing next to a forward pass). A tiny ridge term keeps the fit defined when the
// shapes seen do not separate the terms (a decode-only engine has batch_tokens == batch_seqs):
// predictions along the shapes seen stay right, and the terms seen apart are learnt apart.
class StepLatencyModel {
 public:
  static constexpr int kNumTerms = 4;

  struct Options {
    int window = 256;      // measured steps kept
    double decay = 0.99;   // weight of a sample relative to the next newer one (memory ~100)
    int min_samples = 20;  // ready() from this many observations on
  };

  StepLatencyModel() : StepLatencyModel(Options{}) {}
  explicit StepLatencyModel(Options options);

  // Adds one measured step and refits.
  void Observe(int64_t batch_tokens, int64_t batch_seqs, int64_t context_tokens, double seconds);
  // Predicted seconds of a step of that shape (never negative); 0 before the first observation.
  double Predict(int64_t batch_tokens, int64_t batch_seqs, int64_t context_tokens) const;
  // Enough observations for the controllers to trust Predict.
  bool ready() const { return num_observed_ >= options_.min_samples; }
  int64_t num_observed() const { return num_observed_; }
  const StepCoefficients& coefficients() const { return coef_; }
  // Mean of |predicted - measured| / measured over recent steps (exponentially weighted, 0.1
  // per step), each step predicted before it was added; 0 until ready().
  double error_ratio() const { return error_ratio_; }

 private:
  void Refit();

  Options options_;
  std::vector<StepObservation> samples_;  // ring buffer of the last `window` (weights unused)
  size_t next_ = 0;                       // where the next sample goes once full
  int64_t num_observed_ = 0;
  StepCoefficients coef_;
  double error_ratio_ = 0;
  bool have_error_ = false;
};

// The decode controller's rule: the largest batch n in [1, max_seqs] whose predicted decode step
// (n tokens, n sequences, the context of the first n running sequences) takes at most
// `target_seconds`. `contexts` are the running sequences' context lengths in the order the
// scheduler runs them; positions past its end count as their mean. max_seqs while the model is
// not ready or the target is not positive. With speculative decoding each sequence runs
// `tokens_per_seq` tokens (its last one and its draft tokens), all counted in the prediction.
int DecodeBatchLimit(const StepLatencyModel& model, std::span<const int64_t> contexts, int max_seqs,
                     double target_seconds, int tokens_per_seq = 1);

// The prefill controller's rule: the largest token budget in [min_tokens, max_tokens], a multiple
// of `granularity` (or max_tokens itself), whose predicted step (one sequence of that many
// tokens) takes at most `target_seconds`. max_tokens while the model is not ready or the target
// is not positive.
int PrefillTokenBudget(const StepLatencyModel& model, int max_tokens, int min_tokens,
                       int granularity, double target_seconds);

}  // namespace tandem::engine
