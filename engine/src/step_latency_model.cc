#include "tandem/engine/step_latency_model.h"

#include <algorithm>
#include <cmath>

#include "tandem/base/status_macros.h"

namespace tandem::engine {

namespace {

constexpr int kTerms = 4;

std::array<double, kTerms> Features(const StepObservation& s) {
  return {1.0, s.tokens, s.seqs, s.context};
}

// Solves the weighted normal equations over the terms in `active` (the others stay 0), columns
// scaled to [0, 1] by their largest value so that one relative ridge fits every unit. Gaussian
// elimination with partial pivoting. With no ridge, a term that is (numerically) a combination
// of those before it, or that no step exercised, makes the solve fail and is named in `bad`.
bool SolveActive(std::span<const StepObservation> steps, const std::vector<int>& active,
                 double ridge, std::array<double, kTerms>& coef, int& bad) {
  const size_t k = active.size();
  std::array<double, kTerms> scale{};
  for (const StepObservation& s : steps) {
    if (!(s.weight > 0)) continue;
    const auto x = Features(s);
    for (size_t j = 0; j < k; ++j) scale[j] = std::max(scale[j], std::abs(x[active[j]]));
  }
  double a[kTerms][kTerms] = {};
  double b[kTerms] = {};
  double total_weight = 0;
  for (const StepObservation& s : steps) {
    if (!(s.weight > 0)) continue;
    const auto f = Features(s);
    std::array<double, kTerms> x{};
    for (size_t j = 0; j < k; ++j) x[j] = scale[j] > 0 ? f[active[j]] / scale[j] : 0.0;
    for (size_t r = 0; r < k; ++r) {
      for (size_t c = 0; c < k; ++c) a[r][c] += s.weight * x[r] * x[c];
      b[r] += s.weight * x[r] * s.seconds;
    }
    total_weight += s.weight;
  }
  for (size_t j = 0; j < k; ++j) a[j][j] += ridge * total_weight;
  // A pivot this small relative to the total weight: the column adds nothing new.
  const double tiny = ridge > 0 ? 1e-300 : 1e-10 * total_weight;
  for (size_t col = 0; col < k; ++col) {
    size_t pivot = col;
    for (size_t r = col + 1; r < k; ++r) {
      if (std::abs(a[r][col]) > std::abs(a[pivot][col])) pivot = r;
    }
    if (!(std::abs(a[pivot][col]) > tiny)) {
      bad = active[col];
      return false;
    }
    if (pivot != col) {
      for (size_t c = 0; c < k; ++c) std::swap(a[col][c], a[pivot][c]);
      std::swap(b[col], b[pivot]);
    }
    for (size_t r = col + 1; r < k; ++r) {
      const double f = a[r][col] / a[col][col];
      for (size_t c = col; c < k; ++c) a[r][c] -= f * a[col][c];
      b[r] -= f * b[col];
    }
  }
  std::array<double, kTerms> beta{};
  for (size_t r = k; r-- > 0;) {
    double v = b[r];
    for (size_t c = r + 1; c < k; ++c) v -= a[r][c] * beta[c];
    beta[r] = v / a[r][r];
  }
  coef = {};
  for (size_t j = 0; j < k; ++j) {
    if (!std::isfinite(beta[j])) {
      bad = active[j];
      return false;
    }
    coef[active[j]] = scale[j] > 0 ? beta[j] / scale[j] : 0.0;
  }
  return true;
}

}  // namespace

std::optional<StepCoefficients> FitStepCoefficients(std::span<const StepObservation> steps,
                                                    const StepFitOptions& options) {
  if (std::none_of(steps.begin(), steps.end(),
                   [](const StepObservation& s) { return s.weight > 0; })) {
    return std::nullopt;
  }
  std::vector<int> active = {0, 1, 2, 3};
  std::array<double, kTerms> coef{};
  while (!active.empty()) {
    int bad = -1;
    if (!SolveActive(steps, active, options.ridge, coef, bad)) {
      // With a ridge every column is solvable: a failure is numerical, keep nothing.
      if (options.ridge > 0) return std::nullopt;
      active.erase(std::find(active.begin(), active.end(), bad));
      coef = {};
      continue;
    }
    if (!options.non_negative) break;
    int most_negative = -1;
    for (int j : active) {
      if (coef[j] < 0 && (most_negative < 0 || coef[j] < coef[most_negative])) most_negative = j;
    }
    if (most_negative < 0) break;
    active.erase(std::find(active.begin(), active.end(), most_negative));
    coef = {};
  }
  return StepCoefficients{coef[0], coef[1], coef[2], coef[3]};
}

StepLatencyModel::StepLatencyModel(Options options) : options_(options) {
  TANDEM_CHECK(options_.window >= 4 && options_.decay > 0 && options_.decay <= 1);
  samples_.reserve(options_.window);
}

void StepLatencyModel::Observe(int64_t batch_tokens, int64_t batch_seqs, int64_t context_tokens,
                               double seconds) {
  if (!(seconds >= 0) || !std::isfinite(seconds)) return;
  if (ready() && seconds > 0) {
    const double predicted = Predict(batch_tokens, batch_seqs, context_tokens);
    const double error = std::abs(predicted - seconds) / seconds;
    error_ratio_ = have_error_ ? 0.9 * error_ratio_ + 0.1 * error : error;
    have_error_ = true;
  }
  const StepObservation s{static_cast<double>(batch_tokens), static_cast<double>(batch_seqs),
                          static_cast<double>(context_tokens), seconds};
  if (static_cast<int>(samples_.size()) < options_.window) {
    samples_.push_back(s);
  } else {
    samples_[next_] = s;
    next_ = (next_ + 1) % samples_.size();
  }
  ++num_observed_;
  Refit();
}

void StepLatencyModel::Refit() {
  // Each sample weighted decay^age, the newest 1; in a full ring the oldest sits at next_.
  const size_t n = samples_.size();
  std::vector<StepObservation> weighted(samples_);
  double w = 1.0;
  for (size_t i = 0; i < n; ++i) {
    weighted[(next_ + n - 1 - i) % n].weight = w;
    w *= options_.decay;
  }
  // On a numerical failure the previous fit stays.
  if (auto fit = FitStepCoefficients(weighted, {.ridge = 1e-7})) coef_ = *fit;
}

double StepLatencyModel::Predict(int64_t batch_tokens, int64_t batch_seqs,
                                 int64_t context_tokens) const {
  return coef_.Seconds(static_cast<double>(batch_tokens), static_cast<double>(batch_seqs),
                       static_cast<double>(context_tokens));
}

int DecodeBatchLimit(const StepLatencyModel& model, std::span<const int64_t> contexts, int max_seqs,
                     double target_seconds, int tokens_per_seq) {
  tokens_per_seq = std::max(1, tokens_per_seq);
  if (!model.ready() || !(target_seconds > 0) || max_seqs <= 1) return std::max(1, max_seqs);
  int64_t sum = 0;
  for (int64_t c : contexts) sum += c;
  const int64_t mean = contexts.empty() ? 0 : sum / static_cast<int64_t>(contexts.size());
  int best = 1;
  int64_t context = 0;
  for (int n = 1; n <= max_seqs; ++n) {
    context += n <= static_cast<int>(contexts.size()) ? contexts[n - 1] : mean;
    const int64_t tokens = static_cast<int64_t>(n) * tokens_per_seq;
    if (model.Predict(tokens, n, context + tokens - n) <= target_seconds) best = n;
  }
  return best;
}

int PrefillTokenBudget(const StepLatencyModel& model, int max_tokens, int min_tokens,
                       int granularity, double target_seconds) {
  if (!model.ready() || !(target_seconds > 0)) return max_tokens;
  min_tokens = std::clamp(min_tokens, 1, max_tokens);
  granularity = std::max(1, granularity);
  if (model.Predict(max_tokens, 1, max_tokens) <= target_seconds) return max_tokens;
  for (int b = (max_tokens - 1) / granularity * granularity; b > min_tokens; b -= granularity) {
    if (model.Predict(b, 1, b) <= target_seconds) return b;
  }
  return min_tokens;
}

}  // namespace tandem::engine
