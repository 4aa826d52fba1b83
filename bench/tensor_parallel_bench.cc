// Tensor parallelism on the CPU: the Gloo all-reduce on loopback against a memcpy of the same
// bytes (the yardstick, measured in the same run), and an engine's decode step at tp=1 and tp=2
// (ranks as threads with one CPU thread each, as `--tp 2 --threads 1` runs them as processes).
// Results: bench/results/tensor-parallel-cpu-*.md.
//
//   build/bin/tandem_bench_tensor_parallel --benchmark_min_time=0.5
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tandem/collective/gloo_communicator.h"
#include "tandem/engine/llm_engine.h"
#include "tandem/tools/synth_model.h"

namespace {

using tandem::collective::Communicator;

std::string TempDir(const std::string& name) {
  std::string pattern = (std::filesystem::temp_directory_path() / (name + "_XXXXXX")).string();
  return ::mkdtemp(pattern.data());
}

// One group of `ranks` threads, joined on first use and kept for the whole run (rendezvous is
// not what is measured). comms[rank] belongs to the benchmark thread of that index.
std::vector<std::unique_ptr<Communicator>>& Group(int ranks) {
  static std::map<int, std::vector<std::unique_ptr<Communicator>>> groups;
  auto& group = groups[ranks];
  if (group.empty()) {
    const std::string dir = TempDir("tandem_bench_gloo");
    group.resize(ranks);
    std::vector<std::thread> joiners;
    for (int r = 0; r < ranks; ++r) {
      joiners.emplace_back([&, r] {
        auto comm = tandem::collective::CreateGlooCommunicator(
            {.rank = r, .size = ranks, .file_store_dir = dir});
        if (!comm.ok()) {
          std::fprintf(stderr, "%s\n", comm.status().ToString().c_str());
          std::abort();
        }
        group[r] = std::move(comm).value();
      });
    }
    for (std::thread& t : joiners) t.join();
    std::filesystem::remove_all(dir);
  }
  return group;
}

// Each benchmark thread is one rank; Google Benchmark runs them concurrently and gives each the
// same number of iterations, so the collectives stay in step.
void BM_GlooAllReduce(benchmark::State& state) {
  const size_t floats = static_cast<size_t>(state.range(0)) / sizeof(float);
  static std::vector<std::unique_ptr<Communicator>>* group = nullptr;
  if (state.thread_index() == 0) group = &Group(state.threads());
  // Google Benchmark starts the timed loop of all threads together (a barrier), after this.
  std::vector<float> data(floats, 1.0f);
  for (auto _ : state) {
    absl::Status s = (*group)[state.thread_index()]->AllReduceSum(data.data(), floats);
    if (!s.ok()) state.SkipWithError(s.ToString().c_str());
    benchmark::DoNotOptimize(data.data());
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(floats * sizeof(float)));
}
BENCHMARK(BM_GlooAllReduce)
    ->ArgName("bytes")
    ->Arg(4 << 10)
    ->Arg(64 << 10)
    ->Arg(1 << 20)
    ->Arg(16 << 20)
    ->Threads(2)
    ->Threads(4)
    ->UseRealTime();

// The yardstick: one copy of the same bytes in this process.
void BM_Memcpy(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  std::vector<char> a(bytes, 1), b(bytes);
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), bytes);
    benchmark::DoNotOptimize(b.data());
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(bytes));
}
BENCHMARK(BM_Memcpy)->ArgName("bytes")->Arg(4 << 10)->Arg(64 << 10)->Arg(1 << 20)->Arg(16 << 20);

std::string SmallModel() {
  static const std::string dir = [] {
    std::string d = (std::filesystem::temp_directory_path() / "tandem-bench-small-llama").string();
    if (!std::filesystem::exists(d + "/config.json")) {
      tandem::tools::SynthModelOptions options;
      options.out_dir = d;
      options.preset = "small";
      options.arch = "llama";
      options.dtype = tandem::DType::kBF16;
      absl::Status s = tandem::tools::WriteSyntheticModel(options);
      if (!s.ok()) {
        std::fprintf(stderr, "%s\n", s.ToString().c_str());
        std::abort();
      }
    }
    return d;
  }();
  return dir;
}

// One decode step of `batch` sequences on the `small` model (512 hidden, 8 layers), the model
// split over `tp` ranks.
void BM_DecodeStep(benchmark::State& state) {
  const int tp = static_cast<int>(state.range(0));
  const int batch = static_cast<int>(state.range(1));
  const std::string model = SmallModel();
  const std::string dir = TempDir("tandem_bench_tp");
  tandem::engine::EngineOptions options{
      .model_dir = model, .num_threads = 1, .kv_cache_bytes = 256 << 20};
  std::vector<std::thread> followers;
  for (int r = 1; r < tp; ++r) {
    followers.emplace_back([&, r] {
      auto comm = tandem::collective::CreateGlooCommunicator(
          {.rank = r, .size = tp, .file_store_dir = dir});
      if (!comm.ok()) std::abort();
      tandem::engine::EngineOptions o = options;
      o.tensor_parallel = comm->get();
      absl::Status s = tandem::engine::RunTensorParallelFollower(o);
      if (!s.ok()) std::fprintf(stderr, "follower %d: %s\n", r, s.ToString().c_str());
    });
  }
  std::unique_ptr<Communicator> comm;
  if (tp > 1) {
    comm =
        tandem::collective::CreateGlooCommunicator({.rank = 0, .size = tp, .file_store_dir = dir})
            .value();
    options.tensor_parallel = comm.get();
  }
  {
    auto engine = tandem::engine::LlmEngine::Create(options).value();
    for (int i = 0; i < batch; ++i) {
      std::vector<int32_t> prompt(16);
      for (int j = 0; j < 16; ++j) prompt[j] = 1 + (i * 16 + j) % 400;
      absl::Status s =
          engine->AddRequest({absl::StrCat("r", i),
                              prompt,
                              {.temperature = 0, .max_tokens = 3000, .ignore_eos = true}});
      if (!s.ok()) std::abort();
    }
    (void)engine->Step();  // the prompts
    const double collective_before = engine->stats().collective_seconds;
    const auto start = std::chrono::steady_clock::now();
    for (auto _ : state) {
      auto out = engine->Step();
      if (!out.ok()) state.SkipWithError(out.status().ToString().c_str());
    }
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // The share of rank 0's step time spent in collectives (step plan, all-reduces, logits).
    state.counters["collective_share"] =
        (engine->stats().collective_seconds - collective_before) / std::max(elapsed, 1e-9);
  }  // the engine stops its followers
  for (std::thread& t : followers) t.join();
  std::filesystem::remove_all(dir);
  state.counters["tokens_per_s"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * batch, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_DecodeStep)
    ->ArgNames({"tp", "batch"})
    ->Args({1, 1})
    ->Args({2, 1})
    ->Args({1, 8})
    ->Args({2, 8})
    ->Iterations(200)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
