#include "pool_counters.h"

#include "absl/strings/str_cat.h"

namespace tandem::router {
namespace {

bool AnyBelow(const std::vector<int64_t>& now, const std::vector<int64_t>& earlier) {
  for (size_t i = 0; i < earlier.size(); ++i) {
    if ((i < now.size() ? now[i] : 0) < earlier[i]) return true;
  }
  return false;
}

void AddTo(std::vector<int64_t>& to, const std::vector<int64_t>& from) {
  if (to.size() < from.size()) to.resize(from.size());
  for (size_t i = 0; i < from.size(); ++i) to[i] += from[i];
}

// Some counter is below `earlier`'s: a new process under the same id.
bool Restarted(const engine::EngineStats& now, const engine::EngineStats& earlier) {
  return now.preemptions < earlier.preemptions ||
         now.spec_proposed_tokens < earlier.spec_proposed_tokens ||
         now.spec_accepted_tokens < earlier.spec_accepted_tokens ||
         now.spec_verify_steps < earlier.spec_verify_steps ||
         now.prefix_cache_queries_tokens < earlier.prefix_cache_queries_tokens ||
         now.prefix_cache_hits_tokens < earlier.prefix_cache_hits_tokens ||
         now.backend_sampled_tokens < earlier.backend_sampled_tokens ||
         now.host_sampled_tokens < earlier.host_sampled_tokens ||
         now.graph_steps < earlier.graph_steps ||
         AnyBelow(now.spec_proposed_by_position, earlier.spec_proposed_by_position) ||
         AnyBelow(now.spec_accepted_by_position, earlier.spec_accepted_by_position);
}

void AddCounters(engine::EngineStats& to, const engine::EngineStats& from) {
  to.preemptions += from.preemptions;
  to.spec_proposed_tokens += from.spec_proposed_tokens;
  to.spec_accepted_tokens += from.spec_accepted_tokens;
  to.spec_verify_steps += from.spec_verify_steps;
  to.prefix_cache_queries_tokens += from.prefix_cache_queries_tokens;
  to.prefix_cache_hits_tokens += from.prefix_cache_hits_tokens;
  to.backend_sampled_tokens += from.backend_sampled_tokens;
  to.host_sampled_tokens += from.host_sampled_tokens;
  to.graph_steps += from.graph_steps;
  AddTo(to.spec_proposed_by_position, from.spec_proposed_by_position);
  AddTo(to.spec_accepted_by_position, from.spec_accepted_by_position);
}

// The counters a pool's worker contributes: where tokens are generated, the decode pool's
// preemptions and speculation; where prompts are computed, the prefill pool's prefix cache;
// from both, the tokens drawn (a prefill worker draws the first) and the steps replayed from
// step graphs (only decode steps replay them).
engine::EngineStats PoolShare(const tandem::v1::WorkerStats& stats, bool decode) {
  engine::EngineStats c;
  c.backend_sampled_tokens = stats.backend_sampled_tokens();
  c.host_sampled_tokens = stats.host_sampled_tokens();
  if (decode) {
    c.preemptions = stats.preemptions_total();
    c.graph_steps = stats.graph_steps();
    c.spec_proposed_tokens = stats.spec_proposed_tokens();
    c.spec_accepted_tokens = stats.spec_accepted_tokens();
    c.spec_verify_steps = stats.spec_verify_steps();
    c.spec_proposed_by_position.assign(stats.spec_proposed_by_position().begin(),
                                       stats.spec_proposed_by_position().end());
    c.spec_accepted_by_position.assign(stats.spec_accepted_by_position().begin(),
                                       stats.spec_accepted_by_position().end());
  } else {
    c.prefix_cache_queries_tokens = stats.prefix_cache_queries_tokens();
    c.prefix_cache_hits_tokens = stats.prefix_cache_hits_tokens();
  }
  return c;
}

}  // namespace

engine::EngineStats PoolCounters::Observe(const PoolSnapshot& pools) {
  std::lock_guard<std::mutex> lock(mu_);
  auto observe = [&](const char* role, const std::vector<WorkerView>& pool, bool decode) {
    for (const WorkerView& w : pool) {
      // A worker not answering keeps what it last said (and one not yet polled says nothing).
      if (!w.up) continue;
      engine::EngineStats now = PoolShare(w.stats, decode);
      Worker& worker = workers_[absl::StrCat(role, "/", w.id)];
      if (Restarted(now, worker.last)) AddCounters(worker.earlier, worker.last);
      worker.last = std::move(now);
    }
  };
  observe("decode", pools.decode, true);
  observe("prefill", pools.prefill, false);
  engine::EngineStats total;
  for (const auto& [id, worker] : workers_) {
    AddCounters(total, worker.earlier);
    AddCounters(total, worker.last);
  }
  return total;
}

}  // namespace tandem::router
