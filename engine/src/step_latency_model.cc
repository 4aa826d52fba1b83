#include "tandem/engine/step_latency_model.h"

#include <algorithm>
#include <cmath>

#include "tandem/base/status_macros.h"

namespace tandem::engine {

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
  Sample s{{1.0, static_cast<double>(batch_tokens), static_cast<double>(batch_seqs),
            static_cast<double>(context_tokens)},
           seconds};
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
  constexpr int k = kNumTerms;
  const size_t n = samples_.size();
  // Columns scaled to [0, 1] by their largest value, so one ridge term fits every unit.
  std::array<double, k> scale{};
  for (const Sample& s : samples_) {
    for (int j = 0; j < k; ++j) scale[j] = std::max(scale[j], std::abs(s.x[j]));
  }
  for (double& v : scale) v = v > 0 ? v : 1.0;
  // Oldest first: in a full ring the oldest sits at next_.
  double a[k][k] = {};
  double b[k] = {};
  double total_weight = 0;
  double w = 1.0;
  for (size_t i = 0; i < n; ++i) {
    const Sample& s = samples_[(next_ + n - 1 - i) % n];  // newest first
    std::array<double, k> x;
    for (int j = 0; j < k; ++j) x[j] = s.x[j] / scale[j];
    for (int r = 0; r < k; ++r) {
      for (int c = 0; c < k; ++c) a[r][c] += w * x[r] * x[c];
      b[r] += w * x[r] * s.seconds;
    }
    total_weight += w;
    w *= options_.decay;
  }
  const double ridge = 1e-7 * total_weight;
  for (int j = 0; j < k; ++j) a[j][j] += ridge;
  // Gaussian elimination with partial pivoting (the matrix is symmetric positive definite).
  for (int col = 0; col < k; ++col) {
    int pivot = col;
    for (int r = col + 1; r < k; ++r) {
      if (std::abs(a[r][col]) > std::abs(a[pivot][col])) pivot = r;
    }
    if (std::abs(a[pivot][col]) < 1e-300) return;  // keep the previous fit
    if (pivot != col) {
      for (int c = 0; c < k; ++c) std::swap(a[col][c], a[pivot][c]);
      std::swap(b[col], b[pivot]);
    }
    for (int r = col + 1; r < k; ++r) {
      const double f = a[r][col] / a[col][col];
      for (int c = col; c < k; ++c) a[r][c] -= f * a[col][c];
      b[r] -= f * b[col];
    }
  }
  std::array<double, k> beta{};
  for (int r = k - 1; r >= 0; --r) {
    double v = b[r];
    for (int c = r + 1; c < k; ++c) v -= a[r][c] * beta[c];
    beta[r] = v / a[r][r];
  }
  for (int j = 0; j < k; ++j) {
    if (!std::isfinite(beta[j])) return;
  }
  for (int j = 0; j < k; ++j) coef_[j] = beta[j] / scale[j];
}

double StepLatencyModel::Predict(int64_t batch_tokens, int64_t batch_seqs,
                                 int64_t context_tokens) const {
  const double t = coef_[kIntercept] + coef_[kPerToken] * static_cast<double>(batch_tokens) +
                   coef_[kPerSeq] * static_cast<double>(batch_seqs) +
                   coef_[kPerContextToken] * static_cast<double>(context_tokens);
  return std::max(0.0, t);
}

int DecodeBatchLimit(const StepLatencyModel& model, std::span<const int64_t> contexts, int max_seqs,
                     double target_seconds) {
  if (!model.ready() || !(target_seconds > 0) || max_seqs <= 1) return std::max(1, max_seqs);
  int64_t sum = 0;
  for (int64_t c : contexts) sum += c;
  const int64_t mean = contexts.empty() ? 0 : sum / static_cast<int64_t>(contexts.size());
  int best = 1;
  int64_t context = 0;
  for (int n = 1; n <= max_seqs; ++n) {
    context += n <= static_cast<int>(contexts.size()) ? contexts[n - 1] : mean;
    if (model.Predict(n, n, context) <= target_seconds) best = n;
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
