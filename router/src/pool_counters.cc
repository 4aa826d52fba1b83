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

template <typename Repeated>
std::vector<int64_t> ToVector(const Repeated& field) {
  return std::vector<int64_t>(field.begin(), field.end());
}

}  // namespace

bool PoolCounters::Counts::Restarted(const Counts& earlier) const {
  return preemptions < earlier.preemptions || spec_proposed < earlier.spec_proposed ||
         spec_accepted < earlier.spec_accepted || spec_verify_steps < earlier.spec_verify_steps ||
         prefix_queries < earlier.prefix_queries || prefix_hits < earlier.prefix_hits ||
         AnyBelow(proposed_by_position, earlier.proposed_by_position) ||
         AnyBelow(accepted_by_position, earlier.accepted_by_position);
}

void PoolCounters::Counts::Add(const Counts& other) {
  preemptions += other.preemptions;
  spec_proposed += other.spec_proposed;
  spec_accepted += other.spec_accepted;
  spec_verify_steps += other.spec_verify_steps;
  prefix_queries += other.prefix_queries;
  prefix_hits += other.prefix_hits;
  AddTo(proposed_by_position, other.proposed_by_position);
  AddTo(accepted_by_position, other.accepted_by_position);
}

PoolCounters::Counts PoolCounters::Read(const tandem::v1::WorkerStats& stats) {
  Counts c;
  c.preemptions = stats.preemptions_total();
  c.spec_proposed = stats.spec_proposed_tokens();
  c.spec_accepted = stats.spec_accepted_tokens();
  c.spec_verify_steps = stats.spec_verify_steps();
  c.prefix_queries = stats.prefix_cache_queries_tokens();
  c.prefix_hits = stats.prefix_cache_hits_tokens();
  c.proposed_by_position = ToVector(stats.spec_proposed_by_position());
  c.accepted_by_position = ToVector(stats.spec_accepted_by_position());
  return c;
}

engine::EngineStats PoolCounters::Observe(const PoolSnapshot& pools) {
  std::lock_guard<std::mutex> lock(mu_);
  auto observe = [&](const char* role, const std::vector<WorkerView>& pool, bool decode) {
    for (const WorkerView& w : pool) {
      // A worker not answering keeps what it last said (and one not yet polled says nothing).
      if (!w.up) continue;
      Counts now = Read(w.stats);
      // Where tokens are generated: the decode pool's preemptions and speculation; where
      // prompts are computed: the prefill pool's prefix cache.
      if (decode) {
        now.prefix_queries = now.prefix_hits = 0;
      } else {
        now.preemptions = now.spec_proposed = now.spec_accepted = now.spec_verify_steps = 0;
        now.proposed_by_position.clear();
        now.accepted_by_position.clear();
      }
      Worker& worker = workers_[absl::StrCat(role, "/", w.id)];
      if (now.Restarted(worker.last)) worker.earlier.Add(worker.last);
      worker.last = std::move(now);
    }
  };
  observe("decode", pools.decode, true);
  observe("prefill", pools.prefill, false);
  Counts total;
  for (const auto& [id, worker] : workers_) {
    total.Add(worker.earlier);
    total.Add(worker.last);
  }
  engine::EngineStats stats;
  stats.preemptions = total.preemptions;
  stats.spec_proposed_tokens = total.spec_proposed;
  stats.spec_accepted_tokens = total.spec_accepted;
  stats.spec_verify_steps = total.spec_verify_steps;
  stats.spec_proposed_by_position = std::move(total.proposed_by_position);
  stats.spec_accepted_by_position = std::move(total.accepted_by_position);
  stats.prefix_cache_queries_tokens = total.prefix_queries;
  stats.prefix_cache_hits_tokens = total.prefix_hits;
  return stats;
}

}  // namespace tandem::router
