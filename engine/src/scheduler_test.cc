#include "tandem/engine/scheduler.h"

#include <memory>
#include <numeric>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

std::unique_ptr<Sequence> MakeSeq(int id, int prompt_len) {
  auto seq = std::make_unique<Sequence>();
  seq->seq_id = id;
  seq->tokens.resize(prompt_len);
  std::iota(seq->tokens.begin(), seq->tokens.end(), 1);
  seq->num_prompt_tokens = prompt_len;
  seq->params = std::make_shared<SamplingParams>();
  return seq;
}

// Runs a step as the engine would: commit, then append a token to each sampling sequence.
void RunStep(Scheduler& s, const SchedulerStep& step) {
  s.Commit(step);
  for (const auto& ss : step.seqs) {
    if (ss.samples) ss.seq->tokens.push_back(7);
  }
}

TEST(SchedulerTest, ChunksALongPromptUnderTheTokenBudget) {
  BlockManager blocks(64, 16);
  Scheduler s({.max_num_seqs = 8, .max_num_batched_tokens = 64}, &blocks);
  auto seq = MakeSeq(0, 150);
  s.Add(seq.get());
  std::vector<int> chunks;
  while (seq->num_computed_tokens < 150) {
    SchedulerStep step = s.Schedule();
    ASSERT_EQ(step.seqs.size(), 1u);
    chunks.push_back(step.seqs[0].num_new_tokens);
    EXPECT_EQ(step.seqs[0].samples, seq->num_computed_tokens + step.seqs[0].num_new_tokens == 150);
    RunStep(s, step);
  }
  EXPECT_EQ(chunks, (std::vector<int>{64, 64, 22}));
  // Then it decodes one token per step.
  SchedulerStep step = s.Schedule();
  ASSERT_EQ(step.seqs.size(), 1u);
  EXPECT_EQ(step.seqs[0].num_new_tokens, 1);
  EXPECT_TRUE(step.seqs[0].samples);
}

TEST(SchedulerTest, MixesDecodesWithAPrefillChunkInOneStep) {
  BlockManager blocks(64, 16);
  Scheduler s({.max_num_seqs = 8, .max_num_batched_tokens = 32}, &blocks);
  auto a = MakeSeq(0, 10);
  auto b = MakeSeq(1, 10);
  s.Add(a.get());
  s.Add(b.get());
  RunStep(s, s.Schedule());  // both prefilled (20 tokens)
  auto c = MakeSeq(2, 100);
  s.Add(c.get());
  SchedulerStep step = s.Schedule();
  ASSERT_EQ(step.seqs.size(), 3u);
  EXPECT_EQ(step.seqs[0].num_new_tokens, 1);
  EXPECT_EQ(step.seqs[1].num_new_tokens, 1);
  EXPECT_EQ(step.seqs[2].num_new_tokens, 30);  // the rest of the budget
  EXPECT_FALSE(step.seqs[2].samples);
  EXPECT_EQ(step.num_tokens, 32);
}

TEST(SchedulerTest, RespectsMaxNumSeqs) {
  BlockManager blocks(64, 16);
  Scheduler s({.max_num_seqs = 2, .max_num_batched_tokens = 512}, &blocks);
  std::vector<std::unique_ptr<Sequence>> seqs;
  for (int i = 0; i < 5; ++i) {
    seqs.push_back(MakeSeq(i, 4));
    s.Add(seqs.back().get());
  }
  SchedulerStep step = s.Schedule();
  EXPECT_EQ(step.seqs.size(), 2u);
  EXPECT_EQ(s.num_waiting(), 3);
}

TEST(SchedulerTest, PreemptsTheNewestSequenceWhenBlocksRunOutAndRecomputesIt) {
  BlockManager blocks(4, 4);  // 16 token slots
  Scheduler s({.max_num_seqs = 8, .max_num_batched_tokens = 64}, &blocks);
  auto a = MakeSeq(0, 8);
  auto b = MakeSeq(1, 8);
  s.Add(a.get());
  s.Add(b.get());
  RunStep(s, s.Schedule());  // 4 blocks used, each sequence now holds 9 tokens
  EXPECT_EQ(blocks.num_free_blocks(), 0);
  SchedulerStep step = s.Schedule();  // a needs a third block: b is preempted
  ASSERT_EQ(step.seqs.size(), 1u);
  EXPECT_EQ(step.seqs[0].seq, a.get());
  EXPECT_EQ(s.num_preemptions(), 1);
  EXPECT_EQ(b->num_computed_tokens, 0);
  EXPECT_EQ(b->status, SequenceStatus::kWaiting);
  EXPECT_EQ(b->num_uncomputed_tokens(), 9);  // prompt + its generated token
  RunStep(s, step);
  s.Finish(a.get(), FinishReason::kStop);
  // b comes back and recomputes everything in one step.
  step = s.Schedule();
  ASSERT_EQ(step.seqs.size(), 1u);
  EXPECT_EQ(step.seqs[0].seq, b.get());
  EXPECT_EQ(step.seqs[0].num_new_tokens, 9);
  EXPECT_TRUE(step.seqs[0].samples);
}

TEST(SchedulerTest, FinishFreesBlocksButPrefilledKeepsThemUntilReleased) {
  BlockManager blocks(8, 4);
  Scheduler s({.max_num_seqs = 8, .max_num_batched_tokens = 64, .role = EngineRole::kPrefill},
              &blocks);
  auto a = MakeSeq(0, 6);
  auto b = MakeSeq(1, 6);
  s.Add(a.get());
  s.Add(b.get());
  RunStep(s, s.Schedule());
  EXPECT_EQ(blocks.num_used_blocks(), 4);
  s.Finish(a.get(), FinishReason::kAbort);
  EXPECT_EQ(blocks.num_used_blocks(), 2);
  s.Finish(b.get(), FinishReason::kPrefilled);
  EXPECT_EQ(blocks.num_used_blocks(), 2);  // held for the hand-off
  EXPECT_FALSE(s.has_work());
  s.ReleaseBlocks(b.get());
  EXPECT_EQ(blocks.num_used_blocks(), 0);
}

TEST(SchedulerTest, AbortOfAWaitingSequenceRemovesIt) {
  BlockManager blocks(8, 4);
  Scheduler s({.max_num_seqs = 1, .max_num_batched_tokens = 64}, &blocks);
  auto a = MakeSeq(0, 4);
  auto b = MakeSeq(1, 4);
  s.Add(a.get());
  s.Add(b.get());
  s.Schedule();
  s.Finish(b.get(), FinishReason::kAbort);
  EXPECT_EQ(s.num_waiting(), 0);
  EXPECT_EQ(s.num_running(), 1);
}

TEST(SchedulerTest, DecodeRoleSequencesArriveWithTheirKv) {
  BlockManager blocks(8, 4);
  Scheduler s({.max_num_seqs = 8, .max_num_batched_tokens = 64, .role = EngineRole::kDecode},
              &blocks);
  auto a = MakeSeq(0, 6);
  ASSERT_TRUE(blocks.Append(a->block_table, 0, 6).ok());
  a->num_computed_tokens = 6;
  a->tokens.push_back(9);  // the first token, sampled by the prefill engine
  s.AddPrefilled(a.get());
  SchedulerStep step = s.Schedule();
  ASSERT_EQ(step.seqs.size(), 1u);
  EXPECT_EQ(step.seqs[0].num_new_tokens, 1);
  EXPECT_TRUE(step.seqs[0].samples);
}

TEST(SchedulerTest, MorePrefilledSequencesThanMaxNumSeqsTakeTurns) {
  BlockManager blocks(64, 4);
  Scheduler s({.max_num_seqs = 4, .max_num_batched_tokens = 64, .role = EngineRole::kDecode},
              &blocks);
  std::vector<std::unique_ptr<Sequence>> seqs;
  for (int i = 0; i < 10; ++i) {
    auto seq = MakeSeq(i, 4);
    ASSERT_TRUE(blocks.Append(seq->block_table, 0, 4).ok());
    seq->num_computed_tokens = 4;
    seq->tokens.push_back(9);
    s.AddPrefilled(seq.get());
    seqs.push_back(std::move(seq));
  }
  // Every step stays within the runner's sequence limit; all ten progress as others finish.
  for (size_t expected : {4u, 4u, 2u}) {
    SchedulerStep step = s.Schedule();
    ASSERT_EQ(step.seqs.size(), expected);
    RunStep(s, step);
    for (const auto& ss : step.seqs) s.Finish(ss.seq, FinishReason::kLength);
  }
  EXPECT_TRUE(s.Schedule().empty());
}

TEST(SchedulerTest, DynamicCapLimitsTheRunningBatch) {
  BlockManager blocks(64, 4);
  Scheduler s({.max_num_seqs = 8, .max_num_batched_tokens = 64, .role = EngineRole::kDecode},
              &blocks);
  std::vector<std::unique_ptr<Sequence>> seqs;
  for (int i = 0; i < 8; ++i) {
    auto seq = MakeSeq(i, 4);
    ASSERT_TRUE(blocks.Append(seq->block_table, 0, 4).ok());
    seq->num_computed_tokens = 4;
    seq->tokens.push_back(9);
    s.AddPrefilled(seq.get());
    seqs.push_back(std::move(seq));
  }
  s.set_max_running(3);
  SchedulerStep step = s.Schedule();
  ASSERT_EQ(step.seqs.size(), 3u);
  // The oldest run; the rest wait, in arrival order.
  for (int i = 0; i < 3; ++i) EXPECT_EQ(step.seqs[i].seq, seqs[i].get());
  RunStep(s, step);
  s.set_max_running(5);  // the controller grows the batch
  step = s.Schedule();
  EXPECT_EQ(step.seqs.size(), 5u);
  RunStep(s, step);
  s.set_max_running(0);  // never below one
  EXPECT_EQ(s.max_running(), 1);
  EXPECT_EQ(s.Schedule().seqs.size(), 1u);
  s.set_max_running(100);  // never above max_num_seqs
  EXPECT_EQ(s.max_running(), 8);
}

TEST(SchedulerTest, DynamicCapHoldsBackAdmission) {
  BlockManager blocks(64, 16);
  Scheduler s({.max_num_seqs = 8, .max_num_batched_tokens = 256}, &blocks);
  std::vector<std::unique_ptr<Sequence>> seqs;
  for (int i = 0; i < 4; ++i) {
    seqs.push_back(MakeSeq(i, 10));
    s.Add(seqs.back().get());
  }
  s.set_max_running(2);
  SchedulerStep step = s.Schedule();
  EXPECT_EQ(step.seqs.size(), 2u);
  EXPECT_EQ(s.num_running(), 2);
  EXPECT_EQ(s.num_waiting(), 2);
}

TEST(SchedulerTest, TokenBudgetShrinksChunks) {
  BlockManager blocks(64, 16);
  Scheduler s({.max_num_seqs = 8, .max_num_batched_tokens = 64}, &blocks);
  auto seq = MakeSeq(0, 100);
  s.Add(seq.get());
  s.set_token_budget(32);
  SchedulerStep step = s.Schedule();
  ASSERT_EQ(step.seqs.size(), 1u);
  EXPECT_EQ(step.seqs[0].num_new_tokens, 32);
  EXPECT_EQ(step.num_tokens, 32);
  RunStep(s, step);
  s.set_token_budget(1000);  // clamped to max_num_batched_tokens
  EXPECT_EQ(s.Schedule().num_tokens, 64);
}

TEST(SchedulerTest, ShortestPromptFirstAdmitsShortPromptsFirst) {
  BlockManager blocks(256, 16);
  Scheduler s({.max_num_seqs = 1, .max_num_batched_tokens = 512,
               .queue_policy = QueuePolicy::kShortestPromptFirst},
              &blocks);
  std::vector<std::unique_ptr<Sequence>> seqs;
  for (int len : {300, 50, 200, 50, 10}) {
    seqs.push_back(MakeSeq(static_cast<int>(seqs.size()), len));
    s.Add(seqs.back().get());
  }
  // One at a time: 10, then the two of 50 in arrival order, then 200, then 300.
  std::vector<int> order;
  while (s.has_work()) {
    SchedulerStep step = s.Schedule();
    ASSERT_EQ(step.seqs.size(), 1u);
    order.push_back(static_cast<int>(step.seqs[0].seq->seq_id));
    RunStep(s, step);
    s.Finish(step.seqs[0].seq, FinishReason::kPrefilled);
    s.ReleaseBlocks(step.seqs[0].seq);
  }
  EXPECT_EQ(order, (std::vector<int>{4, 1, 3, 2, 0}));
}

TEST(SchedulerTest, FcfsAdmitsInArrivalOrder) {
  BlockManager blocks(256, 16);
  Scheduler s({.max_num_seqs = 1, .max_num_batched_tokens = 512}, &blocks);
  std::vector<std::unique_ptr<Sequence>> seqs;
  for (int len : {300, 50, 10}) {
    seqs.push_back(MakeSeq(static_cast<int>(seqs.size()), len));
    s.Add(seqs.back().get());
  }
  std::vector<int> order;
  while (s.has_work()) {
    SchedulerStep step = s.Schedule();
    order.push_back(static_cast<int>(step.seqs[0].seq->seq_id));
    RunStep(s, step);
    s.Finish(step.seqs[0].seq, FinishReason::kPrefilled);
    s.ReleaseBlocks(step.seqs[0].seq);
  }
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2}));
}

TEST(SchedulerPrefixCacheTest, ComputesOnlyTheUncachedSuffix) {
  BlockManager blocks(64, 4, /*enable_prefix_caching=*/true);
  Scheduler s({.max_num_seqs = 8, .max_num_batched_tokens = 64}, &blocks);
  auto a = MakeSeq(0, 14);  // three full blocks and two tokens
  s.Add(a.get());
  RunStep(s, s.Schedule());
  s.Finish(a.get(), FinishReason::kStop);
  EXPECT_EQ(blocks.num_used_blocks(), 0);
  EXPECT_EQ(blocks.num_cached_free_blocks(), 3);

  // Same first 13 tokens, then another: the three full blocks are shared.
  auto b = MakeSeq(1, 14);
  b->tokens[13] = 500;
  s.Add(b.get());
  SchedulerStep step = s.Schedule();
  ASSERT_EQ(step.seqs.size(), 1u);
  EXPECT_EQ(b->num_computed_tokens, 12);
  EXPECT_EQ(step.seqs[0].num_new_tokens, 2);
  EXPECT_TRUE(step.seqs[0].samples);
  EXPECT_EQ(s.prefix_cache_queries_tokens(), 28);
  EXPECT_EQ(s.prefix_cache_hits_tokens(), 12);
  RunStep(s, step);
  s.Finish(b.get(), FinishReason::kStop);
  EXPECT_EQ(blocks.num_used_blocks(), 0);
}

TEST(SchedulerPrefixCacheTest, AnAdmissionRefusedForRoomIsNotCountedTwice) {
  BlockManager blocks(4, 4, true);  // 16 token slots
  Scheduler s({.max_num_seqs = 8, .max_num_batched_tokens = 64}, &blocks);
  auto a = MakeSeq(0, 12);
  auto b = MakeSeq(1, 12);
  for (int i = 0; i < 12; ++i) b->tokens[i] += 100;
  s.Add(a.get());
  s.Add(b.get());
  RunStep(s, s.Schedule());  // a runs; b finds no room
  EXPECT_EQ(s.num_waiting(), 1);
  RunStep(s, s.Schedule());  // still none
  EXPECT_EQ(s.prefix_cache_queries_tokens(), 12);
  s.Finish(a.get(), FinishReason::kStop);
  ASSERT_EQ(s.Schedule().seqs.size(), 1u);  // b admitted
  EXPECT_EQ(s.prefix_cache_queries_tokens(), 24);
}

TEST(SchedulerPrefixCacheTest, AFullyCachedPromptStillComputesItsLastBlock) {
  BlockManager blocks(64, 4, true);
  Scheduler s({.max_num_seqs = 8, .max_num_batched_tokens = 64}, &blocks);
  auto a = MakeSeq(0, 12);
  s.Add(a.get());
  RunStep(s, s.Schedule());
  s.Finish(a.get(), FinishReason::kStop);
  auto b = MakeSeq(1, 12);
  s.Add(b.get());
  SchedulerStep step = s.Schedule();
  ASSERT_EQ(step.seqs.size(), 1u);
  EXPECT_EQ(step.seqs[0].num_new_tokens, 4);  // the last block, so the step has logits
  EXPECT_TRUE(step.seqs[0].samples);
  EXPECT_EQ(s.prefix_cache_hits_tokens(), 8);
}

TEST(SchedulerPrefixCacheTest, APreemptedSequenceResumesFromItsCachedBlocks) {
  BlockManager blocks(4, 4, true);  // 16 token slots
  Scheduler s({.max_num_seqs = 8, .max_num_batched_tokens = 64}, &blocks);
  auto a = MakeSeq(0, 8);
  auto b = MakeSeq(1, 8);
  for (int i = 0; i < 8; ++i) b->tokens[i] += 100;
  s.Add(a.get());
  s.Add(b.get());
  RunStep(s, s.Schedule());
  SchedulerStep step = s.Schedule();  // a needs a third block: b is preempted
  ASSERT_EQ(s.num_preemptions(), 1);
  RunStep(s, step);
  s.Finish(a.get(), FinishReason::kStop);
  // b's full blocks stayed cached when it was preempted, but a's third block evicted b's tail
  // (the least valuable: its head is what more requests share). b recomputes the rest only.
  step = s.Schedule();
  ASSERT_EQ(step.seqs.size(), 1u);
  EXPECT_EQ(step.seqs[0].seq, b.get());
  EXPECT_EQ(b->num_computed_tokens, 4);
  EXPECT_EQ(step.seqs[0].num_new_tokens, 5);  // its second block and its generated token
}

TEST(SchedulerPrefixCacheTest, SamplesForkTheirSourcesPromptAndCopyTheSharedLastBlock) {
  BlockManager blocks(64, 4, true);
  Scheduler s({.max_num_seqs = 8, .max_num_batched_tokens = 4}, &blocks);
  auto a = MakeSeq(0, 10);  // two full blocks and two tokens
  auto b = MakeSeq(1, 10);
  b->prompt_source = a.get();
  s.Add(a.get());
  s.Add(b.get());
  // While a's prompt is computed in chunks, b waits.
  for (int i = 0; i < 3; ++i) {
    SchedulerStep step = s.Schedule();
    ASSERT_EQ(step.seqs.size(), 1u) << i;
    EXPECT_EQ(step.seqs[0].seq, a.get());
    RunStep(s, step);
  }
  EXPECT_EQ(b->status, SequenceStatus::kWaiting);
  // Then b shares a's three prompt blocks and runs only its last prompt token, into a copy of
  // the half-full third block.
  SchedulerStep step = s.Schedule();
  ASSERT_EQ(step.seqs.size(), 2u);
  EXPECT_EQ(step.seqs[1].seq, b.get());
  EXPECT_EQ(step.seqs[1].num_new_tokens, 1);
  EXPECT_TRUE(step.seqs[1].samples);
  EXPECT_EQ(b->num_computed_tokens, 9);
  ASSERT_EQ(step.block_copies.size(), 1u);
  EXPECT_EQ(step.block_copies[0].first, a->block_table[2]);
  EXPECT_EQ(step.block_copies[0].second, b->block_table[2]);
  EXPECT_EQ(b->block_table[0], a->block_table[0]);
  EXPECT_EQ(b->block_table[1], a->block_table[1]);
  EXPECT_EQ(blocks.ref_count(a->block_table[0]), 2);
  EXPECT_EQ(blocks.ref_count(a->block_table[2]), 1);
  EXPECT_EQ(s.prefix_cache_hits_tokens(), 9);
  RunStep(s, step);
  s.Finish(a.get(), FinishReason::kStop);
  s.Finish(b.get(), FinishReason::kStop);
  EXPECT_EQ(blocks.num_used_blocks(), 0);
}

TEST(SchedulerPrefixCacheTest, ASampleWhoseLastPromptTokenStartsABlockTakesAFreshOne) {
  BlockManager blocks(64, 4, true);
  Scheduler s({.max_num_seqs = 8, .max_num_batched_tokens = 64}, &blocks);
  auto a = MakeSeq(0, 9);  // token 8 starts the third block
  auto b = MakeSeq(1, 9);
  b->prompt_source = a.get();
  s.Add(a.get());
  s.Add(b.get());
  RunStep(s, s.Schedule());
  SchedulerStep step = s.Schedule();
  ASSERT_EQ(step.seqs.size(), 2u);
  EXPECT_TRUE(step.block_copies.empty());
  EXPECT_EQ(b->block_table.size(), 3u);
  EXPECT_NE(b->block_table[2], a->block_table[2]);
  EXPECT_EQ(blocks.ref_count(a->block_table[2]), 1);
}

TEST(SchedulerPrefixCacheTest, ASampleWhoseSourceFinishedComputesItsOwnPrompt) {
  BlockManager blocks(64, 4, false);
  Scheduler s({.max_num_seqs = 8, .max_num_batched_tokens = 64}, &blocks);
  auto a = MakeSeq(0, 6);
  auto b = MakeSeq(1, 6);
  b->prompt_source = a.get();
  s.Add(a.get());
  s.Add(b.get());
  RunStep(s, s.Schedule());
  s.Finish(a.get(), FinishReason::kPrefilled);  // handed over at its first token
  s.ReleaseBlocks(a.get());
  SchedulerStep step = s.Schedule();
  ASSERT_EQ(step.seqs.size(), 1u);
  EXPECT_EQ(step.seqs[0].num_new_tokens, 6);
}

}  // namespace
}  // namespace tandem::engine
