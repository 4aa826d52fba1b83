#include "pool_counters.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::router {
namespace {

WorkerView Decode(const std::string& id, int64_t preemptions, int64_t proposed,
                  std::vector<int64_t> proposed_by_position = {}) {
  WorkerView w;
  w.id = id;
  w.up = true;
  w.stats.set_preemptions_total(preemptions);
  w.stats.set_spec_proposed_tokens(proposed);
  for (int64_t n : proposed_by_position) w.stats.add_spec_proposed_by_position(n);
  return w;
}

WorkerView Prefill(const std::string& id, int64_t queries, int64_t hits) {
  WorkerView w;
  w.id = id;
  w.up = true;
  w.stats.set_prefix_cache_queries_tokens(queries);
  w.stats.set_prefix_cache_hits_tokens(hits);
  return w;
}

TEST(PoolCountersTest, SumsEachPoolsOwnCounters) {
  PoolCounters counters;
  PoolSnapshot pools;
  pools.decode = {Decode("d1", 3, 40, {10, 8}), Decode("d2", 1, 20, {5, 5, 1})};
  pools.prefill = {Prefill("p1", 1000, 600)};
  // A prefill worker's speculation counters (none in practice) and a decode worker's prefix
  // cache are not the pool's: prompts are computed on prefill workers, tokens on decode ones.
  pools.prefill[0].stats.set_preemptions_total(99);
  pools.decode[0].stats.set_prefix_cache_hits_tokens(77);
  engine::EngineStats s = counters.Observe(pools);
  EXPECT_EQ(s.preemptions, 4);
  EXPECT_EQ(s.spec_proposed_tokens, 60);
  EXPECT_EQ(s.spec_proposed_by_position, (std::vector<int64_t>{15, 13, 1}));
  EXPECT_EQ(s.prefix_cache_queries_tokens, 1000);
  EXPECT_EQ(s.prefix_cache_hits_tokens, 600);
}

// Tokens are drawn on both pools: a prefill worker draws each request's first token.
TEST(PoolCountersTest, SampledTokensSumBothPools) {
  PoolCounters counters;
  PoolSnapshot pools;
  pools.decode = {Decode("d1", 0, 0), Decode("d2", 0, 0)};
  pools.prefill = {Prefill("p1", 0, 0)};
  pools.decode[0].stats.set_backend_sampled_tokens(500);
  pools.decode[1].stats.set_backend_sampled_tokens(300);
  pools.decode[1].stats.set_host_sampled_tokens(7);
  pools.prefill[0].stats.set_backend_sampled_tokens(40);
  pools.prefill[0].stats.set_host_sampled_tokens(2);
  const engine::EngineStats s = counters.Observe(pools);
  EXPECT_EQ(s.backend_sampled_tokens, 840);
  EXPECT_EQ(s.host_sampled_tokens, 9);
}

// Step graphs replay only decode steps: the decode pool's count.
TEST(PoolCountersTest, GraphStepsSumTheDecodePool) {
  PoolCounters counters;
  PoolSnapshot pools;
  pools.decode = {Decode("d1", 0, 0), Decode("d2", 0, 0)};
  pools.prefill = {Prefill("p1", 0, 0)};
  pools.decode[0].stats.set_graph_steps(900);
  pools.decode[1].stats.set_graph_steps(100);
  pools.prefill[0].stats.set_graph_steps(5);
  EXPECT_EQ(counters.Observe(pools).graph_steps, 1000);
  // d2 restarts: its count from 0 adds to the 100 it had.
  pools.decode[1].stats.set_graph_steps(30);
  pools.decode[0].stats.set_graph_steps(950);
  EXPECT_EQ(counters.Observe(pools).graph_steps, 950 + 100 + 30);
}

// What Prometheus requires of a counter: it never goes down while the router runs, whatever
// the pools do.
TEST(PoolCountersTest, LeavingRestartingAndReturningWorkersNeverLowerTheTotals) {
  PoolCounters counters;
  PoolSnapshot pools;
  pools.decode = {Decode("d1", 10, 100), Decode("d2", 5, 50)};
  EXPECT_EQ(counters.Observe(pools).preemptions, 15);

  // d2 leaves: its 5 stay counted.
  pools.decode = {Decode("d1", 12, 120)};
  EXPECT_EQ(counters.Observe(pools).preemptions, 17);

  // d1 restarts under the same id, its counters from 0: the new ones add to the old.
  pools.decode = {Decode("d1", 2, 10)};
  engine::EngineStats s = counters.Observe(pools);
  EXPECT_EQ(s.preemptions, 12 + 2 + 5);
  EXPECT_EQ(s.spec_proposed_tokens, 120 + 10 + 50);

  // d2 comes back as the same process (its counters went on from 5): counted once.
  pools.decode = {Decode("d1", 3, 10), Decode("d2", 7, 70)};
  EXPECT_EQ(counters.Observe(pools).preemptions, 12 + 3 + 7);

  // A worker that stops answering keeps what it last said, however its view reads meanwhile.
  pools.decode[1].up = false;
  pools.decode[1].stats.Clear();
  EXPECT_EQ(counters.Observe(pools).preemptions, 12 + 3 + 7);
  pools.decode[1] = Decode("d2", 8, 80);
  EXPECT_EQ(counters.Observe(pools).preemptions, 12 + 3 + 8);
}

TEST(PoolCountersTest, ARestartSeenInOnePositionCountsTheWholeProcessAgain) {
  PoolCounters counters;
  PoolSnapshot pools;
  pools.decode = {Decode("d1", 0, 30, {20, 10})};
  counters.Observe(pools);
  // Fewer accepted-by-position entries but more proposed: only a new process can do that.
  pools.decode = {Decode("d1", 0, 31, {4})};
  engine::EngineStats s = counters.Observe(pools);
  EXPECT_EQ(s.spec_proposed_tokens, 30 + 31);
  EXPECT_EQ(s.spec_proposed_by_position, (std::vector<int64_t>{24, 10}));
}

}  // namespace
}  // namespace tandem::router
