// CPU decode step of a synthetic bf16 checkpoint, its weights held as float32 and as bfloat16
// (and whatever --dtypes lists) in one run: time per step and the memory bandwidth it achieves,
// as a fraction of a read-only streaming kernel and of a STREAM-like copy, both measured in
// the same run.
//
//   tandem_bench_decode [--preset=small] [--context=256] [--dtypes=float32,bfloat16]
//                       [--batches=1,4,16] [--bandwidth-mib=256] [google benchmark flags]
//
// The bandwidth kernels stream --bandwidth-mib MiB: more than the last-level cache to measure
// memory, as a preset whose weights do not fit it (medium) needs.
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/bandwidth.h"
#include "benchmark/benchmark.h"
#include "tandem/engine/block_manager.h"
#include "tandem/engine/checkpoint.h"
#include "tandem/engine/model_runner.h"
#include "tandem/kernels/backend.h"
#include "tandem/tools/synth_model.h"

namespace tandem {
namespace {

std::string g_preset = "small";
int g_context = 256;
double g_copy_gbs = 0;
double g_read_gbs = 0;

std::string ModelDir() {
  std::string dir =
      (std::filesystem::temp_directory_path() / ("tandem-bench-" + g_preset)).string();
  if (!std::filesystem::exists(dir + "/config.json")) {
    tools::SynthModelOptions options;
    options.out_dir = dir;
    options.preset = g_preset;
    options.dtype = DType::kBF16;
    absl::Status s = tools::WriteSyntheticModel(options);
    if (!s.ok()) {
      std::fprintf(stderr, "cannot write the %s model: %s\n", g_preset.c_str(),
                   std::string(s.message()).c_str());
      std::exit(1);
    }
  }
  return dir;
}

// Bytes a decode step must read from memory at least: every projection matrix and the LM head
// once (of `weight_dtype`), one embedding row per token (counted as fp32), and each sequence's KV
// (of `kv_dtype`).
double BytesPerStep(const text::ModelConfig& c, int batch, int context, DType weight_dtype,
                    DType kv_dtype) {
  const double hidden = c.hidden_size, inter = c.intermediate_size;
  const double q_dim = c.num_heads * c.head_dim, kv_dim = c.num_kv_heads * c.head_dim;
  double per_layer = hidden * (q_dim + 2 * kv_dim) + q_dim * hidden + 3 * hidden * inter;
  double weights = c.num_layers * per_layer + c.vocab_size * hidden;
  double kv = static_cast<double>(batch) * context * c.num_layers * 2 * kv_dim;
  return DTypeSize(weight_dtype) * weights + DTypeSize(kv_dtype) * kv + 4.0 * batch * hidden;
}

void BM_DecodeStep(benchmark::State& state, DType weight_dtype) {
  const int batch = static_cast<int>(state.range(0));
  const int context = g_context;
  auto checkpoint = engine::Checkpoint::Open(ModelDir());
  if (!checkpoint.ok()) {
    state.SkipWithError(std::string(checkpoint.status().message()).c_str());
    return;
  }
  const text::ModelConfig& c = (*checkpoint)->config();
  auto backend = kernels::CreateCpuBackend({.num_threads = 2});
  const int block_size = 16;
  const int blocks_per_seq = (context + 1 + block_size - 1) / block_size;
  engine::BlockManager blocks(batch * blocks_per_seq, block_size);
  auto runner = engine::ModelRunner::Create(**checkpoint, backend->get(),
                                            {.max_num_batched_tokens = std::max(batch, context),
                                             .max_num_seqs = batch,
                                             .num_kv_blocks = batch * blocks_per_seq,
                                             .block_size = block_size,
                                             .weight_dtype = weight_dtype});
  if (!runner.ok()) {
    state.SkipWithError(std::string(runner.status().message()).c_str());
    return;
  }
  std::vector<engine::Sequence> seqs(batch);
  for (int b = 0; b < batch; ++b) {
    engine::Sequence& s = seqs[b];
    for (int i = 0; i <= context; ++i) s.tokens.push_back((i * 31 + b * 7) % c.vocab_size);
    s.num_prompt_tokens = context;
    (void)blocks.Append(s.block_table, 0, context + 1);
    // Fill the cache for the context with one prefill per sequence.
    engine::SchedulerStep prefill;
    prefill.seqs.push_back({&s, context, false});
    prefill.num_tokens = context;
    (void)(*runner)->Execute(prefill);
    s.num_computed_tokens = context;
  }
  engine::SchedulerStep step;
  for (engine::Sequence& s : seqs) step.seqs.push_back({&s, 1, true});
  step.num_tokens = batch;
  double seconds = 0;
  for (auto _ : state) {
    auto start = std::chrono::steady_clock::now();
    auto logits = (*runner)->Execute(step);
    benchmark::DoNotOptimize(logits);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  const double step_s = seconds / static_cast<double>(state.iterations());
  const DType kv_dtype = (*runner)->cache_layout().dtype;
  const double bytes = BytesPerStep(c, batch, context, weight_dtype, kv_dtype);
  const double gbs = bytes / step_s / 1e9;
  state.counters["step_ms"] = step_s * 1e3;
  state.counters["MB_per_step"] = bytes / 1e6;
  state.counters["GB_per_s"] = gbs;
  state.counters["read_GB_per_s"] = g_read_gbs;
  state.counters["of_read"] = gbs / g_read_gbs;
  state.counters["of_copy"] = gbs / g_copy_gbs;
  state.counters["tokens_per_s"] = batch / step_s;
  state.SetLabel(absl::StrCat(g_preset, " ", c.NumParameters() / 1000000, "M params, ",
                              DTypeFlagName(weight_dtype), " weights, ", DTypeFlagName(kv_dtype),
                              " KV, context ", context));
}

}  // namespace
}  // namespace tandem

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  std::vector<tandem::DType> dtypes = {tandem::DType::kF32, tandem::DType::kBF16};
  std::vector<int64_t> batches = {1, 4, 16};
  size_t bandwidth_bytes = size_t{256} << 20;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--preset=", 0) == 0) {
      tandem::g_preset = a.substr(9);
    } else if (a.rfind("--context=", 0) == 0) {
      tandem::g_context = std::atoi(a.c_str() + 10);
    } else if (a.rfind("--dtypes=", 0) == 0) {
      dtypes.clear();
      for (absl::string_view name : absl::StrSplit(a.substr(9), ',')) {
        const std::optional<tandem::DType> d = tandem::ParseDTypeFlag(std::string(name));
        if (!d.has_value() || tandem::DTypeSize(*d) == 1) {
          std::fprintf(stderr, "tandem_bench_decode: --dtypes: not a weight type: %s\n",
                       std::string(name).c_str());
          return 2;
        }
        dtypes.push_back(*d);
      }
    } else if (a.rfind("--bandwidth-mib=", 0) == 0) {
      bandwidth_bytes = static_cast<size_t>(std::atol(a.c_str() + 16)) << 20;
    } else if (a.rfind("--batches=", 0) == 0) {
      batches.clear();
      for (absl::string_view b : absl::StrSplit(a.substr(10), ',')) {
        batches.push_back(std::atoi(std::string(b).c_str()));
      }
    } else {
      std::fprintf(stderr, "tandem_bench_decode: unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  tandem::g_read_gbs = tandem::bench::MeasureReadBandwidthGBs(2, bandwidth_bytes);
  tandem::g_copy_gbs = tandem::bench::MeasureCopyBandwidthGBs(2, bandwidth_bytes);
  std::printf("read bandwidth (2 threads, read-only sum of %zu MiB, same run): %.2f GB/s\n",
              bandwidth_bytes >> 20, tandem::g_read_gbs);
  std::printf("copy bandwidth (2 threads, %zu MiB, same run): %.2f GB/s\n", bandwidth_bytes >> 20,
              tandem::g_copy_gbs);
  for (tandem::DType dtype : dtypes) {
    auto* b = benchmark::RegisterBenchmark(
        absl::StrCat("BM_DecodeStep/", tandem::DTypeFlagName(dtype)).c_str(),
        [dtype](benchmark::State& state) { tandem::BM_DecodeStep(state, dtype); });
    for (int64_t batch : batches) b->Arg(batch);
    b->Unit(benchmark::kMillisecond)->UseRealTime();
  }
  benchmark::RunSpecifiedBenchmarks();
  return 0;
}
