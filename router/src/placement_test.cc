#include "placement.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace tandem::router {
namespace {

WorkerView Decode(const std::string& id, int total, int used, int running, bool up = true) {
  WorkerView w;
  w.id = id;
  w.address = id;
  w.up = up;
  w.stats.set_kv_blocks_total(total);
  w.stats.set_kv_blocks_used(used);
  w.stats.set_running(running);
  return w;
}

WorkerView Prefill(const std::string& id, int64_t queued, double seconds_per_token = 0.0,
                   int samples = 0, bool up = true) {
  WorkerView w;
  w.id = id;
  w.address = id;
  w.up = up;
  w.stats.set_queued_prefill_tokens(queued);
  w.seconds_per_token = seconds_per_token;
  w.samples = samples;
  return w;
}

std::vector<std::string> Ids(const std::vector<const WorkerView*>& order) {
  std::vector<std::string> ids;
  for (const WorkerView* w : order) ids.push_back(w->id);
  return ids;
}

TEST(PlacementTest, EstimatesBlocksPerSampleAtSixteenTokens) {
  EXPECT_EQ(EstimateBlocks(1, 1), 1);
  EXPECT_EQ(EstimateBlocks(16, 1), 1);
  EXPECT_EQ(EstimateBlocks(17, 1), 2);
  EXPECT_EQ(EstimateBlocks(17, 3), 6);
}

TEST(PlacementTest, DecodeWorkersWithRoomComeFirstThenTheSmallestBatch) {
  PoolSnapshot pools;
  pools.decode = {Decode("full", 100, 99, 0), Decode("busy", 100, 0, 8),
                  Decode("idle", 100, 50, 1)};
  // 4 blocks needed: "full" has 1 free; of the two with room, the smaller batch first.
  EXPECT_THAT(Ids(RankDecode(pools, 4)), testing::ElementsAre("idle", "busy", "full"));
}

TEST(PlacementTest, AmongEqualBatchesTheMostFreeBlocksFirst) {
  PoolSnapshot pools;
  pools.decode = {Decode("a", 100, 60, 2), Decode("b", 100, 10, 2)};
  EXPECT_THAT(Ids(RankDecode(pools, 1)), testing::ElementsAre("b", "a"));
}

TEST(PlacementTest, PendingWorkSinceTheLastPollCounts) {
  PoolSnapshot pools;
  pools.decode = {Decode("a", 100, 0, 0), Decode("b", 100, 0, 0)};
  // Three requests went to "a" since its last Stats, taking 98 blocks: "b" is now the choice.
  pools.decode[0].pending_load = 98;
  pools.decode[0].pending_requests = 3;
  EXPECT_THAT(Ids(RankDecode(pools, 4)), testing::ElementsAre("b", "a"));
}

TEST(PlacementTest, DownWorkersAreNeverChosen) {
  PoolSnapshot pools;
  pools.decode = {Decode("down", 100, 0, 0, /*up=*/false), Decode("up", 100, 90, 5)};
  pools.prefill = {Prefill("down", 0, 0, 0, /*up=*/false), Prefill("up", 1000)};
  EXPECT_THAT(Ids(RankDecode(pools, 1)), testing::ElementsAre("up"));
  ASSERT_NE(PickPrefill(pools).worker, nullptr);
  EXPECT_EQ(PickPrefill(pools).worker->id, "up");
}

TEST(PlacementTest, DrainingWorkersAreNeverChosen) {
  // A draining worker still answers Stats (up) but refuses Reserve and Submit. Idle and
  // holding the prompt, it would otherwise come first.
  PoolSnapshot pools;
  pools.decode = {Decode("draining", 100, 0, 0), Decode("busy", 100, 90, 5)};
  pools.decode[0].stats.set_draining(true);
  pools.prefill = {Prefill("draining", 0, 0.001, kMinModelSamples), Prefill("busy", 1000, 0.001,
                                                                           kMinModelSamples)};
  pools.prefill[0].stats.set_draining(true);
  PrefixHits hits;
  hits.cached_tokens["draining"] = 160;
  const RouteRequest kv{.routing = Routing::kKvAware, .hits = &hits, .prompt_tokens = 160, .n = 1};
  EXPECT_THAT(Ids(RankDecode(pools, 1, kv)), testing::ElementsAre("busy"));
  ASSERT_NE(PickPrefill(pools, kv).worker, nullptr);
  EXPECT_EQ(PickPrefill(pools, kv).worker->id, "busy");
  // The TTFT prediction is the other worker's.
  ASSERT_TRUE(PredictTtft(pools, 100).has_value());
  EXPECT_DOUBLE_EQ(*PredictTtft(pools, 100), 1100 * 0.001);
  pools.decode.pop_back();
  pools.prefill.pop_back();
  EXPECT_TRUE(RankDecode(pools, 1, kv).empty());
  EXPECT_EQ(PickPrefill(pools, kv).worker, nullptr);
  EXPECT_FALSE(PredictTtft(pools, 100).has_value());
}

TEST(PlacementTest, NoWorkerUpMeansNoChoice) {
  PoolSnapshot empty;
  EXPECT_TRUE(RankDecode(empty, 1).empty());
  EXPECT_EQ(PickPrefill(empty).worker, nullptr);
  PoolSnapshot all_down;
  all_down.decode = {Decode("d", 100, 0, 0, false)};
  all_down.prefill = {Prefill("p", 0, 0, 0, false)};
  EXPECT_TRUE(RankDecode(all_down, 1).empty());
  EXPECT_EQ(PickPrefill(all_down).worker, nullptr);
}

TEST(PlacementTest, AllDecodeWorkersFullStillRanksThemForAWaitingReserve) {
  PoolSnapshot pools;
  pools.decode = {Decode("a", 10, 10, 3), Decode("b", 10, 9, 1)};
  // None has the 4 blocks: they are still asked (a Reserve decides), smaller batch first.
  EXPECT_THAT(Ids(RankDecode(pools, 4)), testing::ElementsAre("b", "a"));
}

TEST(PlacementTest, PrefillGoesToTheFewestQueuedTokensPendingIncluded) {
  PoolSnapshot pools;
  pools.prefill = {Prefill("a", 500), Prefill("b", 100), Prefill("c", 300)};
  EXPECT_EQ(PickPrefill(pools).worker->id, "b");
  pools.prefill[1].pending_load = 450;  // prompts sent to "b" since its last Stats
  EXPECT_EQ(PickPrefill(pools).worker->id, "c");
}

// A request of `prompt` tokens whose prefix `hits` holds, routed kv-aware.
RouteRequest KvAware(const PrefixHits& hits, int64_t prompt, int n = 1) {
  return {.routing = Routing::kKvAware, .hits = &hits, .prompt_tokens = prompt, .n = n};
}

TEST(KvAwareRoutingTest, PrefillGoesWhereThePrefixIsUnlessItsQueueOutweighsIt) {
  PoolSnapshot pools;
  pools.prefill = {Prefill("a", 100), Prefill("b", 300)};
  PrefixHits hits;
  hits.cached_tokens["b"] = 960;  // "b" holds 960 of the prompt's 1,000 tokens
  // Load alone: "a" (fewer queued tokens). KV-aware: "b" computes 40 + 300 queued < 1,000 + 100.
  EXPECT_EQ(PickPrefill(pools, {.prompt_tokens = 1000}).worker->id, "a");
  const PrefillPick pick = PickPrefill(pools, KvAware(hits, 1000));
  ASSERT_NE(pick.worker, nullptr);
  EXPECT_EQ(pick.worker->id, "b");
  EXPECT_EQ(pick.compute_tokens, 40);
  EXPECT_EQ(pick.queued, 300);
  EXPECT_EQ(ReasonFor(KvAware(hits, 1000), *pick.worker), RouteReason::kKvHit);
  // A long enough queue on "b" sends the request to "a" after all, computing everything.
  pools.prefill[1].pending_load = 2000;
  const PrefillPick busy = PickPrefill(pools, KvAware(hits, 1000));
  EXPECT_EQ(busy.worker->id, "a");
  EXPECT_EQ(ReasonFor(KvAware(hits, 1000), *busy.worker), RouteReason::kKvMiss);
  EXPECT_EQ(ReasonFor({.prompt_tokens = 1000}, *busy.worker), RouteReason::kLoad);
}

TEST(KvAwareRoutingTest, PrefillComputesAtLeastTheLastTokenAndOnePerFurtherSample) {
  WorkerView w = Prefill("a", 0);
  PrefixHits hits;
  hits.cached_tokens["a"] = 64;  // the whole prompt
  EXPECT_EQ(PrefillTokens(KvAware(hits, 64), w), 1);
  EXPECT_EQ(PrefillTokens(KvAware(hits, 64, /*n=*/3), w), 3);
  EXPECT_EQ(PrefillTokens(KvAware(hits, 100), w), 36);
  // Load routing counts the whole prompt per sample, cached or not.
  EXPECT_EQ(PrefillTokens({.hits = &hits, .prompt_tokens = 100, .n = 2}, w), 200);
  // A worker the index knows nothing of holds nothing.
  EXPECT_EQ(PrefillTokens(KvAware(hits, 100), Prefill("b", 0)), 100);
}

TEST(KvAwareRoutingTest, DecodeWeighsKvToMoveAgainstTheRunningBatch) {
  PoolSnapshot pools;
  pools.decode = {Decode("empty", 100, 0, 1), Decode("holder", 100, 30, 2)};
  PrefixHits hits;
  hits.cached_tokens["holder"] = 1024;
  // Load: the smaller batch. KV-aware: "holder" moves 0 tokens + 2 x 512 < 1,024 + 1 x 512.
  EXPECT_THAT(Ids(RankDecode(pools, 64, {.prompt_tokens = 1024})),
              testing::ElementsAre("empty", "holder"));
  EXPECT_THAT(Ids(RankDecode(pools, 64, KvAware(hits, 1024))),
              testing::ElementsAre("holder", "empty"));
  EXPECT_EQ(TokensToMove(KvAware(hits, 1024, /*n=*/2), pools.decode[0]), 2048);
  EXPECT_EQ(TokensToMove(KvAware(hits, 1024), pools.decode[1]), 0);
  // Three more sequences in "holder"'s batch outweigh the 1,024 tokens it saves moving.
  pools.decode[1].pending_requests = 3;
  EXPECT_THAT(Ids(RankDecode(pools, 64, KvAware(hits, 1024))),
              testing::ElementsAre("empty", "holder"));
  // Room comes first whatever the cache holds.
  pools.decode[1].pending_requests = 0;
  pools.decode[1].pending_load = 58;  // 12 blocks free, 64 needed
  EXPECT_THAT(Ids(RankDecode(pools, 64, KvAware(hits, 1024))),
              testing::ElementsAre("empty", "holder"));
}

TEST(KvAwareRoutingTest, RoutingNamesParse) {
  EXPECT_EQ(*ParseRouting("kv-aware"), Routing::kKvAware);
  EXPECT_EQ(*ParseRouting("load"), Routing::kLoad);
  EXPECT_EQ(ParseRouting("random").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_STREQ(RoutingName(Routing::kKvAware), "kv-aware");
  EXPECT_STREQ(RouteReasonName(RouteReason::kKvMiss), "kv_miss");
}

TEST(AdmissionTest, RefusesWhenThePredictedTtftExceedsTheTarget) {
  PoolSnapshot pools;
  // 1 ms per queued token: 900 queued + 200 own = 1.1 s on the best worker.
  pools.prefill = {Prefill("a", 900, 0.001, kMinModelSamples),
                   Prefill("b", 2000, 0.001, kMinModelSamples)};
  ASSERT_TRUE(PredictTtft(pools, 200).has_value());
  EXPECT_NEAR(*PredictTtft(pools, 200), 1.1, 1e-9);
  absl::Status refused = AdmitByTtft(pools, 200, 1.0);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(refused.message()), testing::HasSubstr("predicted time to first token"));
  EXPECT_TRUE(AdmitByTtft(pools, 50, 1.0).ok());  // 0.95 s
}

TEST(AdmissionTest, AdmitsWithoutATargetOrAnUnlearnedWorker) {
  PoolSnapshot pools;
  pools.prefill = {Prefill("a", 1000000, 0.01, kMinModelSamples)};
  EXPECT_TRUE(AdmitByTtft(pools, 10, std::nullopt).ok());
  pools.prefill.push_back(Prefill("new", 0, 0.0, kMinModelSamples - 1));
  EXPECT_FALSE(PredictTtft(pools, 10).has_value());
  EXPECT_TRUE(AdmitByTtft(pools, 10, 0.001).ok());
}

TEST(AdmissionTest, NoPrefillWorkerOrOneDownGivesNoPrediction) {
  PoolSnapshot none;
  EXPECT_FALSE(PredictTtft(none, 10).has_value());
  EXPECT_TRUE(AdmitByTtft(none, 10, 0.001).ok());
  PoolSnapshot down;
  down.prefill = {Prefill("a", 1000000, 0.01, kMinModelSamples, /*up=*/false)};
  EXPECT_TRUE(AdmitByTtft(down, 10, 0.001).ok());
}

}  // namespace
}  // namespace tandem::router
