// CPU decode step of a synthetic bf16 checkpoint, its weights held as float32 and as bfloat16,
// and of the same weights quantised to int8 (compressed-tensors W8A16) and int4 (AWQ, group
// 128), in one run (whatever --dtypes lists): time per step and the memory bandwidth it
// achieves, as a fraction of a read-only streaming kernel and of a STREAM-like copy, both
// measured in the same run.
//
//   tandem_bench_decode [--preset=small] [--context=256] [--dtypes=float32,bfloat16,int8,int4]
//                       (TYPE@ISA: that CPU instruction set, e.g. bfloat16@avx512-bf16-round or
//                       int4@avx512)
//                       [--batches=1,4,16] [--bandwidth-mib=256] [--device=cpu|cuda]
//                       [--num-layers=N (the preset's shape with N layers)]
//                       [--prefill=2048,... (also time one prefill of each length)]
//                       [--sampling=auto|host|backend (auto: backend on cuda, host on cpu, as
//                        --sampling-device; backend draws a greedy token per sequence in the
//                        backend and copies back only the tokens, host copies the logits)]
//                       [--graphs=auto|on|off (auto: on with cuda, as serving without
//                        --enforce-eager; on replays the decode step from a captured step graph)]
//                       [--paired[=N] (one benchmark that takes N steps (default 1) of each
//                        format in turn: each format's time from the same minutes, and
//                        F_speedup, the first format's step time over F's)]
//                       [--turn-warmup=K (with --paired=N, N > K: each turn's first K steps are
//                        taken but not timed, as a server holding one model never pays for
//                        another model's weights having passed through its caches)]
//                       [google benchmark flags]
//
// The bandwidth kernels stream --bandwidth-mib MiB: more than the last-level cache to measure
// memory, as a preset whose weights do not fit it (medium) needs. With --device=cuda the step
// runs on GPU 0 and both yardsticks are the device's own: a device-to-device cudaMemcpy (bytes
// read plus written) and, as "read", the same figure (a copy is the read-heavy limit there).
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/bandwidth.h"
#include "benchmark/benchmark.h"
#include "tandem/base/status_macros.h"
#include "tandem/engine/block_manager.h"
#include "tandem/engine/checkpoint.h"
#include "tandem/engine/model_runner.h"
#include "tandem/kernels/backend.h"
#include "tandem/kernels/cuda_backend.h"
#include "tandem/tools/synth_model.h"

#if TANDEM_BENCH_CUDA
#include "bench/cuda_bandwidth.h"
#endif

namespace tandem {
namespace {

std::string g_preset = "small";
int g_context = 256;
int g_turn_steps = 1;   // --paired=N: steps of each format per turn
int g_turn_warmup = 0;  // --turn-warmup=K: untimed steps at the start of each turn
double g_copy_gbs = 0;
double g_read_gbs = 0;
size_t g_bandwidth_bytes = size_t{256} << 20;
bool g_cuda = false;
std::string g_sampling = "auto";  // --sampling
bool BackendSampling() { return g_sampling == "backend" || (g_sampling == "auto" && g_cuda); }
std::string g_graphs = "auto";  // --graphs
bool StepGraphs() { return g_graphs == "on" || (g_graphs == "auto" && g_cuda); }
int g_num_layers = 0;  // 0: the preset's


// How a run holds its weights: converted to a float dtype at load, or a quantised checkpoint
// ("int8": compressed-tensors, "int4": AWQ group 128) whose other tensors stay bf16.
struct WeightFormat {
  std::string name;
  std::optional<DType> dtype;
  std::string quant;  // synth-model --quant, or empty
  kernels::CpuIsa isa = kernels::CpuIsa::kAuto;  // "TYPE@ISA" in --dtypes
};

std::string ModelDir(const std::string& quant) {
  std::string dir = (std::filesystem::temp_directory_path() /
                     ("tandem-bench-" + g_preset +
                      (g_num_layers > 0 ? "-l" + std::to_string(g_num_layers) : "") +
                      (quant.empty() ? "" : "-" + quant)))
                        .string();
  if (!std::filesystem::exists(dir + "/config.json")) {
    tools::SynthModelOptions options;
    options.out_dir = dir;
    options.preset = g_preset;
    options.num_layers = g_num_layers;
    options.dtype = DType::kBF16;
    options.quant = quant;
    absl::Status s = tools::WriteSyntheticModel(options);
    if (!s.ok()) {
      std::fprintf(stderr, "cannot write the %s model: %s\n", g_preset.c_str(),
                   std::string(s.message()).c_str());
      std::exit(1);
    }
  }
  return dir;
}

// Bytes a decode step must read from memory at least: every projection matrix (of the format's
// element size: quantised, its integers plus the fp32 scales and zero points the CPU backend
// holds per output row and group) and the LM head once (of `head_dtype`), one embedding row per
// token (counted as fp32), and each sequence's KV (of `kv_dtype`).
double BytesPerStep(const text::ModelConfig& c, int batch, int context, const WeightFormat& format,
                    DType head_dtype, DType kv_dtype) {
  const double hidden = c.hidden_size, inter = c.intermediate_size;
  const double q_dim = c.num_heads * c.head_dim, kv_dim = c.num_kv_heads * c.head_dim;
  // (rows, k) of each projection of a layer, fused as the runner holds them.
  const double shapes[4][2] = {
      {q_dim + 2 * kv_dim, hidden}, {hidden, q_dim}, {2 * inter, hidden}, {hidden, inter}};
  double projections = 0;
  for (const auto& [n, k] : shapes) {
    if (format.quant == "int8") {
      projections += n * k + 4 * n;
    } else if (format.quant == "awq") {
      projections += n * k / 2 + 8 * n * (k / 128);
    } else {
      projections += DTypeSize(head_dtype) * n * k;
    }
  }
  double kv = static_cast<double>(batch) * context * c.num_layers * 2 * kv_dim;
  return c.num_layers * projections + DTypeSize(head_dtype) * c.vocab_size * hidden +
         DTypeSize(kv_dtype) * kv + 4.0 * batch * hidden;
}

// The backend a run uses: GPU 0 with room for `max_seqs` sequences of up to `context` tokens
// and `tokens` query rows per call, or the CPU with two threads.
absl::StatusOr<std::unique_ptr<kernels::Backend>> MakeBackend(const text::ModelConfig& c,
                                                               int max_seqs, int tokens,
                                                               int context, int block_size,
                                                               kernels::CpuIsa isa) {
  if (!g_cuda) {
    TANDEM_ASSIGN_OR_RETURN(auto cpu, kernels::CreateCpuBackend({.num_threads = 2, .isa = isa}));
    return std::unique_ptr<kernels::Backend>(std::move(cpu));
  }
  TANDEM_ASSIGN_OR_RETURN(
      auto gpu, kernels::CreateCudaBackend(
                    {.max_seqs = std::max(max_seqs, 1),
                     .max_blocks_per_seq = (context + block_size - 1) / block_size,
                     .attention_workspace_bytes = kernels::CudaAttentionWorkspaceBytes(
                         tokens, c.num_heads, c.head_dim, context)}));
  return std::unique_ptr<kernels::Backend>(std::move(gpu));
}

// A run's checkpoint and backend; checkpoint null when either failed (the benchmark is then
// skipped with the reason).
struct Setup {
  std::unique_ptr<engine::Checkpoint> checkpoint;
  std::shared_ptr<kernels::Backend> backend;
};
// `shared`, if not null, is the backend to use (runs that share one CPU backend share its thread
// pool); otherwise a new one.
Setup OpenModel(benchmark::State& state, const WeightFormat& format, int max_seqs, int tokens,
                int context, int block_size, std::shared_ptr<kernels::Backend> shared = nullptr) {
  auto checkpoint = engine::Checkpoint::Open(ModelDir(format.quant));
  if (!checkpoint.ok()) {
    state.SkipWithError(std::string(checkpoint.status().message()).c_str());
    return {};
  }
  if (shared != nullptr) return {std::move(checkpoint).value(), std::move(shared)};
  auto backend = MakeBackend((*checkpoint)->config(), max_seqs, tokens, context, block_size,
                             format.isa);
  if (!backend.ok()) {
    state.SkipWithError(std::string(backend.status().message()).c_str());
    return {};
  }
  return {std::move(checkpoint).value(), std::move(backend).value()};
}

// One prefill of `tokens` prompt tokens (state.range(0)) into an empty cache: the time to the
// first token's logits without HTTP, tokenizer or queueing, and its rate in TFLOP/s counting
// 2 x the layers' projection parameters per token, causal attention (2 T^2 head_dim per query
// head per layer) and the LM head of the one sampled row.
void BM_Prefill(benchmark::State& state, const WeightFormat& format) {
  const int tokens = static_cast<int>(state.range(0));
  const int block_size = 16;
  const int blocks = (tokens + block_size - 1) / block_size;
  Setup setup = OpenModel(state, format, 1, tokens, tokens, block_size);
  if (setup.checkpoint == nullptr) return;
  const text::ModelConfig& c = setup.checkpoint->config();
  auto runner = engine::ModelRunner::Create(*setup.checkpoint, setup.backend.get(),
                                            {.max_num_batched_tokens = tokens,
                                             .max_num_seqs = 1,
                                             .num_kv_blocks = blocks,
                                             .block_size = block_size,
                                             .weight_dtype = format.dtype});
  if (!runner.ok()) {
    state.SkipWithError(std::string(runner.status().message()).c_str());
    return;
  }
  engine::BlockManager block_manager(blocks, block_size);
  engine::Sequence seq;
  for (int i = 0; i < tokens; ++i) seq.tokens.push_back((i * 31 + 7) % c.vocab_size);
  seq.num_prompt_tokens = tokens;
  (void)block_manager.Append(seq.block_table, 0, tokens);
  engine::SchedulerStep step;
  step.seqs.push_back({&seq, tokens, true});
  step.num_tokens = tokens;
  double seconds = 0;
  for (auto _ : state) {
    auto start = std::chrono::steady_clock::now();
    auto logits = (*runner)->Execute(step);
    if (!logits.ok()) {
      state.SkipWithError(std::string(logits.status().message()).c_str());
      return;
    }
    benchmark::DoNotOptimize(logits);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  const double step_s = seconds / static_cast<double>(state.iterations());
  const double hidden = c.hidden_size;
  const double q_dim = static_cast<double>(c.num_heads) * c.head_dim;
  const double kv_dim = static_cast<double>(c.num_kv_heads) * c.head_dim;
  const double layer_params =
      hidden * (q_dim + 2 * kv_dim) + q_dim * hidden + 3 * hidden * c.intermediate_size;
  const double t = tokens;
  const double flops =
      c.num_layers * (2 * layer_params * t + 2 * t * t * c.head_dim * c.num_heads) +
      2 * hidden * c.vocab_size;
  state.counters["ttft_ms"] = step_s * 1e3;
  state.counters["TFLOP_per_s"] = flops / step_s / 1e12;
  state.counters["TFLOP"] = flops / 1e12;
  state.SetLabel(absl::StrCat(g_preset, " ", c.NumParameters() / 1000000, "M params, ",
                              format.name, " weights, prefill of ", tokens, " tokens"));
}

// One format's decode step, ready to run: its checkpoint, backend and runner, and a batch of
// sequences whose caches hold g_context tokens, each decoding one token per step.
struct DecodeRun {
  WeightFormat format;
  Setup setup;
  std::unique_ptr<engine::BlockManager> blocks;
  std::unique_ptr<engine::ModelRunner> runner;
  std::vector<engine::Sequence> seqs;
  engine::SchedulerStep step;
  std::vector<kernels::SampleRowParams> greedy;
  double bytes = 0;  // BytesPerStep
  double seconds = 0;
  int64_t steps = 0;
};

// Builds `format`'s run at `batch` sequences and takes one untimed step (the graph's capture, or
// the eager path's first-use work); null, with the state skipped with the reason, on failure.
// On `backend` if not null, else on a backend of its own.
std::unique_ptr<DecodeRun> PrepareDecode(benchmark::State& state, const WeightFormat& format,
                                         int batch,
                                         std::shared_ptr<kernels::Backend> backend = nullptr) {
  const int context = g_context;
  const int block_size = 16;
  const int blocks_per_seq = (context + 1 + block_size - 1) / block_size;
  auto run = std::make_unique<DecodeRun>();
  run->format = format;
  run->setup = OpenModel(state, format, batch, std::max(batch, context), context + 1, block_size,
                         std::move(backend));
  if (run->setup.checkpoint == nullptr) return nullptr;
  const text::ModelConfig& c = run->setup.checkpoint->config();
  run->blocks = std::make_unique<engine::BlockManager>(batch * blocks_per_seq, block_size);
  auto runner = engine::ModelRunner::Create(
      *run->setup.checkpoint, run->setup.backend.get(),
      {.max_num_batched_tokens = std::max(batch, context),
       .max_num_seqs = batch,
       .num_kv_blocks = batch * blocks_per_seq,
       .block_size = block_size,
       .weight_dtype = format.dtype,
       .backend_sampling = BackendSampling(),
       .graph_batch_sizes = StepGraphs() ? std::vector<int>{batch} : std::vector<int>{},
       .max_blocks_per_seq = blocks_per_seq});
  if (!runner.ok()) {
    state.SkipWithError(std::string(runner.status().message()).c_str());
    return nullptr;
  }
  run->runner = std::move(runner).value();
  run->greedy.resize(batch);
  run->seqs.resize(batch);
  for (int b = 0; b < batch; ++b) {
    engine::Sequence& s = run->seqs[b];
    for (int i = 0; i <= context; ++i) s.tokens.push_back((i * 31 + b * 7) % c.vocab_size);
    s.num_prompt_tokens = context;
    (void)run->blocks->Append(s.block_table, 0, context + 1);
    // Fill the cache for the context with one prefill per sequence.
    engine::SchedulerStep prefill;
    prefill.seqs.push_back({&s, context, false});
    prefill.num_tokens = context;
    (void)run->runner->Execute(prefill);
    s.num_computed_tokens = context;
  }
  for (engine::Sequence& s : run->seqs) run->step.seqs.push_back({&s, 1, true});
  run->step.num_tokens = batch;
  if (BackendSampling()) run->runner->set_backend_sampling(run->greedy, {});
  if (absl::StatusOr<std::span<const float>> first = run->runner->Execute(run->step); !first.ok()) {
    state.SkipWithError(std::string(first.status().message()).c_str());
    return nullptr;
  }
  run->bytes = BytesPerStep(c, batch, context, format, run->runner->weight_dtype(),
                            run->runner->cache_layout().dtype);
  return run;
}

// Runs one decode step of `run` and adds its time to the run's.
void TimeStep(DecodeRun& run, bool timed = true) {
  auto start = std::chrono::steady_clock::now();
  if (BackendSampling()) run.runner->set_backend_sampling(run.greedy, {});
  auto logits = run.runner->Execute(run.step);
  benchmark::DoNotOptimize(logits);
  if (!timed) return;
  run.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ++run.steps;
}

// Read bandwidth for the ratios: on the CPU the read kernel runs again right after the steps (a
// shared machine's bandwidth can move by the minute), and the better of that and the
// start-of-run figure counts.
double ReadGBsAfterSteps() {
  return g_cuda ? g_read_gbs
                : std::max(g_read_gbs, bench::MeasureReadBandwidthGBs(2, g_bandwidth_bytes, 3));
}

std::string RunLabel(const DecodeRun& run) {
  const text::ModelConfig& c = run.setup.checkpoint->config();
  return absl::StrCat(g_preset, " ", c.NumParameters() / 1000000, "M params, ", run.format.name,
                      " weights, ", DTypeFlagName(run.runner->cache_layout().dtype),
                      " KV, context ", g_context,
                      BackendSampling() ? ", backend sampling" : ", host sampling",
                      run.runner->graphs_captured() > 0 ? ", step graph" : ", eager");
}

void BM_DecodeStep(benchmark::State& state, const WeightFormat& format) {
  const int batch = static_cast<int>(state.range(0));
  std::unique_ptr<DecodeRun> run = PrepareDecode(state, format, batch);
  if (run == nullptr) return;
  for (auto _ : state) TimeStep(*run);
  const double step_s = run->seconds / static_cast<double>(run->steps);
  const double gbs = run->bytes / step_s / 1e9;
  const double read_gbs = ReadGBsAfterSteps();
  state.counters["step_ms"] = step_s * 1e3;
  state.counters["MB_per_step"] = run->bytes / 1e6;
  state.counters["GB_per_s"] = gbs;
  state.counters["read_GB_per_s"] = read_gbs;
  state.counters["of_read"] = gbs / read_gbs;
  state.counters["of_copy"] = gbs / g_copy_gbs;
  state.counters["tokens_per_s"] = batch / step_s;
  state.counters["graph_steps"] = static_cast<double>(run->runner->graph_replays());
  state.SetLabel(RunLabel(*run));
}

// The formats' decode steps taken in turn, g_turn_steps steps of each per iteration, so that each
// format's time comes from the same stretch of the machine's (possibly shifting) memory bandwidth
// as the others': a ratio between them is then a property of the formats, not of when each ran.
// Per format F: F_ms (step time), F_of_read, and F_speedup (the first format's step time over
// F's). On the CPU, formats of the same instruction set share one backend, so one thread pool
// serves every step (a second pool's workers would still be polling for work, on the same two
// cores, when the next format's step starts). The first step of a turn reads its weights after
// the other formats' steps have passed through the caches: with one step per turn, a model whose
// weights would fit in the last-level cache (small at int4) is read from memory at every step,
// where served alone it would not be. Longer turns (--paired=16) let such a model's later steps
// find it in the cache, as a server that holds one model does; the turn's first step still counts
// unless --turn-warmup=K leaves each turn's first K steps untimed (a server holding one model
// never meets another's weights in its caches, yet the ratios still come from the same minutes).
void BM_DecodeStepPaired(benchmark::State& state, const std::vector<WeightFormat>& formats) {
  const int batch = static_cast<int>(state.range(0));
  std::vector<std::unique_ptr<DecodeRun>> runs;
  for (const WeightFormat& format : formats) {
    std::shared_ptr<kernels::Backend> backend;
    for (const std::unique_ptr<DecodeRun>& run : runs) {
      if (!g_cuda && run->format.isa == format.isa) backend = run->setup.backend;
    }
    runs.push_back(PrepareDecode(state, format, batch, std::move(backend)));
    if (runs.back() == nullptr) return;
  }
  for (auto _ : state) {
    for (std::unique_ptr<DecodeRun>& run : runs) {
      for (int i = 0; i < g_turn_steps; ++i) TimeStep(*run, i >= g_turn_warmup);
    }
  }
  const double read_gbs = ReadGBsAfterSteps();
  state.counters["read_GB_per_s"] = read_gbs;
  state.counters["turn_steps"] = g_turn_steps;
  state.counters["turn_warmup"] = g_turn_warmup;
  state.counters["timed_steps"] = static_cast<double>(runs[0]->steps);  // of each format
  const double first_s = runs[0]->seconds / static_cast<double>(runs[0]->steps);
  std::string label;
  for (const std::unique_ptr<DecodeRun>& run : runs) {
    const double step_s = run->seconds / static_cast<double>(run->steps);
    state.counters[run->format.name + "_ms"] = step_s * 1e3;
    state.counters[run->format.name + "_of_read"] = run->bytes / step_s / 1e9 / read_gbs;
    if (run != runs[0]) state.counters[run->format.name + "_speedup"] = first_s / step_s;
    absl::StrAppend(&label, label.empty() ? "" : "; ", RunLabel(*run));
  }
  state.SetLabel(label);
}

}  // namespace
}  // namespace tandem

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  using tandem::WeightFormat;
  std::vector<WeightFormat> formats = {{"float32", tandem::DType::kF32, ""},
                                       {"bfloat16", tandem::DType::kBF16, ""},
                                       {"int8", std::nullopt, "int8"},
                                       {"int4", std::nullopt, "awq"}};
  std::vector<int64_t> batches = {1, 4, 16};
  std::vector<int64_t> prefills;  // --prefill: prompt lengths to time a prefill of
  bool paired = false;            // --paired[=N]: the formats' steps in turn, in one benchmark
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--preset=", 0) == 0) {
      tandem::g_preset = a.substr(9);
    } else if (a.rfind("--context=", 0) == 0) {
      tandem::g_context = std::atoi(a.c_str() + 10);
    } else if (a.rfind("--dtypes=", 0) == 0) {
      formats.clear();
      for (absl::string_view entry : absl::StrSplit(a.substr(9), ',')) {
        const std::vector<std::string> parts = absl::StrSplit(entry, '@');
        const absl::string_view name = parts[0];
        tandem::kernels::CpuIsa isa = tandem::kernels::CpuIsa::kAuto;
        if (parts.size() == 2) {
          const auto named = tandem::kernels::CpuIsaFromName(parts[1]);
          if (named.has_value()) isa = *named;
          if (!named.has_value()) {
            std::fprintf(stderr, "tandem_bench_decode: --dtypes: not TYPE@ISA: %s\n",
                         std::string(entry).c_str());
            return 2;
          }
        }
        if (name == "int8" || name == "int4") {
          formats.push_back({std::string(entry), std::nullopt, name == "int8" ? "int8" : "awq", isa});
          continue;
        }
        const std::optional<tandem::DType> d = tandem::ParseDTypeFlag(std::string(name));
        if (!d.has_value() || tandem::DTypeSize(*d) == 1) {
          std::fprintf(stderr, "tandem_bench_decode: --dtypes: not a weight type: %s\n",
                       std::string(name).c_str());
          return 2;
        }
        formats.push_back({std::string(entry), *d, "", isa});
      }
    } else if (a.rfind("--bandwidth-mib=", 0) == 0) {
      tandem::g_bandwidth_bytes = static_cast<size_t>(std::atol(a.c_str() + 16)) << 20;
    } else if (a.rfind("--prefill=", 0) == 0) {
      for (absl::string_view t : absl::StrSplit(a.substr(10), ',')) {
        prefills.push_back(std::atoi(std::string(t).c_str()));
      }
    } else if (a.rfind("--num-layers=", 0) == 0) {
      tandem::g_num_layers = std::atoi(a.c_str() + 13);
    } else if (a.rfind("--sampling=", 0) == 0) {
      tandem::g_sampling = a.substr(11);
      if (tandem::g_sampling != "auto" && tandem::g_sampling != "host" &&
          tandem::g_sampling != "backend") {
        std::fprintf(stderr, "tandem_bench_decode: --sampling must be auto, host or backend\n");
        return 2;
      }
    } else if (a == "--paired") {
      paired = true;
    } else if (a.rfind("--paired=", 0) == 0) {
      paired = true;
      tandem::g_turn_steps = std::atoi(a.c_str() + 9);
      if (tandem::g_turn_steps < 1 || tandem::g_turn_steps > 1000) {
        std::fprintf(stderr, "tandem_bench_decode: --paired=N takes 1 to 1000 steps per turn\n");
        return 2;
      }
    } else if (a.rfind("--turn-warmup=", 0) == 0) {
      if (!absl::SimpleAtoi(a.substr(14), &tandem::g_turn_warmup) || tandem::g_turn_warmup < 0 ||
          tandem::g_turn_warmup > 999) {
        std::fprintf(stderr, "tandem_bench_decode: --turn-warmup=K takes 0 to 999 steps\n");
        return 2;
      }
    } else if (a == "--device=cuda") {
      tandem::g_cuda = true;
    } else if (a == "--device=cpu") {
      tandem::g_cuda = false;
    } else if (a.rfind("--graphs=", 0) == 0) {
      tandem::g_graphs = a.substr(9);
      if (tandem::g_graphs != "auto" && tandem::g_graphs != "on" && tandem::g_graphs != "off") {
        std::fprintf(stderr, "tandem_bench_decode: --graphs must be auto, on or off\n");
        return 2;
      }
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
  if (tandem::g_turn_warmup > 0 && (!paired || tandem::g_turn_warmup >= tandem::g_turn_steps)) {
    std::fprintf(stderr,
                 "tandem_bench_decode: --turn-warmup=K needs --paired=N with N greater than K\n");
    return 2;
  }
  if (tandem::g_cuda) {
#if TANDEM_BENCH_CUDA
    tandem::g_copy_gbs = tandem::bench::MeasureCudaCopyGBs();
#endif
    if (tandem::g_copy_gbs <= 0) {
      std::fprintf(stderr, "tandem_bench_decode: --device=cuda: no usable CUDA device\n");
      return 1;
    }
    tandem::g_read_gbs = tandem::g_copy_gbs;
    std::printf("device copy bandwidth (cudaMemcpy 1 GiB, read + write, same run): %.1f GB/s\n",
                tandem::g_copy_gbs);
  } else {
    tandem::g_read_gbs = tandem::bench::MeasureReadBandwidthGBs(2, tandem::g_bandwidth_bytes);
    tandem::g_copy_gbs = tandem::bench::MeasureCopyBandwidthGBs(2, tandem::g_bandwidth_bytes);
  }
  if (!tandem::g_cuda) std::printf("read bandwidth (2 threads, read-only sum of %zu MiB, same run): %.2f GB/s\n",
              tandem::g_bandwidth_bytes >> 20, tandem::g_read_gbs);
  if (!tandem::g_cuda) {
    std::printf("copy bandwidth (2 threads, %zu MiB, same run): %.2f GB/s\n",
                tandem::g_bandwidth_bytes >> 20, tandem::g_copy_gbs);
  }
  if (paired) {
    std::vector<std::string> names;
    for (const WeightFormat& format : formats) names.push_back(format.name);
    auto* b = benchmark::RegisterBenchmark(
        absl::StrCat("BM_DecodeStepPaired/", absl::StrJoin(names, ",")).c_str(),
        [formats](benchmark::State& state) { tandem::BM_DecodeStepPaired(state, formats); });
    for (int64_t batch : batches) b->Arg(batch);
    b->Unit(benchmark::kMillisecond)->UseRealTime();
  }
  for (const WeightFormat& format : formats) {
    if (!paired) {
      auto* b = benchmark::RegisterBenchmark(
          absl::StrCat("BM_DecodeStep/", format.name).c_str(),
          [format](benchmark::State& state) { tandem::BM_DecodeStep(state, format); });
      for (int64_t batch : batches) b->Arg(batch);
      b->Unit(benchmark::kMillisecond)->UseRealTime();
    }
    if (prefills.empty()) continue;
    auto* p = benchmark::RegisterBenchmark(
        absl::StrCat("BM_Prefill/", format.name).c_str(),
        [format](benchmark::State& state) { tandem::BM_Prefill(state, format); });
    for (int64_t tokens : prefills) p->Arg(tokens);
    p->Unit(benchmark::kMillisecond)->UseRealTime();
  }
  benchmark::RunSpecifiedBenchmarks();
  return 0;
}
