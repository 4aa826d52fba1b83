// Prefill on one engine, KV pages moved by a kvtransfer agent, decode on another: the output
// must equal a colocated engine's, token for token.
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tandem/engine/llm_engine.h"
#include "tandem/kvtransfer/agent.h"
#include "test_models.h"

namespace tandem::engine {
namespace {

constexpr int64_t kKvBytes = 24ll << 20;

std::unique_ptr<LlmEngine> MakeEngine(EngineRole role, SpeculativeOptions speculative = {}) {
  EngineOptions options;
  options.speculative = speculative;
  options.model_dir = testing::TinyModel("qwen3", DType::kBF16);
  options.num_threads = 2;
  options.kv_cache_bytes = kKvBytes;
  options.max_num_batched_tokens = 64;  // prompts span several prefill chunks
  options.role = role;
  auto engine = LlmEngine::Create(options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return std::move(engine).value();
}

// With `constrained`, every request's output is held to a grammar (structured outputs): the
// decode engine rebuilds each sample's matcher from the first token the prefill engine sent.
std::vector<GenerateRequest> MakeRequests(int count, int vocab, bool constrained = false) {
  std::mt19937 rng(count);
  std::vector<GenerateRequest> requests;
  for (int i = 0; i < count; ++i) {
    SamplingParams p;
    p.max_tokens = 12 + i % 5;
    p.ignore_eos = true;
    if (constrained) {
      static const StructuredOutput kConstraints[] = {
          {ConstraintKind::kJsonObject, ""},
          {ConstraintKind::kJsonSchema,
           R"({"type":"object","properties":{"a":{"type":"string","maxLength":4},)"
           R"("b":{"type":"integer"}},"required":["a","b"],"additionalProperties":false})"},
          {ConstraintKind::kRegex, "[a-z]{2,8}( [0-9]+)?"},
          {ConstraintKind::kGrammar, "root ::= \"yes\" | \"no\"\n"}};
      p.structured = kConstraints[i % 4];
      p.max_tokens = 40;
    }
    p.logprobs = 1;
    if (i % 2 == 0) {
      p.temperature = 0;
    } else {
      p.temperature = 0.8f;
      p.seed = 100 + i;
      p.n = 1 + i % 3;
    }
    std::vector<int32_t> prompt(70 + static_cast<int>(rng() % 150));
    for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % vocab);
    requests.push_back({absl::StrCat("req", i), prompt, p});
  }
  return requests;
}

// (kv backend, requests, constrained, speculative): with `speculative` the decode engine
// verifies n-gram proposals (speculative decoding), and its greedy samples still equal the
// colocated engine's without speculation (seeded ones draw their random stream differently, so
// they are only checked to finish).
class DisaggregationTest
    : public ::testing::TestWithParam<std::tuple<std::string, int, bool, bool>> {};

TEST_P(DisaggregationTest, OutputEqualsColocatedTokenForToken) {
  const auto& [backend, concurrency, constrained, speculative] = GetParam();
  auto colocated = MakeEngine(EngineRole::kColocated);
  // A prefill engine ignores speculation (it samples first tokens only).
  const SpeculativeOptions spec = speculative
                                      ? SpeculativeOptions{.method = SpeculativeMethod::kNgram,
                                                           .num_speculative_tokens = 4,
                                                           .adaptive = false}
                                      : SpeculativeOptions{};
  auto prefill = MakeEngine(EngineRole::kPrefill, spec);
  auto decode = MakeEngine(EngineRole::kDecode, spec);
  const std::vector<GenerateRequest> requests =
      MakeRequests(concurrency, colocated->config().vocab_size, constrained);
  auto expected = GenerateAll(*colocated, requests);
  ASSERT_TRUE(expected.ok()) << expected.status();

  // The prefill side pushes into the decode side's cache, as separate workers would.
  auto sender = kvtransfer::Agent::Create({.backend = backend, .name = "prefill"});
  auto receiver = kvtransfer::Agent::Create({.backend = backend, .name = "decode"});
  ASSERT_TRUE(sender.ok() && receiver.ok());
  ASSERT_TRUE((*sender)->RegisterMemory(1, prefill->kv_cache(), prefill->kv_cache_bytes()).ok());
  auto descriptor = (*receiver)->RegisterMemory(2, decode->kv_cache(), decode->kv_cache_bytes());
  ASSERT_TRUE(descriptor.ok()) << descriptor.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  auto peer = (*sender)->Connect((*receiver)->address(), deadline);
  ASSERT_TRUE(peer.ok()) << peer.status();

  std::map<std::string, const GenerateRequest*> by_id;
  std::map<std::string, std::vector<PrefillHandoff>> handoffs;
  for (const GenerateRequest& r : requests) {
    by_id[r.request_id] = &r;
    ASSERT_TRUE(prefill->AddRequest(r).ok());
  }
  std::map<std::string, RequestOutput> got;
  for (const GenerateRequest& r : requests) {
    got[r.request_id].choices.resize(r.params.n);
  }
  while (prefill->has_unfinished() || decode->has_unfinished() || !handoffs.empty()) {
    if (prefill->has_unfinished()) ASSERT_TRUE(prefill->Step().ok());
    for (PrefillHandoff& h : prefill->TakeHandoffs()) handoffs[h.request_id].push_back(h);
    // A request moves once all its samples are prefilled.
    for (auto it = handoffs.begin(); it != handoffs.end();) {
      const GenerateRequest& request = *by_id.at(it->first);
      if (static_cast<int>(it->second.size()) < request.params.n) {
        ++it;
        continue;
      }
      std::vector<PrefilledChoice> choices(request.params.n);
      for (PrefillHandoff& h : it->second) {
        auto reserved = decode->ReserveBlocks(static_cast<int>(request.prompt_tokens.size()));
        ASSERT_TRUE(reserved.ok()) << reserved.status();
        auto ranges =
            KvBlockCopyRanges(prefill->cache_layout(), decode->cache_layout(), h.blocks, *reserved);
        ASSERT_TRUE(ranges.ok()) << ranges.status();
        std::vector<kvtransfer::Range> wire;
        for (const KvCopyRange& r : *ranges) wire.push_back({r.src_offset, r.dst_offset, r.bytes});
        auto handle = (*sender)->Submit(*peer, 1, *descriptor, std::move(wire), deadline);
        ASSERT_TRUE(handle.ok()) << handle.status();
        ASSERT_TRUE((*handle)->Wait().ok());
        prefill->ReleaseHandoff(h);
        choices[h.choice_index] = {h.first_token, h.first_logprob, h.first_top_logprobs,
                                   h.rng_state, *reserved};
      }
      ASSERT_TRUE(decode->AddPrefilled(request, std::move(choices)).ok());
      it = handoffs.erase(it);
    }
    if (decode->has_unfinished()) {
      auto outputs = decode->Step();
      ASSERT_TRUE(outputs.ok()) << outputs.status();
      for (RequestOutput& out : *outputs) {
        for (ChoiceDelta& d : out.choices) {
          AccumulateDelta(got[out.request_id].choices[d.index], d);
        }
      }
    }
  }
  for (size_t i = 0; i < requests.size(); ++i) {
    const RequestOutput& want = (*expected)[i];
    const RequestOutput& have = got[requests[i].request_id];
    for (size_t c = 0; c < want.choices.size(); ++c) {
      if (speculative && !requests[i].params.greedy()) {
        EXPECT_NE(have.choices[c].finish_reason, FinishReason::kNone) << i << "/" << c;
        EXPECT_LE(static_cast<int>(have.choices[c].token_ids.size()),
                  requests[i].params.max_tokens);
        continue;
      }
      EXPECT_EQ(have.choices[c].token_ids, want.choices[c].token_ids) << i << "/" << c;
      EXPECT_EQ(have.choices[c].logprobs, want.choices[c].logprobs) << i << "/" << c;
      EXPECT_EQ(have.choices[c].text, want.choices[c].text) << i << "/" << c;
      EXPECT_EQ(have.choices[c].finish_reason,
                constrained ? want.choices[c].finish_reason : FinishReason::kLength);
    }
  }
  // Enough samples for the proposer to find repeats in (random models' output loops).
  if (speculative && concurrency >= 32) EXPECT_GT(decode->stats().spec_accepted_tokens, 0);
  EXPECT_EQ(prefill->stats().spec_proposed_tokens, 0);
  // Nothing leaks on either side.
  EXPECT_EQ(prefill->stats().kv_blocks_used, 0);
  EXPECT_EQ(decode->stats().kv_blocks_used, 0);
}

// Multi-turn conversations with prefix caching on both sides: each turn the decode engine's
// reservation shares the blocks it already holds (the history's prompt and the answer it
// generated), only the blocks after them are copied, the prefill engine computes only what its
// own cache lacks, and the output equals a colocated engine's without any cache.
TEST(DisaggregationPrefixCacheTest, OnlyWhatTheDecodeEngineLacksMoves) {
  EngineOptions options;
  options.model_dir = testing::TinyModel("qwen3", DType::kBF16);
  options.num_threads = 2;
  options.kv_cache_bytes = kKvBytes;
  options.max_num_batched_tokens = 64;
  options.enable_prefix_caching = false;
  auto colocated = LlmEngine::Create(options);
  options.enable_prefix_caching = true;
  options.role = EngineRole::kPrefill;
  auto prefill = LlmEngine::Create(options);
  options.role = EngineRole::kDecode;
  auto decode = LlmEngine::Create(options);
  ASSERT_TRUE(colocated.ok() && prefill.ok() && decode.ok());
  auto sender = kvtransfer::Agent::Create({.backend = "local", .name = "prefill"});
  auto receiver = kvtransfer::Agent::Create({.backend = "local", .name = "decode"});
  ASSERT_TRUE(sender.ok() && receiver.ok());
  ASSERT_TRUE(
      (*sender)->RegisterMemory(1, (*prefill)->kv_cache(), (*prefill)->kv_cache_bytes()).ok());
  auto descriptor =
      (*receiver)->RegisterMemory(2, (*decode)->kv_cache(), (*decode)->kv_cache_bytes());
  ASSERT_TRUE(descriptor.ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  auto peer = (*sender)->Connect((*receiver)->address(), deadline);
  ASSERT_TRUE(peer.ok());
  const int bs = (*decode)->cache_layout().block_size;
  const int vocab = (*colocated)->config().vocab_size;

  std::mt19937 rng(12);
  std::vector<int32_t> history(90);
  for (int32_t& t : history) t = static_cast<int32_t>(rng() % vocab);
  int64_t moved_blocks = 0, prompt_blocks = 0;
  for (int turn = 0; turn < 4; ++turn) {
    SCOPED_TRACE(absl::StrCat("turn ", turn));
    GenerateRequest request{absl::StrCat("t", turn), history, {}};
    request.params.max_tokens = 9;
    request.params.ignore_eos = true;
    request.params.logprobs = 1;
    request.params.temperature = turn % 2 ? 0.8f : 0.0f;
    request.params.seed = 40 + turn;
    request.params.n = turn == 3 ? 2 : 1;
    auto expected = GenerateAll(**colocated, {request});
    ASSERT_TRUE(expected.ok());

    const int len = static_cast<int>(history.size());
    const int64_t prefill_hits = (*prefill)->stats().prefix_cache_hits_tokens;
    ASSERT_TRUE((*prefill)->AddRequest(request).ok());
    std::vector<PrefillHandoff> handoffs;
    while ((*prefill)->has_unfinished()) {
      ASSERT_TRUE((*prefill)->Step().ok());
      for (PrefillHandoff& h : (*prefill)->TakeHandoffs()) handoffs.push_back(h);
    }
    ASSERT_EQ(static_cast<int>(handoffs.size()), request.params.n);
    if (turn > 0) {
      // The previous prompt's whole blocks were cached on the prefill side.
      EXPECT_GE((*prefill)->stats().prefix_cache_hits_tokens - prefill_hits,
                (len - 9 - 20) / bs * bs);
    }
    std::vector<PrefilledChoice> choices(request.params.n);
    for (PrefillHandoff& h : handoffs) {
      int cached = 0;
      auto reserved = (*decode)->ReserveBlocks(len, history, "", &cached);
      ASSERT_TRUE(reserved.ok()) << reserved.status();
      // The previous turn's prompt and all but the last of its 9 answer tokens.
      EXPECT_EQ(cached, turn == 0 ? 0 : (len - 20 - 1) / bs * bs);
      BlockTable src(h.blocks.begin() + cached / bs, h.blocks.end());
      BlockTable dst(reserved->begin() + cached / bs, reserved->end());
      moved_blocks += static_cast<int64_t>(dst.size());
      prompt_blocks += static_cast<int64_t>(reserved->size());
      auto ranges =
          KvBlockCopyRanges((*prefill)->cache_layout(), (*decode)->cache_layout(), src, dst);
      ASSERT_TRUE(ranges.ok()) << ranges.status();
      std::vector<kvtransfer::Range> wire;
      for (const KvCopyRange& r : *ranges) wire.push_back({r.src_offset, r.dst_offset, r.bytes});
      if (!wire.empty()) {
        auto handle = (*sender)->Submit(*peer, 1, *descriptor, std::move(wire), deadline);
        ASSERT_TRUE(handle.ok()) << handle.status();
        ASSERT_TRUE((*handle)->Wait().ok());
      }
      (*prefill)->ReleaseHandoff(h);
      choices[h.choice_index] = {h.first_token, h.first_logprob, h.first_top_logprobs, h.rng_state,
                                 *reserved};
    }
    ASSERT_TRUE((*decode)->AddPrefilled(request, std::move(choices)).ok());
    RequestOutput got;
    got.choices.resize(request.params.n);
    while ((*decode)->has_unfinished()) {
      auto outputs = (*decode)->Step();
      ASSERT_TRUE(outputs.ok()) << outputs.status();
      for (RequestOutput& out : *outputs) {
        for (ChoiceDelta& d : out.choices) AccumulateDelta(got.choices[d.index], d);
      }
    }
    for (int c = 0; c < request.params.n; ++c) {
      EXPECT_EQ(got.choices[c].token_ids, (*expected)[0].choices[c].token_ids) << c;
      EXPECT_EQ(got.choices[c].logprobs, (*expected)[0].choices[c].logprobs) << c;
    }
    EXPECT_EQ((*prefill)->stats().kv_blocks_used, 0);
    EXPECT_EQ((*decode)->stats().kv_blocks_used, 0);
    history.insert(history.end(), got.choices[0].token_ids.begin(), got.choices[0].token_ids.end());
    for (int i = 0; i < 20; ++i) history.push_back(static_cast<int32_t>(rng() % vocab));
  }
  // Most of each later prompt was already on the decode side.
  EXPECT_LT(moved_blocks * 2, prompt_blocks);
}

INSTANTIATE_TEST_SUITE_P(BackendsAndConcurrency, DisaggregationTest,
                         ::testing::Combine(::testing::Values("local", "ucx"),
                                            ::testing::Values(1, 8, 32), ::testing::Values(false),
                                            ::testing::Values(false)));
INSTANTIATE_TEST_SUITE_P(StructuredOutputs, DisaggregationTest,
                         ::testing::Combine(::testing::Values("local"), ::testing::Values(8),
                                            ::testing::Values(true), ::testing::Bool()));
INSTANTIATE_TEST_SUITE_P(SpeculativeDecode, DisaggregationTest,
                         ::testing::Combine(::testing::Values("local"), ::testing::Values(8, 32),
                                            ::testing::Values(false), ::testing::Values(true)));

}  // namespace
}  // namespace tandem::engine
