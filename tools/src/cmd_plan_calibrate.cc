// `tandem plan calibrate`: times real engine steps (or fits a served step trace) and writes a
// calibration file for the planner.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cmd_plan.h"
#include "tandem/base/status_macros.h"
#include "tandem/engine/llm_engine.h"
#include "tandem/engine/model_runner.h"
#include "tandem/text/model_config.h"
#include "tandem/tools/args.h"
#include "tandem/tools/planner.h"

namespace tandem::tools::plan_internal {
namespace {

// The fitted step-time model, one line per phase.
void PrintFit(const LatencyModel& fit) {
  auto line = [](const char* phase, const engine::StepCoefficients& c) {
    std::printf("%s t = %.4g + %.4g*tokens + %.4g*seqs + %.4g*context s\n", phase, c.intercept,
                c.per_token, c.per_seq, c.per_context_token);
  };
  line("prefill:", fit.prefill);
  line("decode: ", fit.decode);
}

using json = nlohmann::json;

struct Timer {
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  double Seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
};

double Median(std::vector<double> v) { return v.empty() ? 0 : Percentile(std::move(v), 50); }

// --dtype / --kv-cache-dtype as the serving commands take them: nullopt for "auto".
absl::StatusOr<std::optional<DType>> DTypeFlagOf(const Args& args, const char* name, bool kv) {
  const std::string value = args.GetOr(name, "auto");
  if (value == "auto") return std::nullopt;
  const std::optional<DType> dtype = ParseDTypeFlag(value);
  if (!dtype.has_value() || (!kv && DTypeSize(*dtype) == 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan calibrate: --", name, " must be auto|",
                     kv ? "bfloat16|float16|float32|fp8_e4m3|fp8_e5m2" : "bfloat16|float16|float32",
                     ", got '", value, "'"));
  }
  return dtype;
}

// `plan calibrate --trace`: the steps a serving process measured (`--step-trace`), and with
// --bench the client's first-token times of the same run, whose median beyond the engine's own
// is the serving path's per-request cost.
absl::Status CalibrateFromTrace(const Args& args) {
  const std::string path = *args.Get("trace");
  std::ifstream in(path);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat("plan calibrate: --trace: cannot read ", path));
  }
  Calibration cal;
  cal.device = absl::StrCat("steps traced in a serving process (", path, ")");
  std::vector<double> gaps, engine_ttft;
  std::map<std::string, double> engine_ttft_by_id;  // a retry ("ID~N") replaces the earlier
  std::string line;
  int line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.empty()) continue;
    const json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    auto bad = [&](const std::string& why) {
      return absl::InvalidArgumentError(
          absl::StrCat("plan calibrate: ", path, ":", line_no, ": ", why));
    };
    if (!j.is_object()) return bad("not a JSON object (is this a --step-trace file?)");
    try {
      if (j.contains("step_s")) {
        StepSample sample;
        sample.seconds = j.at("step_s").get<double>();
        sample.tokens = j.at("tokens").get<int64_t>();
        sample.prefill_tokens = j.at("prefill_tokens").get<int64_t>();
        sample.seqs = j.at("seqs").get<int64_t>();
        sample.context = j.at("context").get<int64_t>();
        if (!(sample.seconds >= 0) || sample.tokens < 1 || sample.seqs < 1 ||
            sample.prefill_tokens < 0 || sample.context < 0) {
          return bad("a step with a negative or empty field");
        }
        cal.samples.push_back(sample);
        const double gap = j.value("gap_s", -1.0);
        if (gap >= 0) gaps.push_back(gap);
      } else if (j.contains("first_token_s")) {
        const double seconds = j.at("first_token_s").get<double>();
        engine_ttft.push_back(seconds);
        const std::string id = j.value("request_id", "");
        if (!id.empty()) engine_ttft_by_id[id.substr(0, id.find('~'))] = seconds;
      } else {
        return bad("neither a step nor a first-token line");
      }
    } catch (const json::exception& e) {
      return bad(e.what());
    }
  }
  if (cal.samples.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("plan calibrate: ", path, " holds no step"));
  }
  cal.step_gap = Median(gaps);
  if (args.Has("bench")) {
    std::ifstream bench_in(*args.Get("bench"));
    if (!bench_in) {
      return absl::InvalidArgumentError(
          absl::StrCat("plan calibrate: cannot read ", *args.Get("bench")));
    }
    const json report = json::parse(bench_in, nullptr, /*allow_exceptions=*/false);
    // One run, or every run of a sweep.
    std::vector<const json*> runs = {&report};
    if (report.is_object() && report.contains("runs") && report["runs"].is_array()) {
      runs.clear();
      for (const json& run : report["runs"]) runs.push_back(&run);
    }
    std::vector<double> client_ttft, paired;
    for (const json* run : runs) {
      if (!run->is_object() || !run->contains("requests") || !(*run)["requests"].is_array()) {
        continue;
      }
      for (const json& r : (*run)["requests"]) {
        if (r.is_object() && r.value("success", false) && r.contains("ttft_ms") &&
            r["ttft_ms"].is_number()) {
          const double seconds = r["ttft_ms"].get<double>() * 1e-3;
          client_ttft.push_back(seconds);
          if (r.contains("id") && r["id"].is_string()) {
            auto it = engine_ttft_by_id.find(r["id"].get<std::string>());
            if (it != engine_ttft_by_id.end()) paired.push_back(std::max(0.0, seconds - it->second));
          }
        }
      }
    }
    if (client_ttft.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "plan calibrate: --bench ", *args.Get("bench"),
          ": no successful request with ttft_ms (a `tandem bench --json` report?)"));
    }
    if (engine_ttft.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "plan calibrate: --bench needs first-token lines in ", path,
          " (trace the engine that runs the prefill: colocated or prefill)"));
    }
    if (!paired.empty()) {
      // Request by request: the serving path's spread (a slow accept, a late wake-up) counts.
      cal.request_overhead = Median(paired);
      cal.request_overhead_samples = paired;
    } else {
      // Reports without ids (or another run's): the difference of the medians.
      cal.request_overhead = std::max(0.0, Median(client_ttft) - Median(engine_ttft));
    }
  }
  if (args.Has("model")) {
    TANDEM_ASSIGN_OR_RETURN(text::ModelConfig config,
                            text::ModelConfig::FromFile(*args.Get("model") + "/config.json"));
    cal.model = *args.Get("model");
    // Per token, every layer, K and V: what the traced engine's cache holds, of the element type
    // it ran with (--kv-cache-dtype; auto: the weight type, as the serving commands resolve it).
    TANDEM_ASSIGN_OR_RETURN(std::optional<DType> dtype, DTypeFlagOf(args, "dtype", false));
    TANDEM_ASSIGN_OR_RETURN(std::optional<DType> kv_dtype,
                            DTypeFlagOf(args, "kv-cache-dtype", true));
    TANDEM_ASSIGN_OR_RETURN(engine::RunnerDTypes dtypes,
                            engine::ResolveRunnerDTypes(config, dtype, kv_dtype));
    cal.kv_bytes_per_token =
        static_cast<double>(engine::ModelRunner::KvBytesPerBlock(config, 1, dtypes.kv_cache));
  }
  TANDEM_ASSIGN_OR_RETURN(int64_t seqs, PositiveInt(args, "max-num-seqs", 64, 65536));
  TANDEM_ASSIGN_OR_RETURN(int64_t batched,
                          PositiveInt(args, "max-num-batched-tokens", 512, 1 << 20));
  cal.max_num_seqs = seqs;
  cal.max_num_batched_tokens = batched;
  TANDEM_RETURN_IF_ERROR(WriteJson(*args.Get("out"), cal.ToJson()));
  TANDEM_ASSIGN_OR_RETURN(LatencyModel fit, FitLatencyModel(cal.samples, 0.2));
  std::printf("tandem plan calibrate: %zu traced steps, written to %s\n", cal.samples.size(),
              args.Get("out")->c_str());
  PrintFit(fit);
  std::printf("gap between steps %.3f ms", cal.step_gap * 1e3);
  if (cal.request_overhead >= 0) {
    std::printf(", per-request overhead %.3f ms", cal.request_overhead * 1e3);
    if (!cal.request_overhead_samples.empty()) {
      std::printf(" (median of %zu paired requests; p90 %.3f ms)",
                  cal.request_overhead_samples.size(),
                  Percentile(cal.request_overhead_samples, 90) * 1e3);
    }
  }
  std::printf("\n");
  return absl::OkStatus();
}

}  // namespace

absl::Status Calibrate(int argc, char** argv) {
  Args args("plan calibrate");
  args.Declare("model", "DIR", "checkpoint to time (with --trace: only read for its KV size)");
  args.Declare("out", "FILE", "calibration JSON to write");
  args.Declare("trace", "FILE",
               "instead of timing an engine here, fit the steps a server measured while serving "
               "(`tandem serve|prefill|decode --step-trace FILE`)");
  args.Declare("bench", "FILE",
               "with --trace: the `tandem bench --json` report of the traced run; the median "
               "first-token time beyond the engine's becomes the per-request overhead");
  args.Declare("dtype", "TYPE",
               "weight type, as the serving commands take it (default auto: the checkpoint's)");
  args.Declare("kv-cache-dtype", "TYPE",
               "KV cache type, as the serving commands take it (default auto: the weight type)");
  args.Declare("threads", "N", "engine CPU threads (default: all cores)");
  args.Declare("max-num-seqs", "N", "engine running batch (default 64)");
  args.Declare("max-num-batched-tokens", "N", "tokens per step, prefill chunk (default 512)");
  args.Declare("reps", "N", "repetitions of every measured batch (default 3)");
  args.Declare("max-context", "N", "longest prompt measured (default 512)");
  TANDEM_RETURN_IF_ERROR(args.Parse(argc, argv));
  if (args.HandleHelp()) return absl::OkStatus();
  if (args.Has("bench") && !args.Has("trace")) {
    return absl::InvalidArgumentError("plan calibrate: --bench goes with --trace");
  }
  if (args.Has("trace")) {
    if (!args.Has("out")) return absl::InvalidArgumentError("plan calibrate: --out is required");
    for (const char* flag : {"threads", "reps", "max-context"}) {
      if (args.Has(flag)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "plan calibrate: --", flag, " times an engine here; it does not go with --trace"));
      }
    }
    return CalibrateFromTrace(args);
  }
  if (!args.Has("model") || !args.Has("out")) {
    return absl::InvalidArgumentError("plan calibrate: --model and --out are required");
  }
  engine::EngineOptions options;
  options.model_dir = *args.Get("model");
  TANDEM_ASSIGN_OR_RETURN(int64_t threads, args.Int("threads", 0));
  if (threads < 0 || threads > 1024) {
    return absl::InvalidArgumentError("plan calibrate: --threads must be in [0, 1024]");
  }
  options.num_threads = static_cast<int>(threads);
  TANDEM_ASSIGN_OR_RETURN(int64_t seqs, PositiveInt(args, "max-num-seqs", 64, 65536));
  TANDEM_ASSIGN_OR_RETURN(int64_t batched,
                          PositiveInt(args, "max-num-batched-tokens", 512, 1 << 20));
  TANDEM_ASSIGN_OR_RETURN(int64_t reps, PositiveInt(args, "reps", 3, 1000));
  TANDEM_ASSIGN_OR_RETURN(int64_t max_context, PositiveInt(args, "max-context", 512, 1 << 20));
  options.max_num_seqs = static_cast<int>(seqs);
  options.max_num_batched_tokens = static_cast<int>(batched);
  TANDEM_ASSIGN_OR_RETURN(options.dtype, DTypeFlagOf(args, "dtype", false));
  TANDEM_ASSIGN_OR_RETURN(options.kv_cache_dtype, DTypeFlagOf(args, "kv-cache-dtype", true));
  absl::StatusOr<std::unique_ptr<engine::LlmEngine>> created = engine::LlmEngine::Create(options);
  if (!created.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan calibrate: --model: ", created.status().message()));
  }
  engine::LlmEngine& eng = **created;
  const int vocab = eng.config().vocab_size;
  const engine::KvCacheLayout& layout = eng.cache_layout();

  Calibration cal;
  cal.model = options.model_dir;
  cal.device = absl::StrCat("cpu, ", threads == 0 ? std::thread::hardware_concurrency() : threads,
                            " threads");
  cal.max_num_batched_tokens = batched;
  cal.max_num_seqs = seqs;
  cal.kv_bytes_per_token = static_cast<double>(layout.num_layers) * 2 * layout.row_bytes();

  int64_t next_id = 0;
  auto add = [&](int64_t prompt_len, int max_tokens) -> absl::Status {
    engine::GenerateRequest r;
    r.request_id = absl::StrCat("cal-", next_id++);
    for (int64_t i = 0; i < prompt_len; ++i) {
      r.prompt_tokens.push_back(static_cast<int32_t>(1 + (next_id * 131 + i * 17) % (vocab - 1)));
    }
    r.params.max_tokens = max_tokens;
    r.params.ignore_eos = true;
    r.params.temperature = 0;
    return eng.AddRequest(std::move(r));
  };
  auto timed_step = [&](double* seconds) -> absl::StatusOr<std::vector<engine::RequestOutput>> {
    Timer t;
    absl::StatusOr<std::vector<engine::RequestOutput>> out = eng.Step();
    *seconds = t.Seconds();
    return out;
  };
  auto drain = [&]() -> absl::Status {
    while (eng.has_unfinished()) TANDEM_RETURN_IF_ERROR(eng.Step().status());
    return absl::OkStatus();
  };

  // Warm-up: threads, caches, page faults of the weights.
  TANDEM_RETURN_IF_ERROR(add(std::min<int64_t>(64, batched), 4));
  TANDEM_RETURN_IF_ERROR(drain());

  const std::vector<int64_t> lengths = {16, 32, 64, 128, 256, 512, 1024, 2048};
  for (int64_t rep = 0; rep < reps; ++rep) {
    // Prefill steps: B prompts of L tokens in one step (B * L within the budget).
    for (int64_t b : {1, 2, 4}) {
      for (int64_t l : lengths) {
        if (l > max_context || b * l > batched || b > seqs) continue;
        for (int64_t i = 0; i < b; ++i) TANDEM_RETURN_IF_ERROR(add(l, 1));
        double s = 0;
        TANDEM_RETURN_IF_ERROR(timed_step(&s).status());
        cal.samples.push_back({b * l, b * l, b, b * l, s});
        TANDEM_RETURN_IF_ERROR(drain());
      }
    }
    // Decode steps: B sequences of context L, 8 tokens each after the first.
    for (int64_t b : {1, 2, 4, 8, 16, 32, 64}) {
      for (int64_t l : {32, 128, 512}) {
        if (l > max_context || b > seqs || b * l > 8192) continue;
        const int steps = 8;
        for (int64_t i = 0; i < b; ++i) TANDEM_RETURN_IF_ERROR(add(l, steps + 1));
        // Prefill (maybe several chunks) until every sequence has its first token.
        int64_t first_tokens = 0;
        while (first_tokens < b) {
          TANDEM_ASSIGN_OR_RETURN(auto outs, eng.Step());
          for (const auto& o : outs) {
            if (o.num_generation_tokens == 1) ++first_tokens;
          }
        }
        for (int k = 1; k <= steps; ++k) {
          double s = 0;
          TANDEM_ASSIGN_OR_RETURN(auto outs, timed_step(&s));
          if (static_cast<int64_t>(outs.size()) != b) break;
          cal.samples.push_back({b, 0, b, b * (l + k), s});
        }
        TANDEM_RETURN_IF_ERROR(drain());
      }
    }
    // Mixed steps: B decodes of context 64 plus one new prompt of P tokens, as chunked
    // prefill schedules them (running first, then the waiting prompt).
    for (int64_t b : {1, 4, 16}) {
      for (int64_t p : {32, 128, 256}) {
        if (b + 1 > seqs || b + p > batched || p > max_context) continue;
        for (int64_t i = 0; i < b; ++i) TANDEM_RETURN_IF_ERROR(add(64, 8));
        int64_t first_tokens = 0;
        while (first_tokens < b) {
          TANDEM_ASSIGN_OR_RETURN(auto outs, eng.Step());
          for (const auto& o : outs) {
            if (o.num_generation_tokens == 1) ++first_tokens;
          }
        }
        TANDEM_RETURN_IF_ERROR(add(p, 2));
        double s = 0;
        TANDEM_ASSIGN_OR_RETURN(auto outs, timed_step(&s));
        if (static_cast<int64_t>(outs.size()) == b + 1) {
          // Each decode attends to 64 prompt tokens + 1; the prompt to its own p tokens.
          cal.samples.push_back({b + p, p, b + 1, b * 65 + p, s});
        }
        TANDEM_RETURN_IF_ERROR(drain());
      }
    }
  }
  TANDEM_RETURN_IF_ERROR(WriteJson(*args.Get("out"), cal.ToJson()));
  TANDEM_ASSIGN_OR_RETURN(LatencyModel fit, FitLatencyModel(cal.samples, 0.2));
  std::printf("tandem plan calibrate: %zu steps timed on %s, written to %s\n", cal.samples.size(),
              cal.device.c_str(), args.Get("out")->c_str());
  PrintFit(fit);
  return absl::OkStatus();
}

}  // namespace tandem::tools::plan_internal
