// Test support: steps for a ModelRunner written by hand, as the scheduler would plan them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "tandem/base/status_macros.h"
#include "tandem/engine/block_manager.h"
#include "tandem/engine/scheduler.h"

namespace tandem::testing {

// Adds to `step` every token of `seq` not computed yet, as one sampling entry, after giving
// them KV slots in `seq`'s block table.
inline absl::Status ScheduleRest(engine::BlockManager& blocks, engine::Sequence& seq,
                                 engine::SchedulerStep& step) {
  const int n = static_cast<int>(seq.tokens.size()) - seq.num_computed_tokens;
  TANDEM_RETURN_IF_ERROR(blocks.Append(seq.block_table, seq.num_computed_tokens, n).status());
  step.seqs.push_back({&seq, n, true});
  step.num_tokens += n;
  return absl::OkStatus();
}

// After `step` ran: marks each sequence's tokens computed and appends its greedy token, the
// argmax of its row of `logits` ([step.seqs.size(), vocab], in the step's order).
inline void AppendGreedyTokens(const engine::SchedulerStep& step, std::span<const float> logits,
                               int vocab) {
  for (size_t r = 0; r < step.seqs.size(); ++r) {
    engine::Sequence& seq = *step.seqs[r].seq;
    seq.num_computed_tokens = static_cast<int>(seq.tokens.size());
    const std::span<const float> row = logits.subspan(r * vocab, vocab);
    seq.tokens.push_back(
        static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin()));
  }
}

}  // namespace tandem::testing
