// Test support: steps for a ModelRunner written by hand, as the scheduler would plan them.
#pragma once

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

}  // namespace tandem::testing
