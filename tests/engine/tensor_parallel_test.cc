// Tensor parallelism on the CPU backend over Gloo: a group of 2 or 4 ranks (threads here, each
// with its own communicator, backend and shard, as processes would have) gives the tokens of one
// engine holding the whole model, with logprobs within 1e-4 (the row-parallel projections sum
// their partial products in another order), for llama, qwen2 (q/k/v biases, tied embeddings)
// and qwen3 (q/k norms, head_dim != hidden / heads). The tiny models have 2 KV heads, so tp=4
// replicates each KV head on two ranks.
#include "tandem/engine/tensor_parallel.h"

#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tandem/collective/gloo_communicator.h"
#include "tandem/engine/checkpoint.h"
#include "tandem/engine/llm_engine.h"
#include "tensor_parallel_support.h"
#include "test_models.h"

namespace tandem::engine {
namespace {

constexpr int kSteps = 64;

std::vector<GenerateRequest> Requests(int vocab) {
  std::mt19937 rng(11);
  std::vector<GenerateRequest> requests;
  const std::vector<int> lengths = {5, 23, 40};
  for (size_t i = 0; i < lengths.size(); ++i) {
    std::vector<int32_t> prompt(lengths[i]);
    for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % vocab);
    SamplingParams greedy{
        .temperature = 0, .max_tokens = kSteps, .ignore_eos = true, .logprobs = 2};
    SamplingParams seeded{.temperature = 0.8f,
                          .top_p = 0.95f,
                          .seed = 99 + i,
                          .max_tokens = kSteps,
                          .ignore_eos = true,
                          .logprobs = 0};
    requests.push_back({absl::StrCat("greedy-", i), prompt, greedy});
    requests.push_back({absl::StrCat("seeded-", i), prompt, seeded});
  }
  return requests;
}

EngineOptions Options(const std::string& model) {
  // Small chunks so that prompts span several steps, and a batch of all requests at once.
  return {.model_dir = model,
          .num_threads = 1,
          .kv_cache_bytes = 8 << 20,
          .max_num_batched_tokens = 32};
}

// Runs `requests` on a group of `tp` ranks (the engine on rank 0, followers on threads).
std::vector<RequestOutput> RunGroup(const std::string& model, int tp,
                                    std::vector<GenerateRequest> requests) {
  testing::TempDir dir("tp_test");
  std::vector<absl::Status> follower_status(tp, absl::OkStatus());
  std::vector<RequestOutput> outputs;
  {
    std::vector<std::jthread> followers;
    for (int rank = 1; rank < tp; ++rank) {
      followers.emplace_back([&, rank] {
        auto comm = collective::CreateGlooCommunicator(
            {.rank = rank, .size = tp, .file_store_dir = dir.path()});
        if (!comm.ok()) {
          follower_status[rank] = comm.status();
          return;
        }
        EngineOptions options = Options(model);
        options.tensor_parallel = comm->get();
        follower_status[rank] = RunTensorParallelFollower(options);
      });
    }
    auto comm =
        collective::CreateGlooCommunicator({.rank = 0, .size = tp, .file_store_dir = dir.path()});
    EXPECT_TRUE(comm.ok()) << comm.status();
    if (!comm.ok()) return {};
    EngineOptions options = Options(model);
    options.tensor_parallel = comm->get();
    auto engine = LlmEngine::Create(options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    if (!engine.ok()) return {};
    EXPECT_EQ((*engine)->cache_layout().tp_size, tp);
    auto out = GenerateAll(**engine, std::move(requests));
    EXPECT_TRUE(out.ok()) << out.status();
    if (out.ok()) outputs = std::move(out).value();
    EXPECT_GT((*comm)->stats().calls, 0u);
    engine->reset();  // releases the followers
  }
  for (int rank = 1; rank < tp; ++rank) {
    EXPECT_TRUE(follower_status[rank].ok()) << "rank " << rank << ": " << follower_status[rank];
  }
  return outputs;
}

// Runs Requests on one engine and on a group of `tp` over `model`, and compares.
void ExpectGroupMatchesOneEngine(const std::string& model, int tp) {
  auto single = LlmEngine::Create(Options(model));
  ASSERT_TRUE(single.ok()) << single.status();
  const int vocab = (*single)->config().vocab_size;
  auto expected = GenerateAll(**single, Requests(vocab));
  ASSERT_TRUE(expected.ok()) << expected.status();
  single->reset();
  testing::ExpectTokensOfOneEngine(*expected, RunGroup(model, tp, Requests(vocab)), kSteps,
                                   1e-4);
}

// "llamaTp2" for ("llama", 2).
std::string CaseName(const ::testing::TestParamInfo<std::tuple<std::string, int>>& info) {
  return absl::StrCat(std::get<0>(info.param), "Tp", std::get<1>(info.param));
}

class TensorParallelTest
    : public ::testing::TestWithParam<std::tuple<std::string /*arch*/, int /*tp*/>> {};

TEST_P(TensorParallelTest, GivesTheTokensOfOneEngine) {
  const auto& [arch, tp] = GetParam();
  ExpectGroupMatchesOneEngine(testing::TinyModel(arch, DType::kF32), tp);
}

INSTANTIATE_TEST_SUITE_P(ArchsAndDegrees, TensorParallelTest,
                         ::testing::Combine(::testing::Values("llama", "qwen2", "qwen3"),
                                            ::testing::Values(2, 4)),
                         CaseName);

// The step side channel a worker's ranks move their KV over: each step's bytes reach every
// follower before its layers run, its layer hook runs once per layer, and each follower's report
// comes back to the leader after the step; a step given no bytes sends none and asks for no
// report.
TEST(TensorParallelStepSideChannelTest, AttachmentsReachFollowersAndReportsComeBack) {
  const std::string model = testing::TinyModel("llama", DType::kF32);
  constexpr int kTp = 2;
  testing::TempDir dir("tp_test");
  std::vector<absl::Status> follower_status(kTp, absl::OkStatus());
  std::vector<std::vector<std::string>> reports;  // per step with bytes, in step order
  std::vector<std::string> sent;
  int steps = 0;
  int num_layers = 0;
  {
    std::vector<std::jthread> followers;
    for (int rank = 1; rank < kTp; ++rank) {
      followers.emplace_back([&, rank] {
        auto comm = collective::CreateGlooCommunicator(
            {.rank = rank, .size = kTp, .file_store_dir = dir.path()});
        if (!comm.ok()) {
          follower_status[rank] = comm.status();
          return;
        }
        EngineOptions options = Options(model);
        options.tensor_parallel = comm->get();
        auto follower = TensorParallelFollower::Create(options);
        if (!follower.ok()) {
          follower_status[rank] = follower.status();
          return;
        }
        std::string seen;
        int layers = 0;
        ModelRunner& runner = (*follower)->runner();
        runner.set_layer_written_hook([&layers](int) { ++layers; });
        runner.set_follower_step_hooks(
            {.begin =
                 [&](std::string_view attachment) {
                   seen = std::string(attachment);
                   layers = 0;
                 },
             .end = [&, rank] { return absl::StrCat("rank ", rank, " ", seen, " ", layers); }});
        follower_status[rank] = (*follower)->Run();
      });
    }
    auto comm =
        collective::CreateGlooCommunicator({.rank = 0, .size = kTp, .file_store_dir = dir.path()});
    ASSERT_TRUE(comm.ok()) << comm.status();
    EngineOptions options = Options(model);
    options.tensor_parallel = comm->get();
    options.tensor_parallel_step_attachment = [&](std::span<const KvWritten> written) {
      // Every other step carries the ids and token ranges it writes.
      if (steps++ % 2 == 1) return std::string();
      std::string bytes;
      for (const KvWritten& w : written) {
        bytes += absl::StrCat(std::string(w.request_id), "[", w.begin, ",", w.end);
        bytes += ")";
      }
      sent.push_back(bytes);
      return bytes;
    };
    options.tensor_parallel_step_reports = [&](std::span<const std::string> step) {
      reports.emplace_back(step.begin(), step.end());
    };
    auto engine = LlmEngine::Create(options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    num_layers = (*engine)->config().num_layers;
    auto out = GenerateAll(**engine, Requests((*engine)->config().vocab_size));
    ASSERT_TRUE(out.ok()) << out.status();
    engine->reset();
  }
  for (int rank = 1; rank < kTp; ++rank) {
    EXPECT_TRUE(follower_status[rank].ok()) << "rank " << rank << ": " << follower_status[rank];
  }
  ASSERT_GT(steps, kSteps);
  ASSERT_EQ(reports.size(), sent.size());
  EXPECT_EQ(sent.size(), static_cast<size_t>((steps + 1) / 2));
  for (size_t i = 0; i < sent.size(); ++i) {
    ASSERT_EQ(reports[i].size(), static_cast<size_t>(kTp - 1));
    for (int rank = 1; rank < kTp; ++rank) {
      EXPECT_EQ(reports[i][rank - 1], absl::StrCat("rank ", rank, " ", sent[i], " ", num_layers))
          << "step " << 2 * i;
    }
  }
}

// Weight-only quantised checkpoints split unpacked: a rank's output rows with their scales,
// or its inputs with their groups' scales; tp=2 and tp=4 give the tokens of one engine on the
// same checkpoint. Groups of 8 inputs keep 4 ranks' parts of down_proj's 160 inputs whole
// groups; groups of 32 are cut by both degrees (80 or 40 inputs a rank), and act order scatters
// each group over every rank's inputs.
struct QuantizedTpCase {
  std::string name;
  std::string quant;
  int group_size = 8;
  bool desc_act = false;
};

class QuantizedTensorParallelTest
    : public ::testing::TestWithParam<std::tuple<QuantizedTpCase, int /*tp*/>> {};

TEST_P(QuantizedTensorParallelTest, GivesTheTokensOfOneEngine) {
  const auto& [c, tp] = GetParam();
  ExpectGroupMatchesOneEngine(testing::TinyQuantModel("llama", c.quant, DType::kF32, c.desc_act,
                                                      true, c.group_size),
                              tp);
}

INSTANTIATE_TEST_SUITE_P(
    QuantsAndDegrees, QuantizedTensorParallelTest,
    ::testing::Combine(::testing::Values(QuantizedTpCase{"int8", "int8"},
                                         QuantizedTpCase{"awq", "awq"},
                                         QuantizedTpCase{"gptq", "gptq"},
                                         QuantizedTpCase{"awq_cut_groups", "awq", 32},
                                         QuantizedTpCase{"gptq_act_order", "gptq", 32, true}),
                       ::testing::Values(2, 4)),
    [](const auto& info) {
      return absl::StrCat(std::get<0>(info.param).name, "_tp", std::get<1>(info.param));
    });

TEST(TensorParallelShardTest, SplitsOrReplicatesKvHeads) {
  text::ModelConfig c;
  c.architecture_name = "LlamaForCausalLM";
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.intermediate_size = 96;
  c.vocab_size = 10;
  auto split = TensorParallelShard::For(c, 1, 2);
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(split->q_head_begin, 4);
  EXPECT_EQ(split->kv_head_begin, 1);
  EXPECT_EQ(split->num_kv_heads, 1);
  EXPECT_EQ(split->intermediate_begin, 48);
  EXPECT_EQ(split->vocab_begin, 5);
  EXPECT_EQ(split->vocab_rows, 5);
  // Eight ranks over two KV heads: ranks 4..7 read KV head 1.
  auto replicated = TensorParallelShard::For(c, 5, 8);
  ASSERT_TRUE(replicated.ok()) << replicated.status();
  EXPECT_EQ(replicated->q_head_begin, 5);
  EXPECT_EQ(replicated->kv_head_begin, 1);
  EXPECT_EQ(replicated->num_kv_heads, 1);
  // Vocabulary slices of ceil(10 / 8) = 2 rows: rank 5 holds none.
  EXPECT_EQ(replicated->vocab_stride, 2);
  EXPECT_EQ(replicated->vocab_rows, 0);
  auto bad = TensorParallelShard::For(c, 0, 3);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("does not divide the 8 attention heads"), std::string::npos)
      << bad.status();
}

}  // namespace
}  // namespace tandem::engine
