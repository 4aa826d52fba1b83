#include "tandem/engine/step_coefficients.h"

#include <algorithm>

namespace tandem::engine {

double StepCoefficients::Seconds(double tokens, double seqs, double context) const {
  return std::max(0.0,
                  intercept + per_token * tokens + per_seq * seqs + per_context_token * context);
}

}  // namespace tandem::engine
