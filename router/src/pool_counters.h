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
  struct Counts {
    int64_t preemptions = 0;
    int64_t spec_proposed = 0;
    int64_t spec_accepted = 0;
    int64_t spec_verify_steps = 0;
    int64_t prefix_queries = 0;
    int64_t prefix_hits = 0;
    std::vector<int64_t> proposed_by_position;
    std::vector<int64_t> accepted_by_position;

    // Some counter is below `earlier`'s: a new process under the same id.
    bool Restarted(const Counts& earlier) const;
    void Add(const Counts& other);
  };
  struct Worker {
    Counts earlier;  // the sum of this id's previous processes
    Counts last;     // its current process, as last seen
  };
  static Counts Read(const tandem::v1::WorkerStats& stats);

  std::mutex mu_;
  // By role and id; kept after a worker leaves (the id may come back), a few hundred bytes each.
  absl::flat_hash_map<std::string, Worker> workers_;  // guarded by mu_
};

}  // namespace tandem::router
