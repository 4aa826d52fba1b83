// The sampling flags shared by `tandem generate` and the benchmarking tools.
#pragma once

#include "absl/status/statusor.h"
#include "tandem/engine/sampling_params.h"
#include "tandem/tools/args.h"

namespace tandem::tools {

// --temperature --top-p --top-k --min-p --repetition-penalty --presence-penalty
// --frequency-penalty --seed --max-tokens --min-tokens --ignore-eos --stop TEXT
// --stop-token-ids A,B --n --logprobs.
void DeclareSamplingFlags(Args& args);
// Reads and validates them (ranges are checked by SamplingParams::Validate when added).
absl::StatusOr<engine::SamplingParams> ParseSamplingFlags(const Args& args);

}  // namespace tandem::tools
