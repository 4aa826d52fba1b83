// The pools' cumulative counters (preemptions, prefix cache tokens, speculation) summed over
// their workers so that the sum never goes down: a worker that leaves keeps its share, a worker
// that restarts under the same id (its counters back at 0) adds its new counts to its old, and
// one that comes back as the same process (counters where they were) is not counted twice.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "tandem/engine/request.h"
#include "placement.h"

namespace tandem::router {

class PoolCounters {
 public:
  // Folds in the counters of every worker in `pools` and returns the totals: the counter
  // fields of EngineStats (preemptions and speculation from the decode pool, prefix cache
  // tokens from the prefill pool); the other fields are left at 0. Any thread.
  engine::EngineStats Observe(const PoolSnapshot& pools);

 private:
  // Only the counter fields of EngineStats are used (see Observe).
  struct Worker {
    engine::EngineStats earlier;  // the sum of this id's previous processes
    engine::EngineStats last;     // its current process, as last seen
  };

  std::mutex mu_;
  // By role and id; kept after a worker leaves (the id may come back), a few hundred bytes each.
  absl::flat_hash_map<std::string, Worker> workers_;  // guarded by mu_
};

}  // namespace tandem::router
