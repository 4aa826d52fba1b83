#include "tandem/engine/sampler.h"

#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tandem/grammar/grammar.h"
#include "tandem/grammar/matcher.h"

namespace tandem::engine {
namespace {

using ::testing::HasSubstr;

Sequence MakeSeq(SamplingParams p, std::vector<int32_t> prompt = {0}, uint64_t seed = 1) {
  Sequence seq;
  seq.tokens = prompt;
  seq.num_prompt_tokens = static_cast<int>(prompt.size());
  seq.params = std::make_shared<SamplingParams>(std::move(p));
  seq.rng = SamplerRng(seed);
  return seq;
}

int32_t SampleOnce(Sampler& sampler, std::vector<float> logits, Sequence& seq) {
  return sampler.Sample(logits, seq);
}

TEST(SamplerTest, GreedyPicksTheArgmaxWithTiesToTheLowestId) {
  Sampler sampler({});
  Sequence seq = MakeSeq({.temperature = 0});
  EXPECT_EQ(SampleOnce(sampler, {0.1f, 2.0f, -1.0f, 2.0f}, seq), 1);
}

TEST(SamplerTest, LogitBiasShiftsLogitsBeforeTheDrawNotTheLogprobs) {
  Sampler sampler({});
  SamplingParams p{.temperature = 0, .logprobs = 0};
  p.logit_bias = {{0, 5.0f}, {1, -100.0f}};
  Sequence seq = MakeSeq(p);
  // Without the bias 1 is the argmax; with it 0 wins, and its logprob is the model's own.
  EXPECT_EQ(SampleOnce(sampler, {1.0f, 3.0f, 2.0f}, seq), 0);
  const double z = std::log(std::exp(1.0) + std::exp(3.0) + std::exp(2.0));
  EXPECT_NEAR(seq.last_logprob, 1.0 - z, 1e-5);
  // -100 all but bans a token at any temperature.
  SamplingParams hot{.temperature = 2};
  hot.logit_bias = {{1, -100.0f}};
  Sequence s2 = MakeSeq(hot, {0}, 5);
  for (int i = 0; i < 2000; ++i) EXPECT_NE(SampleOnce(sampler, {0.0f, 10.0f, 0.0f}, s2), 1);
}

TEST(SamplerTest, EmpiricalFrequenciesFollowTheSoftmaxAtTemperature) {
  Sampler sampler({});
  const std::vector<float> logits = {0.0f, 1.0f, 2.0f, -1.0f};
  for (float t : {1.0f, 0.5f}) {
    Sequence seq = MakeSeq({.temperature = t}, {0}, 42);
    std::vector<int> counts(4, 0);
    const int draws = 40000;
    for (int i = 0; i < draws; ++i) ++counts[SampleOnce(sampler, logits, seq)];
    double z = 0;
    for (float l : logits) z += std::exp(l / t);
    for (int i = 0; i < 4; ++i) {
      double expected = std::exp(logits[i] / t) / z;
      EXPECT_NEAR(counts[i] / static_cast<double>(draws), expected, 0.01)
          << "t=" << t << " i=" << i;
    }
  }
}

TEST(SamplerTest, SameSeedSameTokensDifferentSeedDifferentTokens) {
  Sampler sampler({});
  std::vector<float> logits(50);
  for (int i = 0; i < 50; ++i) logits[i] = std::sin(i * 1.7f);
  auto run = [&](uint64_t seed) {
    Sequence seq = MakeSeq({.temperature = 1.0f}, {0}, seed);
    std::vector<int32_t> out;
    for (int i = 0; i < 32; ++i) out.push_back(SampleOnce(sampler, logits, seq));
    return out;
  };
  EXPECT_EQ(run(7), run(7));
  EXPECT_NE(run(7), run(8));
}

TEST(SamplerTest, TopKOneAndTinyTopPAreGreedy) {
  Sampler sampler({});
  const std::vector<float> logits = {0.5f, 0.4f, 3.0f, 0.2f};
  for (int i = 0; i < 200; ++i) {
    Sequence a = MakeSeq({.temperature = 1.5f, .top_k = 1}, {0}, i);
    EXPECT_EQ(SampleOnce(sampler, logits, a), 2);
    Sequence b = MakeSeq({.temperature = 1.5f, .top_p = 0.01f}, {0}, i);
    EXPECT_EQ(SampleOnce(sampler, logits, b), 2);
  }
}

TEST(SamplerTest, TopKAndTopPNeverSampleOutsideTheirSets) {
  Sampler sampler({});
  // probabilities ~ 0.5, 0.3, 0.15, 0.05
  const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.15f),
                                     std::log(0.05f)};
  std::map<int, int> k2, p75;
  for (int i = 0; i < 5000; ++i) {
    Sequence a = MakeSeq({.temperature = 1.0f, .top_k = 2}, {0}, i);
    ++k2[SampleOnce(sampler, logits, a)];
    Sequence b = MakeSeq({.temperature = 1.0f, .top_p = 0.75f}, {0}, i);
    ++p75[SampleOnce(sampler, logits, b)];
  }
  EXPECT_EQ(k2.size(), 2u);
  EXPECT_TRUE(k2.count(0) && k2.count(1));
  EXPECT_EQ(p75.size(), 2u);  // 0.5 + 0.3 reaches 0.75
  EXPECT_NEAR(p75[0] / 5000.0, 0.5 / 0.8, 0.03);
}

TEST(SamplerTest, MinPDropsTokensBelowTheScaledThreshold) {
  Sampler sampler({});
  const std::vector<float> logits = {std::log(0.6f), std::log(0.3f), std::log(0.1f)};
  for (int i = 0; i < 2000; ++i) {
    Sequence s = MakeSeq({.temperature = 1.0f, .min_p = 0.2f}, {0}, i);  // threshold 0.12
    EXPECT_NE(SampleOnce(sampler, logits, s), 2);
  }
}

TEST(SamplerTest, RepetitionPenaltyDemotesSeenTokens) {
  Sampler sampler({});
  Sequence seq = MakeSeq({.temperature = 0, .repetition_penalty = 2.0f}, {1});
  // Token 1 (in the prompt) 2.0 -> 1.0 falls below token 0's 1.5.
  EXPECT_EQ(SampleOnce(sampler, {1.5f, 2.0f, 0.0f}, seq), 0);
  // Negative logits are multiplied, not divided.
  Sequence neg = MakeSeq({.temperature = 0, .repetition_penalty = 2.0f}, {1});
  EXPECT_EQ(SampleOnce(sampler, {-1.5f, -1.0f, -2.5f}, neg), 0);
}

TEST(SamplerTest, PresenceAndFrequencyPenaltiesCountOutputTokensOnly) {
  Sampler sampler({});
  // Prompt holds token 0 three times: no effect. Output holds token 1 twice.
  Sequence seq =
      MakeSeq({.temperature = 0, .presence_penalty = 0.5f, .frequency_penalty = 0.5f}, {0, 0, 0});
  seq.tokens.push_back(1);
  seq.tokens.push_back(1);
  // token 1: 3.0 - (0.5*2 + 0.5) = 1.5 < token 0's 2.0
  EXPECT_EQ(SampleOnce(sampler, {2.0f, 3.0f, 0.0f}, seq), 0);
  Sequence only_presence = MakeSeq({.temperature = 0, .presence_penalty = 0.5f}, {0});
  only_presence.tokens.push_back(1);
  EXPECT_EQ(SampleOnce(sampler, {2.0f, 2.4f, 0.0f}, only_presence), 0);
}

TEST(SamplerTest, MinTokensMasksEosAndStopIds) {
  Sampler sampler({2});
  Sequence seq = MakeSeq({.temperature = 0, .min_tokens = 2, .stop_token_ids = {1}});
  EXPECT_EQ(SampleOnce(sampler, {0.0f, 5.0f, 9.0f, 1.0f}, seq), 3);
  seq.tokens.push_back(3);
  seq.tokens.push_back(3);
  EXPECT_EQ(SampleOnce(sampler, {0.0f, 5.0f, 9.0f, 1.0f}, seq), 2);
}

TEST(SamplerTest, LogprobsAreThoseOfTheRawDistribution) {
  Sampler sampler({});
  const std::vector<float> logits = {1.0f, 2.0f, 3.0f};
  Sequence seq = MakeSeq({.temperature = 0, .repetition_penalty = 5.0f, .logprobs = 2}, {2});
  int32_t token = SampleOnce(sampler, logits, seq);
  EXPECT_EQ(token, 1);  // the penalty moved the choice...
  double z = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0));
  EXPECT_NEAR(seq.last_logprob, 2.0 - z, 1e-5);  // ...but not the reported logprob
  ASSERT_EQ(seq.last_top_logprobs.size(), 2u);
  EXPECT_EQ(seq.last_top_logprobs[0].token, 2);
  EXPECT_NEAR(seq.last_top_logprobs[0].logprob, 3.0 - z, 1e-5);
  EXPECT_EQ(seq.last_top_logprobs[1].token, 1);
}

// Speculative verification of a sampled draft: a draft drawn from q (SampleDraft over the
// draft's logits) and verified against the target's logits yields tokens distributed as the
// target's own distribution p, whatever q is; q = p accepts every draft.
struct DraftCase {
  const char* name;
  std::vector<float> draft_logits;
  SamplingParams params;
};

TEST(SamplerTest, SampledDraftsVerifiedAgainstTheTargetFollowTheTarget) {
  const std::vector<float> target = {0.5f, 2.0f, -1.0f, 1.0f, 0.0f, 1.5f};
  SamplingParams plain{.temperature = 0.8f};
  SamplingParams truncated{.temperature = 0.8f, .top_p = 0.9f, .top_k = 4};
  for (const DraftCase& c : std::vector<DraftCase>{
           {"a different draft", {2.0f, 0.0f, 1.0f, -1.0f, 1.5f, 0.5f}, plain},
           {"the same draft", target, plain},
           {"top-k and top-p, a different draft", {0.0f, 0.0f, 3.0f, 0.0f, 0.0f, 0.0f}, truncated},
       }) {
    SCOPED_TRACE(c.name);
    // p: the target's own draws.
    Sampler sampler({});
    Sequence plain_seq = MakeSeq(c.params, {0}, 7);
    std::vector<double> want(target.size(), 0);
    const int draws = 60000;
    for (int i = 0; i < draws; ++i) ++want[SampleOnce(sampler, target, plain_seq)];
    Sequence seq = MakeSeq(c.params, {0}, 8);
    std::vector<double> got(target.size(), 0);
    int accepted = 0;
    for (int i = 0; i < draws; ++i) {
      DraftDistribution q;
      std::vector<float> draft_row = c.draft_logits;
      const int32_t draft = sampler.SampleDraft(draft_row, seq, &q);
      ASSERT_GT(q.Probability(draft), 0.0);
      std::vector<float> row = target;
      const int32_t token = sampler.Sample(row, seq, draft, nullptr, &q);
      ++got[token];
      accepted += token == draft;
    }
    for (size_t t = 0; t < target.size(); ++t) {
      // Binomial standard error at 60,000 draws is at most 0.002; 0.01 is five of them.
      EXPECT_NEAR(got[t] / draws, want[t] / draws, 0.01) << "token " << t;
    }
    if (c.draft_logits == target) EXPECT_EQ(accepted, draws);
    if (c.params.top_k > 0) {
      // Tokens outside the target's top-k never come out, though the draft proposes them.
      EXPECT_EQ(got[2], 0);
      EXPECT_EQ(got[4], 0);
    }
  }
}

TEST(SamplerTest, SampledDraftKeepsItsMostLikelyTokensAndSeesTheDraftsBefore) {
  Sampler sampler({});
  std::vector<float> logits(1000, 0.0f);
  for (int i = 0; i < 1000; ++i) logits[i] = static_cast<float>(i % 97) * 0.05f;
  Sequence seq = MakeSeq({.temperature = 1.0f}, {0}, 3);
  DraftDistribution q;
  std::vector<float> row = logits;
  sampler.SampleDraft(row, seq, &q);
  ASSERT_EQ(q.ids.size(), static_cast<size_t>(Sampler::kMaxDraftCandidates));
  double sum = 0;
  float least_kept = 1e9f;
  std::vector<bool> kept(1000, false);
  for (size_t i = 0; i < q.ids.size(); ++i) {
    sum += q.probs[i];
    least_kept = std::min(least_kept, logits[q.ids[i]]);
    kept[q.ids[i]] = true;
  }
  EXPECT_NEAR(sum, 1.0, 1e-5);
  for (int i = 0; i < 1000; ++i) {
    if (!kept[i]) EXPECT_LE(logits[i], least_kept) << "token " << i << " is more likely";
  }
  // A repetition penalty on the drafts already in seq.tokens (as DraftStep places them) moves
  // the draft's mass away from them, as it moves the target's at that position.
  const SamplingParams penalty{.temperature = 1.0f, .repetition_penalty = 100.0f};
  Sequence before = MakeSeq(penalty, {0}, 3);
  std::vector<float> peaked = {0.0f, 5.0f, 0.0f};
  DraftDistribution unpenalised;
  sampler.SampleDraft(peaked, before, &unpenalised);
  EXPECT_GT(unpenalised.Probability(1), 0.95);  // softmax(0, 5, 0)
  Sequence after = MakeSeq(penalty, {0}, 3);
  after.tokens.push_back(1);  // an earlier draft
  peaked = {0.0f, 5.0f, 0.0f};
  DraftDistribution penalised;
  sampler.SampleDraft(peaked, after, &penalised);
  EXPECT_NEAR(penalised.Probability(1),
              std::exp(0.05) / (2 + std::exp(0.05)), 1e-5);  // softmax(0, 5 / 100, 0)
}

TEST(SamplingParamsTest, RejectsOutOfRangeValuesNamingTheField) {
  struct Case {
    SamplingParams p;
    const char* field;
  };
  std::vector<Case> cases = {
      {{.temperature = -0.1f}, "temperature"},
      {{.temperature = NAN}, "temperature"},
      {{.top_p = 0.0f}, "top_p"},
      {{.top_p = 1.5f}, "top_p"},
      {{.top_k = -2}, "top_k"},
      {{.min_p = 2.0f}, "min_p"},
      {{.repetition_penalty = 0.0f}, "repetition_penalty"},
      {{.presence_penalty = 3.0f}, "presence_penalty"},
      {{.frequency_penalty = -2.5f}, "frequency_penalty"},
      {{.max_tokens = 0}, "max_tokens"},
      {{.stop_token_ids = {100}}, "stop_token_ids"},
      {{.stop = {""}}, "stop"},
      {{.n = 0}, "n"},
      {{.n = 17}, "n"},
      {{.logprobs = 21}, "logprobs"},
  };
  for (const Case& c : cases) {
    absl::Status s = c.p.Validate(50);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.field));
  }
  EXPECT_TRUE(SamplingParams{}.Validate(50).ok());
}

}  // namespace
}  // namespace tandem::engine

namespace tandem::engine {
namespace {

// A vocabulary of single characters and a few longer pieces; id 0 is EOS.
std::shared_ptr<const grammar::CompiledGrammar> CompileForTest(const std::string& gbnf,
                                                               std::vector<std::string>* pieces) {
  *pieces = {"<eos>", "a", "b", "ab", "ba", "{", "}", "\"", "x", "\"}", "{\"", "1", "12", " "};
  auto vocab = grammar::TokenVocabulary::Create(*pieces, {0}, {});
  EXPECT_TRUE(vocab.ok()) << vocab.status();
  auto g = grammar::ParseGbnf(gbnf);
  EXPECT_TRUE(g.ok()) << g.status();
  auto compiled = grammar::CompiledGrammar::Create(*g, *vocab);
  EXPECT_TRUE(compiled.ok()) << compiled.status();
  return *compiled;
}

TEST(ConstrainedSamplerTest, EveryDrawIsAllowedAndEosOnlyWhereTheGrammarEnds) {
  std::vector<std::string> pieces;
  auto compiled = CompileForTest(
      "root ::= \"{\" (\"\\\"\" [ab]* \"\\\"\")? \"}\" | [0-9]+ | \"a\" \"b\"*\n", &pieces);
  const int vocab = static_cast<int>(pieces.size());
  std::vector<SamplingParams> settings(6);
  settings[0].temperature = 0;
  settings[1].temperature = 1;
  settings[2].top_k = 2;
  settings[3].top_p = 0.3f, settings[3].temperature = 2;
  settings[4].repetition_penalty = 2, settings[4].presence_penalty = 2, settings[4].min_p = 0.2f;
  settings[5].min_tokens = 4, settings[5].frequency_penalty = -2;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0, 3);
  int finished = 0;
  for (size_t s = 0; s < settings.size(); ++s) {
    for (int trial = 0; trial < 200; ++trial) {
      Sampler sampler({0});
      Sequence seq = MakeSeq(settings[s], {1}, 1000 * s + trial);
      seq.matcher = std::make_unique<grammar::GrammarMatcher>(compiled, 0);
      for (int step = 0; step < 30 && !seq.matcher->IsTerminated(); ++step) {
        std::vector<float> logits(vocab);
        for (float& l : logits) l = normal(rng);
        const bool complete = seq.matcher->IsComplete();
        const int32_t token = SampleOnce(sampler, logits, seq);
        ASSERT_GE(token, 0);
        ASSERT_LT(token, vocab);
        if (token == 0) ASSERT_TRUE(complete) << "EOS before the grammar may end";
        ASSERT_TRUE(seq.matcher->AcceptToken(token))
            << "setting " << s << " drew '" << pieces[token] << "' outside the mask";
        seq.tokens.push_back(token);
      }
      finished += seq.matcher->IsTerminated();
    }
  }
  EXPECT_GT(finished, 0);
}

TEST(ConstrainedSamplerTest, ADeadEndGivesMinusOne) {
  std::vector<std::string> pieces;
  auto compiled = CompileForTest("root ::= \"a\" \"q\"\n", &pieces);  // no token holds "q"
  Sampler sampler({0});
  Sequence seq = MakeSeq({.temperature = 1});
  seq.matcher = std::make_unique<grammar::GrammarMatcher>(compiled, 0);
  std::vector<float> logits(pieces.size(), 0.0f);
  ASSERT_EQ(SampleOnce(sampler, logits, seq), 1);  // "a"
  ASSERT_TRUE(seq.matcher->AcceptToken(1));
  EXPECT_EQ(SampleOnce(sampler, logits, seq), -1);
}

TEST(ConstrainedSamplerTest, MinTokensGivesWayWhenTheGrammarCanOnlyEnd) {
  std::vector<std::string> pieces;
  auto compiled = CompileForTest("root ::= \"ab\"\n", &pieces);
  Sampler sampler({0});
  SamplingParams p;
  p.temperature = 0;
  p.min_tokens = 5;
  p.logprobs = 0;
  Sequence seq = MakeSeq(p);
  seq.matcher = std::make_unique<grammar::GrammarMatcher>(compiled, 0);
  std::vector<float> logits(pieces.size(), 0.0f);
  logits[3] = 1;
  ASSERT_EQ(SampleOnce(sampler, logits, seq), 3);  // "ab": "a" and "ab" are allowed
  ASSERT_TRUE(seq.matcher->AcceptToken(3));
  seq.tokens.push_back(3);
  EXPECT_EQ(SampleOnce(sampler, logits, seq), 0);  // EOS, although min_tokens masks it
  EXPECT_LE(seq.last_logprob, 0.0f);
}

}  // namespace
}  // namespace tandem::engine
