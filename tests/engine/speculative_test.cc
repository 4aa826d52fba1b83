// Speculative decoding as a user of one engine sees it: with n-gram, early-exit or draft-model
// proposals verified in one step, greedy outputs (tokens, logprobs, text, finish reasons) are
// those of the engine without speculation, bit for bit, whatever the stop strings, max_tokens,
// min_tokens, n, prefix caching or grammar; sampled outputs follow the same distribution (a
// chi-square test over 20,000 seeded samples of a small-vocabulary model); rejected tokens
// leave no KV block behind.
#include "tandem/engine/speculative.h"

#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <random>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tandem/engine/block_manager.h"
#include "tandem/engine/engine_metrics.h"
#include "tandem/engine/llm_engine.h"
#include "tandem/engine/step_latency_model.h"
#include "test_models.h"

namespace tandem::engine {
namespace {

// Fixed draft lengths (no adaptive controller, which follows measured step times): what a test
// sees must not depend on the machine's speed.
SpeculativeOptions Ngram(int k, int ngram_min = 1, int ngram_max = 3) {
  return {.method = SpeculativeMethod::kNgram,
          .num_speculative_tokens = k,
          .ngram_min = ngram_min,
          .ngram_max = ngram_max,
          .adaptive = false};
}

std::unique_ptr<LlmEngine> MakeEngine(const std::string& model, SpeculativeOptions spec,
                                      bool prefix_caching = true, int max_num_seqs = 16,
                                      StepTelemetry::Clock clock = nullptr) {
  EngineOptions options;
  options.clock = std::move(clock);
  options.model_dir = model;
  options.num_threads = 2;
  options.kv_cache_bytes = 16ll << 20;
  options.max_num_seqs = max_num_seqs;
  options.max_num_batched_tokens = 256;
  options.enable_prefix_caching = prefix_caching;
  options.speculative = spec;
  auto engine = LlmEngine::Create(options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

// A clock that advances 1 ms at each reading: the engine's step and draft-pass times then count
// its readings (a step 1 ms; 3 when it ran draft passes, which take 1 of them), the same on any
// machine under any load.
StepTelemetry::Clock TickingClock() {
  auto now = std::make_shared<std::chrono::steady_clock::time_point>();
  return [now] { return *now += std::chrono::milliseconds(1); };
}

// Prompts that repeat themselves (as code, documents being edited and chat histories do), so
// that the n-gram proposer finds continuations to propose.
std::vector<int32_t> RepetitivePrompt(std::mt19937& rng, int vocab, int phrase, int repeats) {
  std::vector<int32_t> words(phrase);
  for (int32_t& w : words) w = static_cast<int32_t>(rng() % vocab);
  std::vector<int32_t> prompt;
  for (int r = 0; r < repeats; ++r) {
    prompt.insert(prompt.end(), words.begin(), words.end());
    prompt.push_back(static_cast<int32_t>(rng() % vocab));  // a variation per repeat
  }
  return prompt;
}

void ExpectSameOutputs(const std::vector<RequestOutput>& got,
                       const std::vector<RequestOutput>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].finished, want[i].finished);
    EXPECT_EQ(got[i].num_generation_tokens, want[i].num_generation_tokens) << got[i].request_id;
    ASSERT_EQ(got[i].choices.size(), want[i].choices.size()) << got[i].request_id;
    for (size_t c = 0; c < got[i].choices.size(); ++c) {
      const ChoiceDelta& g = got[i].choices[c];
      const ChoiceDelta& w = want[i].choices[c];
      const std::string where = absl::StrCat(got[i].request_id, " choice ", c);
      EXPECT_EQ(g.token_ids, w.token_ids) << where;
      EXPECT_EQ(g.logprobs, w.logprobs) << where;
      ASSERT_EQ(g.top_logprobs.size(), w.top_logprobs.size()) << where;
      for (size_t t = 0; t < g.top_logprobs.size(); ++t) {
        ASSERT_EQ(g.top_logprobs[t].size(), w.top_logprobs[t].size()) << where;
        for (size_t k = 0; k < g.top_logprobs[t].size(); ++k) {
          EXPECT_EQ(g.top_logprobs[t][k].token, w.top_logprobs[t][k].token) << where;
          EXPECT_EQ(g.top_logprobs[t][k].logprob, w.top_logprobs[t][k].logprob) << where;
        }
      }
      EXPECT_EQ(g.text, w.text) << where;
      EXPECT_EQ(g.finish_reason, w.finish_reason) << where;
    }
  }
}

// Greedy requests over the features that end or shape a sample.
std::vector<GenerateRequest> GreedyWorkload(const LlmEngine& engine,
                                            const std::vector<std::string>& stops) {
  const int vocab = engine.config().vocab_size;
  std::mt19937 rng(5);
  std::vector<GenerateRequest> requests;
  const int max_tokens[] = {1, 2, 5, 17, 40, 64};
  for (int i = 0; i < 12; ++i) {
    SamplingParams p{.temperature = 0, .max_tokens = max_tokens[i % 6], .logprobs = i % 3};
    p.ignore_eos = i % 4 != 0;
    if (i % 5 == 1) p.min_tokens = std::min(p.max_tokens, 9);
    if (i % 3 == 2) p.n = 2;
    if (i % 4 == 3) p.repetition_penalty = 1.3f;
    if (i % 6 == 4) p.frequency_penalty = 0.5f, p.presence_penalty = 0.25f;
    if (i % 7 == 5) p.logit_bias = {{static_cast<int32_t>(i), 3.0f}};
    if (!stops.empty() && i % 2 == 1) p.stop = {stops[i % stops.size()]};
    requests.push_back(
        {absl::StrCat("g", i), RepetitivePrompt(rng, vocab, 5 + i % 7, 2 + i % 4), p});
  }
  return requests;
}

std::vector<RequestOutput> RunAll(LlmEngine& engine, std::vector<GenerateRequest> requests) {
  auto out = GenerateAll(engine, std::move(requests));
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? *std::move(out) : std::vector<RequestOutput>{};
}

// Text snippets of the unspeculated greedy outputs, used as stop strings so that some samples
// stop mid-way on a string (possibly inside a run of accepted draft tokens).
std::vector<std::string> StopsFrom(const std::vector<RequestOutput>& outputs) {
  std::vector<std::string> stops;
  for (const RequestOutput& o : outputs) {
    const std::string& text = o.choices[0].text;
    if (text.size() >= 8) stops.push_back(text.substr(text.size() / 2, 2));
  }
  return stops;
}

SpeculativeOptions EarlyExit(int k, int draft_layers) {
  return {.method = SpeculativeMethod::kEarlyExit,
          .num_speculative_tokens = k,
          .draft_layers = draft_layers,
          .adaptive = false};
}

// The draft model is named in the test body (TinyDraftModel writes it on first use).
SpeculativeOptions DraftModel(int k) {
  return {.method = SpeculativeMethod::kDraftModel, .num_speculative_tokens = k, .adaptive = false};
}

struct GreedyCase {
  std::string name;
  SpeculativeOptions spec;
  bool prefix_caching = true;
};

void PrintTo(const GreedyCase& c, std::ostream* os) { *os << c.name; }

class SpeculativeGreedyTest : public ::testing::TestWithParam<GreedyCase> {};

TEST_P(SpeculativeGreedyTest, OutputsAreThoseWithoutSpeculation) {
  const GreedyCase& param = GetParam();
  const bool prefix_caching = param.prefix_caching;
  const int k = param.spec.num_speculative_tokens;
  const std::string model = testing::TinyModel("llama", DType::kBF16);
  SpeculativeOptions options = param.spec;
  if (options.method == SpeculativeMethod::kDraftModel) {
    options.draft_model = testing::TinyDraftModel("llama", DType::kBF16);
  }
  auto plain = MakeEngine(model, {}, prefix_caching);
  auto spec = MakeEngine(model, options, prefix_caching);
  ASSERT_NE(plain, nullptr);
  ASSERT_NE(spec, nullptr);
  const std::vector<std::string> stops = StopsFrom(RunAll(*plain, GreedyWorkload(*plain, {})));
  ASSERT_FALSE(stops.empty());
  const int64_t steps_before = plain->stats().steps;
  const std::vector<RequestOutput> want = RunAll(*plain, GreedyWorkload(*plain, stops));
  const int64_t plain_steps = plain->stats().steps - steps_before;
  // The speculating engine runs the first round too, so that both caches hold the same.
  ExpectSameOutputs(RunAll(*spec, GreedyWorkload(*spec, {})),
                    RunAll(*plain, GreedyWorkload(*plain, {})));
  const int64_t spec_steps_before = spec->stats().steps;
  const std::vector<RequestOutput> got = RunAll(*spec, GreedyWorkload(*spec, stops));
  ExpectSameOutputs(got, want);
  // Speculation happened: tokens were proposed and some accepted, fewer steps ran, and no
  // block of a rejected token stayed referenced.
  const EngineStats stats = spec->stats();
  EXPECT_GT(stats.spec_proposed_tokens, 0);
  EXPECT_GT(stats.spec_accepted_tokens, 0);
  EXPECT_LE(stats.spec_accepted_tokens, stats.spec_proposed_tokens);
  ASSERT_EQ(stats.spec_accepted_by_position.size(), static_cast<size_t>(k));
  EXPECT_EQ(stats.spec_proposed_by_position[0], stats.spec_verify_steps);
  EXPECT_LE(stats.steps - spec_steps_before, plain_steps)
      << stats.spec_accepted_tokens << " of " << stats.spec_proposed_tokens << " accepted";
  EXPECT_EQ(stats.kv_blocks_used, 0);
  EXPECT_EQ(plain->stats().spec_proposed_tokens, 0);
}

INSTANTIATE_TEST_SUITE_P(
    Methods, SpeculativeGreedyTest,
    ::testing::Values(GreedyCase{"ngram_k1", Ngram(1)}, GreedyCase{"ngram_k4", Ngram(4)},
                      GreedyCase{"ngram_k7", Ngram(7)},
                      GreedyCase{"ngram_k4_no_prefix_cache", Ngram(4), false},
                      GreedyCase{"ngram_k4_n2", Ngram(4, 2, 2)},
                      GreedyCase{"early_exit_k3", EarlyExit(3, 1)},
                      GreedyCase{"early_exit_k5_no_prefix_cache", EarlyExit(5, 1), false},
                      GreedyCase{"draft_model_k3", DraftModel(3)},
                      GreedyCase{"draft_model_k5_no_prefix_cache", DraftModel(5), false}),
    [](const ::testing::TestParamInfo<GreedyCase>& info) { return info.param.name; });

// A draft model that is the target's first layer proposes what early exit at one layer
// proposes: its own KV, caught up over each prompt and kept past every verification (rolled
// back to the accepted tokens), holds what the target's first layer computed. (They agree
// exactly on the machines measured; the bound leaves room for a kernel whose rounding depends
// on the batch.) A draft model that skipped the catch-up, reading no prompt KV, accepted
// 14.7% against early exit's 17.1% here.
TEST(SpeculativeTest, DraftModelOfTheFirstLayerProposesWhatEarlyExitDoes) {
  const std::string model = testing::TinyModel("llama");
  SpeculativeOptions draft = DraftModel(4);
  draft.draft_model = testing::TinyDraftModel("llama", DType::kF32);
  auto by_draft = MakeEngine(model, draft, /*prefix_caching=*/true, /*max_num_seqs=*/4);
  auto by_exit = MakeEngine(model, EarlyExit(4, 1), /*prefix_caching=*/true, /*max_num_seqs=*/4);
  ASSERT_NE(by_draft, nullptr);
  ASSERT_NE(by_exit, nullptr);
  // Long enough that prompts take several catch-up passes (256-token steps) and generations
  // many verifications; 4 sequences at a time, so that batches and preemption-free runs repeat.
  std::mt19937 rng(11);
  std::vector<GenerateRequest> requests;
  for (int i = 0; i < 6; ++i) {
    SamplingParams p{.temperature = 0, .max_tokens = 48, .ignore_eos = true};
    if (i % 3 == 1) p.n = 2;
    requests.push_back({absl::StrCat("d", i),
                        RepetitivePrompt(rng, by_draft->config().vocab_size, 30, 10 + i), p});
  }
  ExpectSameOutputs(RunAll(*by_draft, requests), RunAll(*by_exit, requests));
  const EngineStats d = by_draft->stats();
  const EngineStats e = by_exit->stats();
  ASSERT_GT(e.spec_proposed_tokens, 0);
  EXPECT_GT(e.spec_accepted_tokens, e.spec_proposed_tokens / 10);
  EXPECT_NEAR(static_cast<double>(d.spec_accepted_tokens) / d.spec_proposed_tokens,
              static_cast<double>(e.spec_accepted_tokens) / e.spec_proposed_tokens, 0.005)
      << d.spec_accepted_tokens << " of " << d.spec_proposed_tokens << " vs "
      << e.spec_accepted_tokens << " of " << e.spec_proposed_tokens;
  EXPECT_EQ(d.kv_blocks_used, 0);
}

// Prefix caching after speculation: a second round of the same prompts reuses blocks the first
// round generated into (they were named with accepted tokens only) and still gives the same
// outputs.
TEST(SpeculativeTest, BlocksNamedAfterSpeculationServeLaterRequests) {
  const std::string model = testing::TinyModel("llama", DType::kBF16);
  auto plain = MakeEngine(model, {}, /*prefix_caching=*/false);
  auto spec = MakeEngine(model, Ngram(4));
  std::mt19937 rng(9);
  const std::vector<int32_t> prompt = RepetitivePrompt(rng, plain->config().vocab_size, 6, 4);
  SamplingParams p{.temperature = 0, .max_tokens = 48, .ignore_eos = true, .logprobs = 0};
  const auto first = RunAll(*spec, {{"a", prompt, p}});
  ASSERT_EQ(first.size(), 1u);
  // Continue the conversation: the prompt plus the answer, cached on the speculating engine.
  std::vector<int32_t> turn2 = prompt;
  turn2.insert(turn2.end(), first[0].choices[0].token_ids.begin(),
               first[0].choices[0].token_ids.end());
  turn2.push_back(3);
  const int64_t hits_before = spec->stats().prefix_cache_hits_tokens;
  ExpectSameOutputs(RunAll(*spec, {{"b", turn2, p}}), RunAll(*plain, {{"b", turn2, p}}));
  EXPECT_GE(spec->stats().prefix_cache_hits_tokens - hits_before,
            static_cast<int64_t>(prompt.size() + 32) / 16 * 16 - 16);
  EXPECT_EQ(spec->stats().kv_blocks_used, 0);
}

// Grammar-constrained greedy samples: draft tokens the grammar refuses are rejected like any
// other, and the output is the unspeculated one.
TEST(SpeculativeTest, ConstrainedGreedyOutputsAreThoseWithoutSpeculation) {
  const std::string model = testing::TinyModel("llama");
  auto plain = MakeEngine(model, {});
  auto spec = MakeEngine(model, Ngram(5));
  auto workload = [&](const LlmEngine& engine) {
    std::vector<GenerateRequest> requests;
    const std::vector<int32_t> prompt =
        engine.tokenizer().Encode("{\"a\": [1, 2], \"b\": [1, 2], \"c\": [1, 2], \"d\":", true);
    SamplingParams p{.temperature = 0, .max_tokens = 120, .logprobs = 1};
    p.structured = {ConstraintKind::kJsonObject, ""};
    requests.push_back({"json", prompt, p});
    p.structured = {ConstraintKind::kRegex, "(ab|abc|b){3,9}-[0-9]{2,4}"};
    requests.push_back({"regex", engine.tokenizer().Encode("ab abc b ab abc b ab", true), p});
    return requests;
  };
  ExpectSameOutputs(RunAll(*spec, workload(*spec)), RunAll(*plain, workload(*plain)));
  EXPECT_GT(spec->stats().spec_proposed_tokens, 0);
  EXPECT_EQ(spec->stats().kv_blocks_used, 0);
}

// The upper tail of the chi-square distribution with `df` degrees of freedom at `x`: the
// regularised upper incomplete gamma Q(df / 2, x / 2), by its series below a + 1 and its
// continued fraction above.
double ChiSquarePValue(double x, int df) {
  const double a = df / 2.0;
  const double z = x / 2.0;
  if (z <= 0) return 1.0;
  const double log_prefix = a * std::log(z) - z - std::lgamma(a);
  if (z < a + 1) {
    double term = 1.0 / a;
    double sum = term;
    for (int n = 1; n < 10000 && std::abs(term) > std::abs(sum) * 1e-15; ++n) {
      term *= z / (a + n);
      sum += term;
    }
    return 1.0 - std::exp(log_prefix) * sum;
  }
  // Lentz's method for the continued fraction of Q.
  double b = z + 1 - a;
  double c = 1e300;
  double d = 1.0 / b;
  double h = d;
  for (int i = 1; i < 10000; ++i) {
    const double an = -i * (i - a);
    b += 2;
    d = an * d + b;
    if (std::abs(d) < 1e-300) d = 1e-300;
    c = b + an / c;
    if (std::abs(c) < 1e-300) c = 1e-300;
    d = 1.0 / d;
    const double delta = d * c;
    h *= delta;
    if (std::abs(delta - 1) < 1e-15) break;
  }
  return std::exp(log_prefix) * h;
}

TEST(ChiSquarePValueTest, MatchesKnownQuantiles) {
  EXPECT_NEAR(ChiSquarePValue(3.841, 1), 0.05, 1e-3);
  EXPECT_NEAR(ChiSquarePValue(18.307, 10), 0.05, 1e-3);
  EXPECT_NEAR(ChiSquarePValue(124.342, 100), 0.05, 1e-3);
  EXPECT_NEAR(ChiSquarePValue(6.635, 1), 0.01, 1e-3);
}

// Two samples of categorical outcomes from one distribution? The chi-square test of
// homogeneity over their 2 x bins table; bins with fewer than 10 outcomes in both samples
// together are pooled into one.
double HomogeneityPValue(const std::map<std::vector<int32_t>, int>& a,
                         const std::map<std::vector<int32_t>, int>& b, int* num_bins) {
  std::map<std::vector<int32_t>, std::pair<double, double>> table;
  for (const auto& [key, n] : a) table[key].first += n;
  for (const auto& [key, n] : b) table[key].second += n;
  std::vector<std::pair<double, double>> bins;
  std::pair<double, double> pooled{0, 0};
  for (const auto& [key, counts] : table) {
    if (counts.first + counts.second < 10) {
      pooled.first += counts.first;
      pooled.second += counts.second;
    } else {
      bins.push_back(counts);
    }
  }
  if (pooled.first + pooled.second > 0) bins.push_back(pooled);
  double total_a = 0, total_b = 0;
  for (const auto& [x, y] : bins) total_a += x, total_b += y;
  const double total = total_a + total_b;
  double stat = 0;
  for (const auto& [x, y] : bins) {
    const double col = x + y;
    const double ea = col * total_a / total;
    const double eb = col * total_b / total;
    stat += (x - ea) * (x - ea) / ea + (y - eb) * (y - eb) / eb;
  }
  *num_bins = static_cast<int>(bins.size());
  return ChiSquarePValue(stat, static_cast<int>(bins.size()) - 1);
}

// The first three tokens of `samples` seeded samples (seeds 1..samples) of `params`.
std::map<std::vector<int32_t>, int> FirstThreeTokens(LlmEngine& engine,
                                                     const std::vector<int32_t>& prompt,
                                                     SamplingParams params, int samples) {
  std::vector<GenerateRequest> requests;
  for (int i = 0; i < samples; ++i) {
    params.seed = 1000003ull * (i + 1);
    requests.push_back({absl::StrCat("s", i), prompt, params});
  }
  std::map<std::vector<int32_t>, int> counts;
  for (const RequestOutput& out : RunAll(engine, std::move(requests))) {
    ++counts[out.choices[0].token_ids];
  }
  return counts;
}

// The acceptance criterion of exactness: at temperature 0.8, top-p 0.9 and a repetition
// penalty, the joint distribution of the first three tokens with speculation matches the one
// without (p > 0.01) over 20,000 seeded samples of a 12-token-vocabulary model. Its prompt lets
// the n-gram proposer propose at nearly every position, and the early-exit and draft-model
// drafts propose always, so that both the accepting and the rejecting branch of verification decide tokens 2
// and 3.
class SpeculativeSampledTest : public ::testing::TestWithParam<GreedyCase> {};

constexpr int kSamples = 20000;
const std::vector<int32_t> kSmallVocabPrompt = {0, 1, 2,  3, 4, 5, 6, 7, 8,  9, 10, 11, 1, 3, 5,
                                                7, 9, 11, 0, 2, 4, 6, 8, 10, 3, 6,  9,  0, 4, 8};
const SamplingParams kSampled{.temperature = 0.8f,
                              .top_p = 0.9f,
                              .repetition_penalty = 1.3f,
                              .max_tokens = 3,
                              .ignore_eos = true};

// The distribution without speculation, counted once for every case.
const std::map<std::vector<int32_t>, int>& UnspeculatedCounts(const std::string& model) {
  static const auto* counts = [&] {
    auto plain = MakeEngine(model, {}, true, /*max_num_seqs=*/256);
    return new std::map<std::vector<int32_t>, int>(
        FirstThreeTokens(*plain, kSmallVocabPrompt, kSampled, kSamples));
  }();
  return *counts;
}

TEST_P(SpeculativeSampledTest, DistributionIsThatWithoutSpeculation) {
  const std::string model = testing::TinySmallVocabModel(12);
  SpeculativeOptions options = GetParam().spec;
  if (options.method == SpeculativeMethod::kDraftModel) {
    options.draft_model = testing::TinyDraftModel("llama", DType::kF32, 12);
  }
  auto spec = MakeEngine(model, options, true, /*max_num_seqs=*/256);
  ASSERT_NE(spec, nullptr);
  const auto& want = UnspeculatedCounts(model);
  const auto got = FirstThreeTokens(*spec, kSmallVocabPrompt, kSampled, kSamples);
  int bins = 0;
  const double p_value = HomogeneityPValue(got, want, &bins);
  EXPECT_GT(p_value, 0.01) << "over " << bins << " bins";
  EXPECT_GE(bins, 20);  // a real joint distribution, not a near-certain sequence
  const EngineStats stats = spec->stats();
  // Proposals at both later positions, with both outcomes frequent.
  EXPECT_GT(stats.spec_proposed_tokens, kSamples);
  EXPECT_GT(stats.spec_accepted_tokens, stats.spec_proposed_tokens / 20);
  EXPECT_LT(stats.spec_accepted_tokens, stats.spec_proposed_tokens * 19 / 20);
}

INSTANTIATE_TEST_SUITE_P(Methods, SpeculativeSampledTest,
                         ::testing::Values(GreedyCase{"ngram_k2", Ngram(2, 1, 2)},
                                           GreedyCase{"early_exit_k2", EarlyExit(2, 1)},
                                           GreedyCase{"draft_model_k2", DraftModel(2)}),
                         [](const ::testing::TestParamInfo<GreedyCase>& info) {
                           return info.param.name;
                         });

// A draft that is the target itself (the same checkpoint as a draft model) proposes from the
// very distribution verification checks against, processed the same way (temperature, top-p,
// the repetition penalty over the drafts before each): every sampled draft is accepted, where
// a point-mass draft (its argmax) would be accepted only as often as the target picks it.
TEST(SpeculativeTest, SampledDraftsFromTheTargetItselfAreAllAccepted) {
  const std::string model = testing::TinySmallVocabModel(12);
  SpeculativeOptions options = DraftModel(3);
  options.draft_model = model;
  auto spec = MakeEngine(model, options, true, /*max_num_seqs=*/64);
  ASSERT_NE(spec, nullptr);
  SamplingParams params = kSampled;
  params.max_tokens = 12;
  std::vector<GenerateRequest> requests;
  for (int i = 0; i < 64; ++i) {
    params.seed = 17 + i;
    requests.push_back({absl::StrCat("s", i), kSmallVocabPrompt, params});
  }
  RunAll(*spec, std::move(requests));
  const EngineStats stats = spec->stats();
  ASSERT_GT(stats.spec_proposed_tokens, 64 * 6);
  EXPECT_EQ(stats.spec_accepted_tokens, stats.spec_proposed_tokens);
}

// A draft model that disagrees with the target (another seed's weights), left to the adaptive
// length (timed by a ticking clock): speculation goes off after the first rejections and is
// probed ever more rarely; by
// the later probes the draft is hundreds of tokens behind and catches up over the last
// kProbeCatchUpTokens only, its older KV left stale. Outputs stay exactly the unspeculated ones
// and the draft proposes for only a few steps. (Speculation is off for any step costs here:
// with nothing accepted, no draft length yields more than one token per step.)
TEST(SpeculativeTest, AnOffDraftModelProbesRarelyOverRecentTokensWithOutputsUnchanged) {
  const std::string model = testing::TinyModel("llama", DType::kBF16);
  tools::SynthModelOptions draft;
  draft.num_layers = 1;
  draft.dtype = DType::kBF16;
  const std::string dir = testing::SynthOnce("tiny-llama-bf16-draft1-seed99", draft, 99);
  SpeculativeOptions options = DraftModel(4);
  options.draft_model = dir;
  options.adaptive = true;
  auto plain = MakeEngine(model, {});
  // Adaptive speculation weighs measured step and draft times: timed by a ticking clock, what
  // it decides does not depend on the machine's speed or load.
  auto spec = MakeEngine(model, options, true, 16, TickingClock());
  ASSERT_NE(spec, nullptr);
  std::mt19937 rng(5);
  SamplingParams p{.temperature = 0, .max_tokens = 600, .ignore_eos = true};
  std::vector<GenerateRequest> requests;
  for (int i = 0; i < 3; ++i) {
    requests.push_back({absl::StrCat("r", i), RepetitivePrompt(rng, plain->config().vocab_size,
                                                               5, 4), p});
  }
  const std::vector<RequestOutput> got = RunAll(*spec, requests);
  ExpectSameOutputs(got, RunAll(*plain, requests));
  for (const RequestOutput& out : got) EXPECT_EQ(out.choices[0].token_ids.size(), 600u);
  const EngineStats stats = spec->stats();
  // Per sequence: a step or two at the start, then probes after 32, 64, 128 and 256 steps off
  // (the last two with the draft 128 and 256 tokens behind): 5 each with the ticking clock.
  EXPECT_GT(stats.spec_verify_steps, 3 * 3);
  EXPECT_LE(stats.spec_verify_steps, 3 * 8) << stats.spec_proposed_tokens << " proposed";
  EXPECT_LT(stats.spec_accepted_tokens * 4, stats.spec_proposed_tokens);
  EXPECT_EQ(stats.kv_blocks_used, 0);
}

// What /metrics shows of speculation: the counters equal the engine's stats, per position too.
TEST(SpeculativeTest, MetricsReportProposedAndAcceptedTokens) {
  const std::string model = testing::TinyModel("llama", DType::kBF16);
  auto spec = MakeEngine(model, Ngram(3));
  std::mt19937 rng(3);
  SamplingParams p{.temperature = 0, .max_tokens = 40, .ignore_eos = true};
  RunAll(*spec, {{"m", RepetitivePrompt(rng, spec->config().vocab_size, 4, 5), p}});
  const EngineStats stats = spec->stats();
  ASSERT_GT(stats.spec_accepted_tokens, 0);
  metrics::Registry registry;
  EngineMetrics engine_metrics(registry);
  engine_metrics.Record(stats);
  const std::string text = registry.Render();
  EXPECT_NE(
      text.find(absl::StrCat("tandem_spec_proposed_tokens_total ", stats.spec_proposed_tokens)),
      std::string::npos)
      << text;
  EXPECT_NE(
      text.find(absl::StrCat("tandem_spec_accepted_tokens_total ", stats.spec_accepted_tokens)),
      std::string::npos);
  EXPECT_NE(text.find(absl::StrCat("tandem_spec_accepted_tokens_by_position_total{position=\"0\"} ",
                                   stats.spec_accepted_by_position[0])),
            std::string::npos);
  EXPECT_NE(text.find("tandem_spec_proposed_tokens_by_position_total{position=\"2\"}"),
            std::string::npos);
  EXPECT_NE(text.find("tandem_spec_mean_accepted_length"), std::string::npos);
}

TEST(NgramProposerTest, ProposesWhatFollowedTheMostRecentLongestMatch) {
  const NgramProposer proposer(1, 3);
  // Suffix [7, 8, 9] occurred at 1 (followed by 4 5) and [8, 9] at 6 (followed by 1): the
  // longest n wins.
  const std::vector<int32_t> tokens = {0, 7, 8, 9, 4, 5, 8, 9, 1, 2, 7, 8, 9};
  EXPECT_EQ(proposer.Propose(tokens, 4), (std::vector<int32_t>{4, 5, 8, 9}));
  EXPECT_EQ(proposer.Propose(tokens, 1), (std::vector<int32_t>{4}));
  EXPECT_TRUE(proposer.Propose(tokens, 0).empty());
  // Only n = 1 matches; of 3's two earlier occurrences the most recent one (followed by 6).
  EXPECT_EQ(proposer.Propose(std::vector<int32_t>{3, 5, 3, 6, 2, 3}, 3),
            (std::vector<int32_t>{6, 2, 3}));
  // The continuation stops at the end of the sequence.
  EXPECT_EQ(proposer.Propose(std::vector<int32_t>{1, 2, 1}, 5), (std::vector<int32_t>{2, 1}));
  EXPECT_TRUE(proposer.Propose(std::vector<int32_t>{1, 2, 3}, 5).empty());
  EXPECT_TRUE(NgramProposer(2, 3).Propose(std::vector<int32_t>{1, 2, 5, 2}, 5).empty());
}

TEST(SpeculativeOptionsTest, RefusesValuesNoProposerRunsWith) {
  EXPECT_TRUE(SpeculativeOptions{}.Validate().ok());
  EXPECT_TRUE(Ngram(4).Validate().ok());
  EXPECT_FALSE(Ngram(0).Validate().ok());
  EXPECT_FALSE(Ngram(33).Validate().ok());
  EXPECT_FALSE(Ngram(4, 0, 3).Validate().ok());
  EXPECT_FALSE(Ngram(4, 3, 2).Validate().ok());
  EngineOptions options;
  options.model_dir = testing::TinyModel("llama", DType::kBF16);
  options.speculative = Ngram(4, 3, 2);
  auto engine = LlmEngine::Create(options);
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(engine.status().message().find("ngram_min"), std::string::npos);
}

// A step latency model of a machine where a step costs 10 ms plus `per_token` per batch token.
StepLatencyModel FittedModel(double per_token) {
  StepLatencyModel model;
  std::mt19937 rng(1);
  for (int i = 0; i < 60; ++i) {
    const int seqs = 1 + static_cast<int>(rng() % 16);
    const int tokens = seqs * (1 + static_cast<int>(rng() % 5));
    const int context = seqs * 100;
    model.Observe(tokens, seqs, context, 0.01 + per_token * tokens + 1e-7 * context);
  }
  return model;
}

// The draft length follows what pays: long when drafts are accepted and extra tokens are cheap
// (decode bound by weights), off when they are rejected, each token costs as much as a step or
// the draft itself costs too much, and probed again now and then while off.
TEST(SpeculationLengthTest, ChoosesTheLengthWithTheMostTokensPerSecond) {
  const StepLatencyModel cheap_tokens = FittedModel(0.0001);
  const StepLatencyModel costly_tokens = FittedModel(0.01);
  ASSERT_TRUE(cheap_tokens.ready());
  SpeculationLength length(4);
  EXPECT_EQ(length.Choose(StepLatencyModel(), 1, 100), 4);  // no model yet: the most
  for (int i = 0; i < 200; ++i) length.Observe(4, 4);
  EXPECT_NEAR(length.acceptance(0), 1.0, 1e-9);
  EXPECT_NEAR(length.ExpectedTokens(4), 5.0, 1e-9);
  EXPECT_EQ(length.Choose(cheap_tokens, 1, 100), 4);
  EXPECT_EQ(length.Choose(cheap_tokens, 8, 800), 4);
  // Each token costing as much as a whole small step: speculating 4 for 5 tokens still pays at
  // batch 1, and a batch that is compute-bound already gains less.
  EXPECT_GE(length.Choose(costly_tokens, 1, 100), 1);

  SpeculationLength rejected(4);
  for (int i = 0; i < 200; ++i) rejected.Observe(4, 0);
  EXPECT_LT(rejected.acceptance(0), 0.05);
  // Off, and probed with one token after 32 steps, then twice as long after each probe that
  // leaves it off, up to every 512th step.
  std::vector<int> probe_steps;
  for (int i = 1; i <= 1600; ++i) {
    const int k = rejected.Choose(cheap_tokens, 8, 800);
    EXPECT_EQ(k == 1, rejected.probing()) << "step " << i;
    if (k == 1) {
      probe_steps.push_back(i);
    } else {
      EXPECT_EQ(k, 0) << "step " << i;
    }
  }
  EXPECT_EQ(probe_steps, (std::vector<int>{32, 96, 224, 480, 992, 1504}));
  // Accepted again: on at once; off again later, the first probe comes after 32 steps again.
  for (int i = 0; i < 2000; ++i) rejected.Observe(4, 4);
  EXPECT_EQ(rejected.Choose(cheap_tokens, 8, 800), 4);
  EXPECT_FALSE(rejected.probing());
  for (int i = 0; i < 2000; ++i) rejected.Observe(4, 0);
  int first_probe = 0;
  for (int i = 1; i <= 40 && first_probe == 0; ++i) {
    if (rejected.Choose(cheap_tokens, 8, 800) == 1) first_probe = i;
  }
  EXPECT_EQ(first_probe, 32);

  // Acceptance that decays with the position: the expected tokens follow the product.
  SpeculationLength halves(3);
  for (int i = 0; i < 400; ++i) halves.Observe(3, i % 2 == 0 ? 0 : (i % 4 == 1 ? 1 : 3));
  EXPECT_NEAR(halves.acceptance(0), 0.5, 0.05);
  EXPECT_NEAR(halves.acceptance(1), 0.5, 0.05);
  EXPECT_NEAR(halves.ExpectedTokens(2), 1 + 0.5 + 0.25, 0.06);

  // Draft passes that take time (a draft model's, early exit's): the same acceptance pays with
  // a cheap draft and not with one whose every pass costs as much as the target's step.
  EXPECT_GE(halves.Choose(cheap_tokens, 1, 100), 1);
  EXPECT_GE(halves.Choose(cheap_tokens, 1, 100, /*draft_pass_seconds=*/0.001), 1);
  EXPECT_EQ(halves.Choose(cheap_tokens, 1, 100, /*draft_pass_seconds=*/0.01), 0);
  // Before the latency model is ready, the last step's time stands in for every length: a
  // costly draft is off from the start, a free one on; with no step yet, the longest.
  EXPECT_EQ(halves.Choose(StepLatencyModel(), 1, 100, 0.01, /*last_step_seconds=*/0.01), 0);
  EXPECT_GE(halves.Choose(StepLatencyModel(), 1, 100, 0.0, /*last_step_seconds=*/0.01), 1);
  EXPECT_EQ(halves.Choose(StepLatencyModel(), 1, 100, 0.01, 0.0), 3);
}

TEST(BlockManagerTruncateTest, GivesBackTheBlocksPastTheKeptTokens) {
  BlockManager blocks(8, 4, /*enable_prefix_caching=*/true);
  BlockTable table;
  ASSERT_TRUE(blocks.Append(table, 0, 13).ok());  // 4 blocks
  ASSERT_EQ(table.size(), 4u);
  const int32_t third = table[2];
  blocks.Truncate(table, 9);  // 3 blocks hold 9 tokens
  EXPECT_EQ(table.size(), 3u);
  EXPECT_EQ(blocks.num_free_blocks(), 5);
  blocks.Truncate(table, 8);
  EXPECT_EQ(table.size(), 2u);
  EXPECT_EQ(blocks.ref_count(third), 0);
  blocks.Truncate(table, 8);  // nothing past them
  EXPECT_EQ(table.size(), 2u);
  blocks.Free(table);
  EXPECT_EQ(blocks.num_free_blocks(), 8);
}

}  // namespace
}  // namespace tandem::engine
