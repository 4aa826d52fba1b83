// Checkpoints served in their own precision: bf16 and fp16 weights against the float64
// reference on the same (widened) weights, weight-only quantised (int8, AWQ, GPTQ) checkpoints
// against it on the dequantised weights, KV caches of 16- and 8-bit floats, and the KV block
// count following the cache's element size.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "reference_forward.h"
#include "tandem/engine/llm_engine.h"
#include "tandem/engine/model_runner.h"
#include "test_models.h"

namespace tandem::engine {
namespace {

using testing::Reference;
using testing::RunReference;

template <typename T>
std::vector<double> LogSoftmax(std::span<const T> logits) {
  double max = -INFINITY;
  for (T v : logits) max = std::max(max, double{v});
  double sum = 0;
  for (T v : logits) sum += std::exp(double{v} - max);
  std::vector<double> out;
  out.reserve(logits.size());
  for (T v : logits) out.push_back(double{v} - max - std::log(sum));
  return out;
}

// The prompts every case runs.
std::vector<std::vector<int32_t>> TestPrompts(const std::string& model) {
  auto tokenizer = text::Tokenizer::FromFile(model + "/tokenizer.json");
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
  std::vector<std::vector<int32_t>> prompts;
  for (const char* text : {"The engine reads 42 pages; every page holds 16 tokens.",
                           "Decode is bound by the bytes it reads from memory",
                           "def f(x):\n    return x * 2  # doubles"}) {
    prompts.push_back((*tokenizer)->Encode(text, true));
  }
  return prompts;
}

// Logits at every prompt position, each from a decode step (one token per step) over a paged
// cache of `kv_dtype`, weights held as `weight_dtype` (nullopt: the checkpoint's).
std::vector<std::vector<float>> DecodeLogits(const Checkpoint& checkpoint,
                                             const std::vector<int32_t>& prompt,
                                             std::optional<DType> weight_dtype,
                                             std::optional<DType> kv_dtype) {
  auto backend = kernels::CreateCpuBackend({.num_threads = 2});
  EXPECT_TRUE(backend.ok());
  BlockManager blocks(64, 4);
  auto runner = ModelRunner::Create(checkpoint, backend->get(),
                                    {.max_num_batched_tokens = 256,
                                     .max_num_seqs = 8,
                                     .num_kv_blocks = 64,
                                     .block_size = 4,
                                     .weight_dtype = weight_dtype,
                                     .kv_cache_dtype = kv_dtype});
  EXPECT_TRUE(runner.ok()) << runner.status();
  if (!runner.ok()) return {};
  Sequence seq;
  seq.tokens = prompt;
  seq.num_prompt_tokens = static_cast<int>(prompt.size());
  std::vector<std::vector<float>> out;
  for (size_t pos = 0; pos < prompt.size(); ++pos) {
    EXPECT_TRUE(blocks.Append(seq.block_table, static_cast<int>(pos), 1).ok());
    SchedulerStep step;
    step.seqs.push_back({&seq, 1, true});
    step.num_tokens = 1;
    auto logits = (*runner)->Execute(step);
    EXPECT_TRUE(logits.ok()) << logits.status();
    if (!logits.ok()) return {};
    out.emplace_back(logits->begin(), logits->end());
    seq.num_computed_tokens++;
  }
  return out;
}

struct LogprobDiff {
  double max = 0;   // over every position and vocabulary entry
  double mean = 0;  // the same entries' mean
};

LogprobDiff CompareLogprobs(const std::vector<std::vector<float>>& got,
                            const std::vector<std::vector<double>>& reference) {
  LogprobDiff d;
  EXPECT_EQ(got.size(), reference.size());
  int64_t count = 0;
  for (size_t pos = 0; pos < got.size() && pos < reference.size(); ++pos) {
    const std::vector<double> a = LogSoftmax(std::span<const float>(got[pos]));
    const std::vector<double> b = LogSoftmax(std::span<const double>(reference[pos]));
    EXPECT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
      const double diff = std::abs(a[i] - b[i]);
      d.max = std::max(d.max, diff);
      d.mean += diff;
      ++count;
    }
  }
  if (count > 0) d.mean /= static_cast<double>(count);
  return d;
}

std::vector<int32_t> Greedy(const std::string& model, const std::vector<int32_t>& prompt, int steps,
                            std::optional<DType> kv_dtype) {
  auto engine =
      LlmEngine::Create({.model_dir = model, .num_threads = 2, .kv_cache_dtype = kv_dtype});
  EXPECT_TRUE(engine.ok()) << engine.status();
  if (!engine.ok()) return {};
  SamplingParams greedy{.temperature = 0, .max_tokens = steps, .ignore_eos = true};
  auto out = GenerateAll(**engine, {{"r", prompt, greedy}});
  EXPECT_TRUE(out.ok()) << out.status();
  if (!out.ok()) return {};
  return (*out)[0].choices[0].token_ids;
}

// How many leading tokens two greedy continuations share.
size_t CommonPrefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return n;
}

struct WeightCase {
  std::string arch;
  DType dtype;
};

class WeightPrecisionTest : public ::testing::TestWithParam<WeightCase> {};

// Weights held as the checkpoint stores them (bf16 or fp16), widened in registers: every
// position's logprobs within 1e-3 of the float64 reference reading the same weights, with an
// fp32 KV cache (the weights alone) and with the default cache of the weight type (against the
// reference rounding K and V to that type as the cache does); greedy tokens for 16 steps equal.
TEST_P(WeightPrecisionTest, LogprobsWithin1e3OfTheFloat64ReferenceOnTheSameWeights) {
  const WeightCase& c = GetParam();
  const std::string model = testing::TinyModel(c.arch, c.dtype);
  auto checkpoint = Checkpoint::Open(model);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  ASSERT_EQ((*checkpoint)->config().torch_dtype, c.dtype);
  for (const std::vector<int32_t>& prompt : TestPrompts(model)) {
    const Reference exact = RunReference(model, prompt, 0);
    const Reference rounded_kv = RunReference(model, prompt, 16, DTypeFlagName(c.dtype));
    for (std::optional<DType> kv : {std::optional<DType>(DType::kF32), std::optional<DType>()}) {
      const std::string what =
          absl::StrCat(c.arch, " ", DTypeFlagName(c.dtype), " weights, ",
                       kv ? DTypeFlagName(*kv) : "auto", " KV cache, prompt of ", prompt.size());
      const LogprobDiff d = CompareLogprobs(DecodeLogits(**checkpoint, prompt, std::nullopt, kv),
                                            kv ? exact.logits : rounded_kv.logits);
      std::printf("%s: max |logprob diff| %.3g, mean %.3g\n", what.c_str(), d.max, d.mean);
      EXPECT_LE(d.max, 1e-3) << what;
    }
    EXPECT_EQ(Greedy(model, prompt, 16, std::nullopt), rounded_kv.greedy_tokens)
        << c.arch << " " << DTypeFlagName(c.dtype);
  }
}

INSTANTIATE_TEST_SUITE_P(Checkpoints, WeightPrecisionTest,
                         ::testing::Values(WeightCase{"llama", DType::kBF16},
                                           WeightCase{"llama", DType::kF16},
                                           WeightCase{"qwen3", DType::kBF16},
                                           WeightCase{"qwen2", DType::kF16}),
                         [](const ::testing::TestParamInfo<WeightCase>& info) {
                           return info.param.arch + "_" + DTypeFlagName(info.param.dtype);
                         });

using testing::QuantCase;

class QuantizedWeightTest : public ::testing::TestWithParam<QuantCase> {};

// Weight-only quantised checkpoints, kept quantised in memory and dequantised in registers:
// every position's logprobs within 1e-3 of the float64 reference computed on the dequantised
// weights (tests/reference/dequantize.py), with an fp32 KV cache and with the default one (the
// reference rounding K and V alike), and greedy tokens identical for 32 steps.
TEST_P(QuantizedWeightTest, LogprobsWithin1e3OfTheReferenceOnTheDequantisedWeights) {
  const QuantCase& c = GetParam();
  const std::string model = c.Model();
  auto checkpoint = Checkpoint::Open(model);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  ASSERT_NE((*checkpoint)->quantization().method, QuantMethod::kNone);
  for (const std::vector<int32_t>& prompt : TestPrompts(model)) {
    const Reference exact = RunReference(model, prompt, 0);
    const Reference rounded_kv = RunReference(model, prompt, 32, DTypeFlagName(c.dtype));
    for (std::optional<DType> kv : {std::optional<DType>(DType::kF32), std::optional<DType>()}) {
      const std::string what = absl::StrCat(c.name, ", ", kv ? DTypeFlagName(*kv) : "auto",
                                            " KV cache, prompt of ", prompt.size());
      const LogprobDiff d = CompareLogprobs(DecodeLogits(**checkpoint, prompt, std::nullopt, kv),
                                            kv ? exact.logits : rounded_kv.logits);
      std::printf("%s: max |logprob diff| %.3g, mean %.3g\n", what.c_str(), d.max, d.mean);
      EXPECT_LE(d.max, 1e-3) << what;
    }
    EXPECT_EQ(Greedy(model, prompt, 32, std::nullopt), rounded_kv.greedy_tokens) << c.name;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Checkpoints, QuantizedWeightTest,
    ::testing::Values(QuantCase{"int8_llama_bf16", "llama", "int8", DType::kBF16},
                      QuantCase{"int8_qwen2_f32", "qwen2", "int8", DType::kF32},
                      QuantCase{"awq_llama", "llama", "awq", DType::kF16},
                      QuantCase{"awq_qwen3", "qwen3", "awq", DType::kBF16},
                      QuantCase{"gptq_llama", "llama", "gptq", DType::kF16},
                      QuantCase{"gptq_llama_act_order", "llama", "gptq", DType::kF16, true},
                      QuantCase{"gptq_mistral_act_order_asym", "mistral", "gptq", DType::kF16, true,
                                false}),
    [](const ::testing::TestParamInfo<QuantCase>& info) { return info.param.name; });

class Fp8KvCacheTest : public ::testing::TestWithParam<DType> {};

// An 8-bit KV cache (scale 1): greedy tokens identical for 16 steps on every test prompt to the
// float64 reference that rounds K and V to the same format, and logprobs within 1e-3 of it.
// What the format itself costs against the unrounded reference is reported: the mean absolute
// logprob difference, and how many greedy tokens agree (a synthetic model's random logits have
// near-ties the rounding can flip, so that count is reported, not asserted).
TEST_P(Fp8KvCacheTest, GreedyTokensMatchTheReferenceFor16Steps) {
  const DType kv = GetParam();
  const std::string model = testing::TinyModel("llama", DType::kBF16);
  auto checkpoint = Checkpoint::Open(model);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  double mean_sum = 0, max = 0;
  int prompts = 0;
  std::string agreement;
  for (const std::vector<int32_t>& prompt : TestPrompts(model)) {
    const Reference exact = RunReference(model, prompt, 16);
    const Reference rounded = RunReference(model, prompt, 16, DTypeFlagName(kv));
    const std::vector<int32_t> tokens = Greedy(model, prompt, 16, kv);
    EXPECT_EQ(tokens, rounded.greedy_tokens)
        << DTypeFlagName(kv) << ", prompt of " << prompt.size();
    const std::vector<std::vector<float>> logits =
        DecodeLogits(**checkpoint, prompt, std::nullopt, kv);
    EXPECT_LE(CompareLogprobs(logits, rounded.logits).max, 1e-3) << DTypeFlagName(kv);
    const LogprobDiff d = CompareLogprobs(logits, exact.logits);
    mean_sum += d.mean;
    max = std::max(max, d.max);
    ++prompts;
    absl::StrAppend(&agreement, agreement.empty() ? "" : ", ",
                    CommonPrefix(tokens, exact.greedy_tokens), "/16");
  }
  std::printf(
      "%s KV cache against the unrounded float64 reference: mean |logprob diff| %.3g (max %.3g) "
      "over %d prompts; greedy tokens agreeing before the first difference: %s\n",
      DTypeFlagName(kv), mean_sum / prompts, max, prompts, agreement.c_str());
  RecordProperty("mean_abs_logprob_diff", absl::StrCat(mean_sum / prompts));
  RecordProperty("max_abs_logprob_diff", absl::StrCat(max));
  RecordProperty("greedy_agreement", agreement);
}

INSTANTIATE_TEST_SUITE_P(Formats, Fp8KvCacheTest, ::testing::Values(DType::kF8E4M3, DType::kF8E5M2),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(DTypeFlagName(info.param));
                         });

// The same KV budget holds twice the blocks in a 16-bit cache and four times in an 8-bit one.
TEST(KvCacheDTypeTest, BlockCountFollowsTheElementSize) {
  const std::string model = testing::TinyModel("llama", DType::kBF16);
  const int64_t budget = 8 << 20;
  int f32_blocks = 0;
  for (DType kv : {DType::kF32, DType::kBF16, DType::kF16, DType::kF8E4M3, DType::kF8E5M2}) {
    auto engine = LlmEngine::Create(
        {.model_dir = model, .num_threads = 1, .kv_cache_bytes = budget, .kv_cache_dtype = kv});
    ASSERT_TRUE(engine.ok()) << engine.status();
    const KvCacheLayout& layout = (*engine)->cache_layout();
    EXPECT_EQ(layout.dtype, kv);
    EXPECT_EQ((*engine)->kv_layout().dtype, kv);
    EXPECT_LE((*engine)->kv_cache_bytes(), static_cast<size_t>(budget));
    if (kv == DType::kF32) f32_blocks = layout.num_blocks;
    EXPECT_EQ(layout.num_blocks, f32_blocks * (4 / DTypeSize(kv))) << DTypeFlagName(kv);
  }
  // auto: the weight type, bf16 here.
  auto engine = LlmEngine::Create({.model_dir = model, .num_threads = 1, .kv_cache_bytes = budget});
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->cache_layout().dtype, DType::kBF16);
  EXPECT_EQ((*engine)->cache_layout().num_blocks, 2 * f32_blocks);
}

TEST(KvCacheDTypeTest, AnEightBitWeightTypeIsRefusedWithAClearError) {
  const std::string model = testing::TinyModel("llama", DType::kBF16);
  auto engine = LlmEngine::Create({.model_dir = model, .num_threads = 1, .dtype = DType::kF8E4M3});
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(engine.status().message().find("--dtype fp8_e4m3 is not a weight type"),
            std::string::npos)
      << engine.status();
}

// A copy of the tiny bf16 Llama whose checkpoint also holds vLLM's per-layer KV scales
// (self_attn.k_scale / v_scale, one fp32 value each): layer l's are 0.25 * (l + 1) and 2 + l,
// or `bad_k_scale` for layer 0's K when it is set.
std::string ModelWithKvScales(const std::string& name, std::optional<float> bad_k_scale) {
  const std::string source = testing::TinyModel("llama", DType::kBF16);
  const std::string dir = absl::StrCat(source, "-", name);
  std::filesystem::create_directories(dir);
  for (const char* file : {"config.json", "tokenizer.json", "tokenizer_config.json"}) {
    std::filesystem::copy_file(source + "/" + file, dir + "/" + file,
                               std::filesystem::copy_options::overwrite_existing);
  }
  auto file = SafetensorsFile::Open(source + "/model.safetensors");
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return dir;
  SafetensorsWriter writer;
  for (const auto& [tensor_name, view] : (*file)->tensors()) {
    writer.Add(tensor_name, view.dtype, view.shape, view.data, view.nbytes);
  }
  auto config = Checkpoint::Open(source);
  EXPECT_TRUE(config.ok());
  for (int l = 0; config.ok() && l < (*config)->config().num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".self_attn.");
    const float k = l == 0 && bad_k_scale ? *bad_k_scale : 0.25f * (l + 1);
    writer.AddFloat(p + "k_scale", DType::kF32, {}, {k});
    writer.AddFloat(p + "v_scale", DType::kF32, {}, {2.0f + l});
  }
  EXPECT_TRUE(writer.Write(dir + "/model.safetensors").ok());
  return dir;
}

TEST(KvCacheDTypeTest, PerLayerFp8ScalesComeFromTheCheckpoint) {
  const std::string model = ModelWithKvScales("kv-scales", std::nullopt);
  auto checkpoint = Checkpoint::Open(model);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  auto backend = kernels::CreateCpuBackend({.num_threads = 1});
  ASSERT_TRUE(backend.ok());
  auto runner =
      ModelRunner::Create(**checkpoint, backend->get(),
                          {.num_kv_blocks = 8, .block_size = 16, .kv_cache_dtype = DType::kF8E4M3});
  ASSERT_TRUE(runner.ok()) << runner.status();
  for (int l = 0; l < (*checkpoint)->config().num_layers; ++l) {
    EXPECT_EQ((*runner)->layer_kv_layout(l).dtype, DType::kF8E4M3);
    EXPECT_EQ((*runner)->layer_kv_layout(l).k_scale, 0.25f * (l + 1)) << l;
    EXPECT_EQ((*runner)->layer_kv_layout(l).v_scale, 2.0f + l) << l;
  }
  // Without scales in the checkpoint: 1.
  auto plain = Checkpoint::Open(testing::TinyModel("llama", DType::kBF16));
  ASSERT_TRUE(plain.ok());
  auto plain_runner =
      ModelRunner::Create(**plain, backend->get(), {.num_kv_blocks = 8, .block_size = 16});
  ASSERT_TRUE(plain_runner.ok()) << plain_runner.status();
  EXPECT_EQ((*plain_runner)->layer_kv_layout(0).k_scale, 1.0f);
  EXPECT_EQ((*plain_runner)->layer_kv_layout(0).v_scale, 1.0f);
}

TEST(KvCacheDTypeTest, ANonPositiveKvScaleIsRefusedNamingTheTensor) {
  const std::string model = ModelWithKvScales("bad-kv-scale", -1.0f);
  auto engine =
      LlmEngine::Create({.model_dir = model, .num_threads = 1, .kv_cache_dtype = DType::kF8E4M3});
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(engine.status().message().find("model.layers.0.self_attn.k_scale must be one positive"),
            std::string::npos)
      << engine.status();
}

}  // namespace
}  // namespace tandem::engine
