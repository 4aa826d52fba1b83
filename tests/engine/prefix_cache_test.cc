// Prefix caching as a user of one engine sees it: the same tokens and logprobs with the cache
// on as off (greedy and seeded, chunked, n > 1, under eviction pressure), a repeated prompt
// computing at most one block, tenants kept apart by cache_salt, and no block left referenced.
#include <random>

#include "gtest/gtest.h"
#include "tandem/engine/llm_engine.h"
#include "test_models.h"

namespace tandem::engine {
namespace {

std::unique_ptr<LlmEngine> MakeEngine(EngineOptions options) {
  options.model_dir = testing::TinyModel("llama", DType::kBF16);
  if (options.num_threads == 0) options.num_threads = 2;
  auto engine = LlmEngine::Create(options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return std::move(engine).value();
}

std::vector<int32_t> RandomTokens(std::mt19937& rng, int len, int vocab) {
  std::vector<int32_t> p(len);
  for (int32_t& t : p) t = static_cast<int32_t>(rng() % vocab);
  return p;
}

const SamplingParams kGreedy{.temperature = 0, .max_tokens = 12, .ignore_eos = true, .logprobs = 0};
const SamplingParams kSeeded{.temperature = 0.9f,
                             .top_p = 0.95f,
                             .top_k = 50,
                             .seed = 77,
                             .max_tokens = 12,
                             .ignore_eos = true,
                             .logprobs = 0};

// Conversations sharing a system prompt, each resent with its history grown (multi-turn), plus
// exact repeats: what a prefix cache is for.
std::vector<GenerateRequest> Workload(int vocab, int round) {
  std::mt19937 rng(21);
  const std::vector<int32_t> system = RandomTokens(rng, 45, vocab);
  std::vector<GenerateRequest> requests;
  for (int c = 0; c < 4; ++c) {
    std::vector<int32_t> prompt = system;
    for (int turn = 0; turn <= round; ++turn) {
      std::vector<int32_t> more = RandomTokens(rng, 11 + 7 * c + turn, vocab);
      prompt.insert(prompt.end(), more.begin(), more.end());
    }
    SamplingParams p = c % 2 ? kGreedy : kSeeded;
    if (p.seed) p.seed = *p.seed + c;
    requests.push_back({absl::StrCat("c", c, "-r", round), prompt, p});
  }
  requests.push_back({absl::StrCat("repeat-r", round), system, kGreedy});
  return requests;
}

// Runs rounds 0..rounds-1 of Workload, one round after another, and returns every output.
std::vector<RequestOutput> RunRounds(LlmEngine& engine, int rounds) {
  std::vector<RequestOutput> all;
  for (int round = 0; round < rounds; ++round) {
    auto out = GenerateAll(engine, Workload(engine.config().vocab_size, round));
    EXPECT_TRUE(out.ok()) << out.status();
    if (!out.ok()) break;
    all.insert(all.end(), out->begin(), out->end());
  }
  return all;
}

void ExpectSameOutputs(const std::vector<RequestOutput>& got,
                       const std::vector<RequestOutput>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i].choices.size(), want[i].choices.size()) << got[i].request_id;
    for (size_t c = 0; c < got[i].choices.size(); ++c) {
      EXPECT_EQ(got[i].choices[c].token_ids, want[i].choices[c].token_ids)
          << got[i].request_id << " choice " << c;
      EXPECT_EQ(got[i].choices[c].logprobs, want[i].choices[c].logprobs)
          << got[i].request_id << " choice " << c;
      EXPECT_EQ(got[i].choices[c].text, want[i].choices[c].text) << got[i].request_id;
    }
  }
}

TEST(PrefixCacheTest, OutputsEqualCachingOffGreedySeededAndChunked) {
  auto off = MakeEngine({.max_num_batched_tokens = 64, .enable_prefix_caching = false});
  const std::vector<RequestOutput> want = RunRounds(*off, 3);
  EXPECT_EQ(off->stats().prefix_cache_hits_tokens, 0);
  for (int chunk : {64, 16}) {
    auto on = MakeEngine({.max_num_batched_tokens = chunk});
    ExpectSameOutputs(RunRounds(*on, 3), want);
    const EngineStats stats = on->stats();
    // Later rounds resend earlier prompts: most of their tokens come from the cache.
    EXPECT_GT(stats.prefix_cache_hits_tokens, stats.prefix_cache_queries_tokens / 3) << chunk;
    EXPECT_EQ(stats.kv_blocks_used, 0);
  }
}

TEST(PrefixCacheTest, OutputsEqualCachingOffUnderEvictionPressure) {
  auto off = MakeEngine({.max_num_batched_tokens = 64, .enable_prefix_caching = false});
  const std::vector<RequestOutput> want = RunRounds(*off, 3);
  // Room for 11 blocks, the longest request's 10 and one more: the rounds touch about 4x that,
  // so cached blocks are evicted all the time and running sequences preempted.
  const int64_t block_bytes = ModelRunner::KvBytesPerBlock(off->config(), /*block_size=*/16);
  auto tight = MakeEngine({.kv_cache_bytes = 11 * block_bytes, .max_num_batched_tokens = 64});
  ExpectSameOutputs(RunRounds(*tight, 3), want);
  const EngineStats stats = tight->stats();
  EXPECT_GT(stats.prefix_cache_hits_tokens, 0);
  EXPECT_GT(stats.prefix_cache_evictions, 10);
  EXPECT_GT(stats.preemptions, 0);
  EXPECT_EQ(stats.kv_blocks_used, 0);
}

TEST(PrefixCacheTest, SamplesOfOneRequestShareThePromptAndMatchCachingOff) {
  std::mt19937 rng(3);
  auto off = MakeEngine({.max_num_batched_tokens = 32, .enable_prefix_caching = false});
  const int vocab = off->config().vocab_size;
  std::vector<GenerateRequest> requests;
  // Prompt lengths around block edges: the shared last block is copied, or a fresh one used.
  int i = 0;
  for (int len : {40, 47, 48, 49, 5}) {
    SamplingParams p = kSeeded;
    p.n = 3;
    p.seed = 100 + i;
    requests.push_back({absl::StrCat("n", i++), RandomTokens(rng, len, vocab), p});
  }
  SamplingParams greedy = kGreedy;
  greedy.n = 2;
  requests.push_back({"greedy", RandomTokens(rng, 33, vocab), greedy});
  auto want = GenerateAll(*off, requests);
  ASSERT_TRUE(want.ok()) << want.status();
  auto on = MakeEngine({.max_num_batched_tokens = 32});
  auto got = GenerateAll(*on, requests);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectSameOutputs(*got, *want);
  EXPECT_EQ(on->stats().kv_blocks_used, 0);

  // One request at a time (nothing else competes for the step), samples 1.. compute only their
  // last prompt token: the rest is sample 0's.
  auto alone = MakeEngine({.max_num_batched_tokens = 32});
  for (size_t r = 0; r < requests.size(); ++r) {
    const int64_t hits = alone->stats().prefix_cache_hits_tokens;
    auto out = GenerateAll(*alone, {requests[r]});
    ASSERT_TRUE(out.ok()) << out.status();
    ExpectSameOutputs(*out, {(*want)[r]});
    const int n = requests[r].params.n;
    const int len = static_cast<int>(requests[r].prompt_tokens.size());
    EXPECT_EQ(alone->stats().prefix_cache_hits_tokens - hits, (n - 1) * (len - 1))
        << requests[r].request_id;
  }
  EXPECT_EQ(alone->stats().kv_blocks_used, 0);
}

TEST(PrefixCacheTest, TheSamePromptTwiceComputesAtMostOneBlockTheSecondTime) {
  auto engine = MakeEngine({.max_num_batched_tokens = 128});
  std::mt19937 rng(8);
  const std::vector<int32_t> prompt = RandomTokens(rng, 496, engine->config().vocab_size);
  SamplingParams p = kGreedy;
  p.max_tokens = 4;
  auto first = GenerateAll(*engine, {{"first", prompt, p}});
  ASSERT_TRUE(first.ok());
  const EngineStats before = engine->stats();
  EXPECT_EQ(before.prefix_cache_hits_tokens, 0);
  auto second = GenerateAll(*engine, {{"second", prompt, p}});
  ASSERT_TRUE(second.ok());
  const EngineStats after = engine->stats();
  const int64_t queried = after.prefix_cache_queries_tokens - before.prefix_cache_queries_tokens;
  const int64_t hit = after.prefix_cache_hits_tokens - before.prefix_cache_hits_tokens;
  EXPECT_EQ(queried, 496);
  EXPECT_LE(queried - hit, 16);  // computed: at most one block
  EXPECT_EQ((*second)[0].choices[0].token_ids, (*first)[0].choices[0].token_ids);
}

TEST(PrefixCacheTest, CacheSaltKeepsTenantsApart) {
  auto engine = MakeEngine({});
  std::mt19937 rng(4);
  const std::vector<int32_t> prompt = RandomTokens(rng, 100, engine->config().vocab_size);
  auto run = [&](const std::string& id, const std::string& salt) {
    const int64_t hits = engine->stats().prefix_cache_hits_tokens;
    GenerateRequest r{id, prompt, kGreedy};
    r.cache_salt = salt;
    auto out = GenerateAll(*engine, {std::move(r)});
    EXPECT_TRUE(out.ok());
    return std::make_pair(engine->stats().prefix_cache_hits_tokens - hits,
                          (*out)[0].choices[0].token_ids);
  };
  const auto alice = run("a1", "alice");
  EXPECT_EQ(alice.first, 0);
  const auto bob = run("b1", "bob");
  EXPECT_EQ(bob.first, 0);  // same prompt, other tenant: nothing shared
  const auto nobody = run("n1", "");
  EXPECT_EQ(nobody.first, 0);
  const auto alice_again = run("a2", "alice");
  EXPECT_EQ(alice_again.first, 96);
  EXPECT_EQ(bob.second, alice.second);
  EXPECT_EQ(alice_again.second, alice.second);
}

TEST(PrefixCacheTest, AfterAbortsNoBlockIsReferenced) {
  auto engine = MakeEngine({.max_num_batched_tokens = 48});
  std::mt19937 rng(6);
  const int vocab = engine->config().vocab_size;
  const std::vector<int32_t> shared = RandomTokens(rng, 40, vocab);
  for (int i = 0; i < 12; ++i) {
    std::vector<int32_t> prompt = shared;
    std::vector<int32_t> own = RandomTokens(rng, 5 + 9 * i, vocab);
    prompt.insert(prompt.end(), own.begin(), own.end());
    SamplingParams p = kSeeded;
    p.n = 1 + i % 3;
    p.max_tokens = 40;
    ASSERT_TRUE(engine->AddRequest({absl::StrCat("r", i), prompt, p}).ok());
  }
  // Abort them at different points: waiting, mid-prefill, mid-generation.
  for (int step = 0; step < 12; ++step) {
    ASSERT_TRUE(engine->Step().ok());
    engine->Abort(absl::StrCat("r", step));
  }
  EXPECT_FALSE(engine->has_unfinished());
  const EngineStats stats = engine->stats();
  EXPECT_EQ(stats.kv_blocks_used, 0);
  EXPECT_EQ(stats.running + stats.waiting, 0);
  EXPECT_GT(stats.prefix_cache_hits_tokens, 0);
  // The cached blocks left are free for the next request, which still runs correctly.
  auto out = GenerateAll(*engine, {{"after", shared, kGreedy}});
  ASSERT_TRUE(out.ok());
  EXPECT_EQ((*out)[0].choices[0].token_ids.size(), 12u);
  EXPECT_EQ(engine->stats().kv_blocks_used, 0);
}

}  // namespace
}  // namespace tandem::engine

namespace tandem::engine {
namespace {

// An abort storm on a tight cache, in each role: many requests sharing one long prompt, random
// n, aborted at random steps (a prefill engine's hand-offs released at random times, a decode
// engine's reservations shared with its cached prefix); afterwards no block is referenced.
TEST(PrefixCacheTest, AbortStormsInEveryRoleLeaveNoBlockReferenced) {
  for (EngineRole role : {EngineRole::kColocated, EngineRole::kPrefill, EngineRole::kDecode}) {
    SCOPED_TRACE(static_cast<int>(role));
    auto probe = MakeEngine({});
    const int64_t block_bytes = ModelRunner::KvBytesPerBlock(probe->config(), 16);
    auto engine = MakeEngine(
        {.kv_cache_bytes = 60 * block_bytes, .max_num_batched_tokens = 48, .role = role});
    std::mt19937 rng(static_cast<uint32_t>(role) + 1);
    const int vocab = engine->config().vocab_size;
    const std::vector<int32_t> prompt = RandomTokens(rng, 200, vocab);
    std::vector<PrefillHandoff> held;
    std::vector<BlockTable> reserved;
    int next = 0;
    std::vector<std::string> live;
    for (int step = 0; step < 400; ++step) {
      if (rng() % 2 == 0 && next < 150) {
        GenerateRequest r{absl::StrCat("r", next++), prompt, kSeeded};
        r.params.n = 1 + static_cast<int>(rng() % 3);
        r.params.max_tokens = 5 + static_cast<int>(rng() % 30);
        if (rng() % 3 == 0) r.prompt_tokens.resize(100 + rng() % 100);
        if (role == EngineRole::kDecode) {
          std::vector<PrefilledChoice> choices;
          bool ok = true;
          for (int c = 0; c < r.params.n && ok; ++c) {
            auto table = engine->ReserveBlocks(static_cast<int>(r.prompt_tokens.size()),
                                               r.prompt_tokens, "", nullptr);
            if (!table.ok()) {
              ok = false;
              break;
            }
            PrefilledChoice choice;
            choice.first_token = 1;
            choice.blocks = *table;
            choices.push_back(std::move(choice));
          }
          if (!ok || rng() % 5 == 0) {  // no room, or the prefill failed: released
            for (PrefilledChoice& c : choices) engine->FreeReservation(c.blocks);
            continue;
          }
          ASSERT_TRUE(engine->AddPrefilled(r, std::move(choices)).ok());
        } else {
          ASSERT_TRUE(engine->AddRequest(r).ok());
        }
        live.push_back(r.request_id);
      }
      if (engine->has_unfinished()) {
        auto out = engine->Step();
        if (!out.ok() && !held.empty()) {
          // Hand-offs hold every block (as a prefill worker's in-flight pages do): release them.
          for (PrefillHandoff& h : held) engine->ReleaseHandoff(h);
          held.clear();
          out = engine->Step();
        }
        ASSERT_TRUE(out.ok()) << out.status();
      }
      for (PrefillHandoff& h : engine->TakeHandoffs()) held.push_back(h);
      if (!held.empty() && rng() % 3 == 0) {
        const size_t i = rng() % held.size();
        engine->ReleaseHandoff(held[i]);
        held.erase(held.begin() + static_cast<std::ptrdiff_t>(i));
      }
      if (!live.empty() && rng() % 3 == 0) {
        const size_t i = rng() % live.size();
        engine->Abort(live[i]);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      }
    }
    for (const std::string& id : live) engine->Abort(id);
    for (PrefillHandoff& h : held) engine->ReleaseHandoff(h);
    while (engine->has_unfinished()) ASSERT_TRUE(engine->Step().ok());
    for (PrefillHandoff& h : engine->TakeHandoffs()) engine->ReleaseHandoff(h);
    const EngineStats stats = engine->stats();
    EXPECT_EQ(stats.kv_blocks_used, 0);
    EXPECT_GT(stats.prefix_cache_hits_tokens, 0);
  }
}

}  // namespace
}  // namespace tandem::engine
