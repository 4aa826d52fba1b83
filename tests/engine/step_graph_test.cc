// Decode steps through step graphs (ModelRunnerOptions::graph_batch_sizes), on the CPU backend
// behind a wrapper that records a capture and replays it as a CUDA graph does
// (graph_recording_backend.h): each step's logits must be bitwise an eager runner's on the
// same sequences, whatever the step's batch size (padded to the next graph size), and the
// graphs must actually replay. On a GPU, gpu_runner_test checks the CUDA graphs themselves.
#include <algorithm>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "graph_recording_backend.h"
#include "tandem/engine/block_manager.h"
#include "tandem/engine/checkpoint.h"
#include "tandem/engine/llm_engine.h"
#include "tandem/engine/model_runner.h"
#include "tandem/kernels/backend.h"
#include "step_plan.h"
#include "test_models.h"

namespace tandem::engine {
namespace {

struct Model {
  std::string arch;
  DType dtype;
};

class StepGraphTest : public ::testing::TestWithParam<Model> {};

int32_t Argmax(std::span<const float> row) {
  return static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
}

// Runs `step` (every sequence sampling: 1 + its draft tokens logit rows) on `graphed` and `eager`
// and compares each row's logits bitwise, or with `backend_draws` (no drafts) the tokens
// `graphed` draws in the backend (greedy) with the eager logits' argmax, but for the first row
// of a step of several, whose logits come back for the host (set_backend_sampling's host
// rows); then accepts every sequence's drafts and appends the eager argmax of its last row.
void StepOnBoth(ModelRunner& graphed, ModelRunner& eager, const SchedulerStep& step, int vocab,
                bool backend_draws) {
  const bool host_row = backend_draws && step.seqs.size() > 1;
  if (backend_draws) {
    std::vector<kernels::SampleRowParams> rows(step.seqs.size());
    graphed.set_backend_sampling(rows, {}, host_row ? std::vector<int32_t>{0}
                                                    : std::vector<int32_t>{});
  }
  auto got = graphed.Execute(step);
  ASSERT_TRUE(got.ok()) << got.status();
  const std::vector<float> graph_logits(got->begin(), got->end());
  auto want = eager.Execute(step);
  ASSERT_TRUE(want.ok()) << want.status();
  size_t rows = 0;
  for (const ScheduledSequence& s : step.seqs) rows += 1 + s.num_draft_tokens;
  ASSERT_EQ(want->size(), rows * vocab);
  if (backend_draws) {
    ASSERT_EQ(graph_logits.size(), host_row ? static_cast<size_t>(vocab) : 0u);
    if (host_row) {
      EXPECT_TRUE(std::equal(want->begin(), want->begin() + vocab, graph_logits.begin()))
          << "the host row's logits differ";
    }
    const ModelRunner::BackendSamples drawn = graphed.backend_samples();
    ASSERT_EQ(drawn.tokens.size(), step.seqs.size());
    for (size_t r = host_row ? 1 : 0; r < step.seqs.size(); ++r) {
      EXPECT_EQ(drawn.tokens[r].token, Argmax(want->subspan(r * vocab, vocab))) << "row " << r;
    }
  } else {
    ASSERT_EQ(graph_logits.size(), want->size());
    size_t r = 0;
    for (const ScheduledSequence& s : step.seqs) {
      for (int j = 0; j <= s.num_draft_tokens; ++j, ++r) {
        EXPECT_TRUE(std::equal(want->begin() + r * vocab, want->begin() + (r + 1) * vocab,
                               graph_logits.begin() + r * vocab))
            << "row " << r << " (context "
            << s.seq->num_computed_tokens + s.num_new_tokens - s.num_draft_tokens + j
            << ") differs";
      }
    }
  }
  // Every draft accepted, then the token after them: the next step attends over the drafts'
  // KV as both runners wrote it.
  size_t row = 0;
  for (const ScheduledSequence& s : step.seqs) {
    Sequence& seq = *s.seq;
    row += s.num_draft_tokens;
    seq.tokens.insert(seq.tokens.end(), seq.draft_tokens.begin(),
                      seq.draft_tokens.begin() + s.num_draft_tokens);
    seq.draft_tokens.clear();
    seq.num_computed_tokens = static_cast<int>(seq.tokens.size());
    seq.tokens.push_back(Argmax(want->subspan(row * vocab, vocab)));
    ++row;
  }
}

// Runs one plan of steps on an eager runner and on `graphed` (the graph sizes 1, 2, 4 and 8,
// 3 blocks of 16 per graph step), comparing each step's logits (or, on the steps that sample in
// the backend, its tokens with the eager logits' argmax).
void RunSteps(const Checkpoint& checkpoint, kernels::Backend* graphed,
              ModelRunner** graph_runner_out, std::unique_ptr<ModelRunner>* keep) {
  const ModelRunnerOptions eager_options{.max_num_batched_tokens = 256,
                                         .max_num_seqs = 8,
                                         .num_kv_blocks = 64,
                                         .block_size = 16};
  auto cpu = kernels::CreateCpuBackend({.num_threads = 1});
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  auto eager = ModelRunner::Create(checkpoint, cpu->get(), eager_options);
  ASSERT_TRUE(eager.ok()) << eager.status();
  ModelRunnerOptions options = eager_options;
  options.graph_batch_sizes = {8, 1, 2, 4, 64};  // 64: past the 8 logit rows, dropped
  options.max_blocks_per_seq = 3;
  options.backend_sampling = true;
  auto graph_runner = ModelRunner::Create(checkpoint, graphed, options);
  ASSERT_TRUE(graph_runner.ok()) << graph_runner.status();
  *graph_runner_out = graph_runner->get();
  *keep = std::move(graph_runner).value();
  ModelRunner& runner = **graph_runner_out;
  const int vocab = checkpoint.config().vocab_size;

  // Eight sequences; the last starts 44 tokens long, so its steps outgrow the graphs' 48
  // positions after a few tokens and then run eagerly.
  BlockManager blocks(eager_options.num_kv_blocks, eager_options.block_size);
  std::vector<Sequence> seqs(8);
  for (int i = 0; i < 8; ++i) {
    const int len = i == 7 ? 44 : 3 + 5 * i;
    for (int t = 0; t < len; ++t) seqs[i].tokens.push_back((t * 37 + i * 11 + 5) % vocab);
    seqs[i].num_prompt_tokens = len;
  }
  // Step 0 prefills sequences 0-5; later steps decode the listed ones, mixing in the prefill of
  // 6 and 7 at step 3 (a step no graph runs).
  const std::vector<std::vector<int>> plan = {
      {0, 1, 2, 3, 4, 5}, {0},       {1, 2},          {0, 1, 2, 6, 7}, {3, 4, 5},
      {0},                {5, 1},    {0, 1, 2, 3, 4}, {7},             {2, 3, 4, 5, 6, 7, 0, 1},
      {6, 7, 0},          {4},       {1, 2, 3},       {7, 6, 5, 4},    {0, 1, 2, 3, 4, 5, 6, 7},
      {2},                {7, 1},    {3, 5, 7},
  };
  for (size_t step_index = 0; step_index < plan.size(); ++step_index) {
    SCOPED_TRACE(::testing::Message() << "step " << step_index);
    SchedulerStep step;
    for (int i : plan[step_index]) {
      ASSERT_TRUE(testing::ScheduleRest(blocks, seqs[i], step).ok());
    }
    StepOnBoth(runner, **eager, step, vocab, /*backend_draws=*/step_index % 3 == 2);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST_P(StepGraphTest, ReplayedDecodeStepsGiveTheEagerLogits) {
  auto checkpoint = Checkpoint::Open(testing::TinyModel(GetParam().arch, GetParam().dtype));
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  std::unique_ptr<testing::GraphRecordingBackend> backend = testing::GraphRecording();
  ModelRunner* runner = nullptr;
  std::unique_ptr<ModelRunner> keep;
  RunSteps(**checkpoint, backend.get(), &runner, &keep);
  if (HasFatalFailure()) return;
  // Decode steps of 1, 2, 3/4 and 5-8 sequences: one graph per size, captured on first use;
  // the prefill steps and sequence 7's steps past 48 positions ran eagerly, the rest replayed.
  EXPECT_EQ(runner->graphs_captured(), 4);
  EXPECT_EQ(backend->captures(), 4);
  EXPECT_GE(runner->graph_replays(), 8);
  EXPECT_EQ(backend->launches(), runner->graph_replays());
}

INSTANTIATE_TEST_SUITE_P(Models, StepGraphTest,
                         ::testing::Values(Model{"llama", DType::kF32},
                                           Model{"qwen2", DType::kF32},
                                           Model{"qwen3", DType::kBF16}),
                         [](const auto& info) { return info.param.arch; });

TEST(StepGraphFallbackTest, ABackendWithoutGraphsRunsEveryStepEagerly) {
  auto checkpoint = Checkpoint::Open(testing::TinyModel("llama", DType::kF32));
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  std::unique_ptr<kernels::Backend> backend = testing::DeviceLike();
  ModelRunner* runner = nullptr;
  std::unique_ptr<ModelRunner> keep;
  RunSteps(**checkpoint, backend.get(), &runner, &keep);
  if (HasFatalFailure()) return;
  EXPECT_EQ(runner->graphs_captured(), 0);
  EXPECT_EQ(runner->graph_replays(), 0);
}

// Contexts past 16 blocks take graphs bounded by 32 blocks, then by the table's 40: each bound
// its own graph, captured when a step first needs it, every step bitwise the eager one's.
TEST(StepGraphContextTest, LongerContextsTakeGraphsOfALargerBound) {
  auto checkpoint = Checkpoint::Open(testing::TinyModel("llama", DType::kF32));
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  const int vocab = (*checkpoint)->config().vocab_size;
  ModelRunnerOptions options{.max_num_batched_tokens = 1024,
                             .max_num_seqs = 4,
                             .num_kv_blocks = 128,
                             .block_size = 16};
  auto cpu = kernels::CreateCpuBackend({.num_threads = 1});
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  auto eager = ModelRunner::Create(**checkpoint, cpu->get(), options);
  ASSERT_TRUE(eager.ok()) << eager.status();
  std::unique_ptr<testing::GraphRecordingBackend> backend = testing::GraphRecording();
  options.graph_batch_sizes = {2};
  options.max_blocks_per_seq = 40;
  auto graphed = ModelRunner::Create(**checkpoint, backend.get(), options);
  ASSERT_TRUE(graphed.ok()) << graphed.status();

  // Two sequences decoding side by side from 240 and 505 tokens: contexts up to 512 take the
  // 32-block bound (steps 1-7), then the longer one's 513 the table's 40 (step 8); then the
  // shorter one alone (a batch of 1, padded to 2; contexts 249 to 253) the 16-block bound.
  BlockManager blocks(options.num_kv_blocks, options.block_size);
  std::vector<Sequence> seqs(2);
  for (int i = 0; i < 2; ++i) {
    const int len = i == 0 ? 240 : 505;
    for (int t = 0; t < len; ++t) seqs[i].tokens.push_back((t * 41 + i * 3 + 7) % vocab);
    seqs[i].num_prompt_tokens = len;
  }
  for (int step_index = 0; step_index < 14; ++step_index) {
    SCOPED_TRACE(::testing::Message() << "step " << step_index);
    SchedulerStep step;
    for (int i = 0; i < 2; ++i) {
      if (step_index >= 9 && i == 1) continue;
      ASSERT_TRUE(testing::ScheduleRest(blocks, seqs[i], step).ok());
    }
    StepOnBoth(**graphed, **eager, step, vocab, /*backend_draws=*/false);
    if (HasFatalFailure()) return;
  }
  EXPECT_EQ(backend->captures(), (*graphed)->graphs_captured());
  EXPECT_EQ((*graphed)->graphs_captured(), 3);
  EXPECT_EQ((*graphed)->graph_replays(), 13 - 3);
}

// Speculative verification steps (each sequence's last token and 0-3 draft tokens, every one
// yielding logits) replay graphs sized by their tokens: every logit row bitwise the eager
// runner's, with the drafts' KV written where the eager runner writes it.
TEST(StepGraphVerifyTest, VerificationStepsReplayGraphsSizedByTheirTokens) {
  auto checkpoint = Checkpoint::Open(testing::TinyModel("qwen3", DType::kF32));
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  const int vocab = (*checkpoint)->config().vocab_size;
  ModelRunnerOptions options{.max_num_batched_tokens = 256,
                             .max_num_seqs = 4,
                             .num_kv_blocks = 64,
                             .block_size = 16,
                             .max_logit_rows_per_seq = 4};
  auto cpu = kernels::CreateCpuBackend({.num_threads = 1});
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  auto eager = ModelRunner::Create(**checkpoint, cpu->get(), options);
  ASSERT_TRUE(eager.ok()) << eager.status();
  std::unique_ptr<testing::GraphRecordingBackend> backend = testing::GraphRecording();
  options.graph_batch_sizes = {4, 8, 16};
  options.max_blocks_per_seq = 8;
  auto graphed = ModelRunner::Create(**checkpoint, backend.get(), options);
  ASSERT_TRUE(graphed.ok()) << graphed.status();

  BlockManager blocks(options.num_kv_blocks, options.block_size);
  std::vector<Sequence> seqs(4);
  for (int i = 0; i < 4; ++i) {
    for (int t = 0; t < 6 + 9 * i; ++t) seqs[i].tokens.push_back((t * 19 + i * 5 + 3) % vocab);
    seqs[i].num_prompt_tokens = static_cast<int>(seqs[i].tokens.size());
  }
  // Draft tokens per sequence and step (-1: the sequence is not in the step); step 0 prefills.
  const std::vector<std::vector<int>> drafts = {
      {0, 0, 0, 0}, {3, 1, 0, 2}, {0, 3, -1, 1}, {2, 2, 2, 2}, {1, -1, -1, -1},
      {3, 0, 3, 0}, {0, 1, 2, 3}, {-1, 3, -1, -1}, {2, 1, 3, 0},
  };
  for (size_t p = 0; p < drafts.size(); ++p) {
    SCOPED_TRACE(::testing::Message() << "step " << p);
    SchedulerStep step;
    for (int i = 0; i < 4; ++i) {
      const int k = drafts[p][i];
      if (k < 0) continue;
      Sequence& seq = seqs[i];
      seq.draft_tokens.clear();
      for (int j = 0; j < k; ++j) seq.draft_tokens.push_back((seq.tokens.size() * 7 + j) % vocab);
      const int n = static_cast<int>(seq.tokens.size()) + k - seq.num_computed_tokens;
      ASSERT_TRUE(blocks.Append(seq.block_table, seq.num_computed_tokens, n).ok());
      step.seqs.push_back({&seq, n, true, p == 0 ? 0 : k});
      step.num_tokens += n;
    }
    StepOnBoth(**graphed, **eager, step, vocab, /*backend_draws=*/false);
    if (HasFatalFailure()) return;
  }
  // Steps of 10, 7, 12, 2, 10, 10, 4 and 10 tokens: sizes 16, 8, 16, 4, 16, 16, 4 and 16 (the
  // contexts all within the table's 8 blocks), one capture each of 16, 8 and 4, 5 replays.
  EXPECT_EQ((*graphed)->graphs_captured(), 3);
  EXPECT_EQ((*graphed)->graph_replays(), 5);
  EXPECT_EQ(backend->launches(), 5);
}

TEST(DecodeGraphBatchSizesTest, CoverEveryBatchUpToMaxNumSeqs) {
  EXPECT_EQ(DecodeGraphBatchSizes(1), (std::vector<int>{1}));
  EXPECT_EQ(DecodeGraphBatchSizes(3), (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(DecodeGraphBatchSizes(20), (std::vector<int>{1, 2, 4, 8, 16, 20}));
  const std::vector<int> sizes = DecodeGraphBatchSizes(1024);
  EXPECT_EQ(sizes.back(), 512);
  EXPECT_EQ(sizes.size(), 3u + 64u);
}

}  // namespace
}  // namespace tandem::engine
