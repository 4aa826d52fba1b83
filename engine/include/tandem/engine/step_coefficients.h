// The one model of an engine step's time. Part of the engine API: EngineStats reports the
// engine's current fit, and the capacity planner fits the same model offline.
#pragma once

#include <array>

namespace tandem::engine {

// Step time as a linear function of the step's shape,
//   t = intercept + per_token * tokens + per_seq * seqs + per_context_token * context,
// where `tokens` are the step's new tokens (prompt chunks and decodes), `seqs` its sequences
// and `context` the sum over those sequences of the tokens their attention reads (computed
// tokens plus the step's new ones). The one model of step time: the engine's online fit
// (StepLatencyModel) and the capacity planner's offline fit (`tandem plan`) both produce it.
struct StepCoefficients {
  double intercept = 0;          // seconds
  double per_token = 0;          // seconds per batch token
  double per_seq = 0;            // seconds per sequence
  double per_context_token = 0;  // seconds per context token read
  // Never negative.
  double Seconds(double tokens, double seqs, double context) const;
  // {intercept, per_token, per_seq, per_context_token}.
  std::array<double, 4> terms() const { return {intercept, per_token, per_seq, per_context_token}; }
};

}  // namespace tandem::engine
