// `tandem plan`: the capacity planner (see planner.h and docs/tools.md, "Planner").
//   tandem plan [flags]            placement search: best goodput per GPU, disaggregated and
//                                  colocated side by side
//   tandem plan simulate [flags]   one simulation of one configuration at one rate (or a trace)
//   tandem plan calibrate [flags]  times real engine steps and writes a calibration file
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "commands.h"
#include "tandem/base/status_macros.h"
#include "tandem/engine/llm_engine.h"
#include "tandem/engine/model_runner.h"
#include "tandem/text/model_config.h"
#include "tandem/tools/args.h"
#include "tandem/tools/planner.h"

namespace tandem::tools {
namespace {

using json = nlohmann::json;

absl::StatusOr<int64_t> PositiveInt(const Args& args, const std::string& name, int64_t fallback,
                                    int64_t hi = int64_t{1} << 40) {
  TANDEM_ASSIGN_OR_RETURN(int64_t v, args.Int(name, fallback));
  if (v < 1 || v > hi) {
    return absl::InvalidArgumentError(
        absl::StrCat(args.command(), ": --", name, " must be in [1, ", hi, "], got ", v));
  }
  return v;
}

absl::StatusOr<double> PositiveDouble(const Args& args, const std::string& name, double fallback) {
  TANDEM_ASSIGN_OR_RETURN(double v, args.Double(name, fallback));
  if (!(v > 0) || std::isinf(v)) {
    return absl::InvalidArgumentError(
        absl::StrCat(args.command(), ": --", name, " must be a finite number > 0"));
  }
  return v;
}

absl::Status WriteJson(const std::string& path, const json& j) {
  std::ofstream out(path);
  if (!out) return absl::InvalidArgumentError(absl::StrCat("cannot write ", path));
  out << j.dump(2) << "\n";
  return out ? absl::OkStatus() : absl::InternalError(absl::StrCat("cannot write ", path));
}

// --- shared flags of `plan` and `plan simulate` ---

void DeclareModelFlags(Args& args) {
  args.Declare("model", "DIR", "checkpoint whose config.json gives the shape");
  args.Declare("preset", "NAME", "small | llama3-8b | textbook | llama-3-8b (default small)");
  args.Declare("hardware", "NAME", "A100-80G | H100 | H200 (default A100-80G)");
  args.Declare("calibration", "FILE",
               "step times measured by `tandem plan calibrate` (default: the roofline)");
  args.Declare("fit-trim", "FRACTION",
               "share of the slowest calibration steps (relative to the fit) left out of it, "
               "for steps slowed by other processes (default 0.2)");
  args.Declare("kv-link-gbps", "GB/s", "prefill-to-decode KV bandwidth (default: the hardware's)");
  args.Declare("kv-cache-bytes", "N",
               "KV cache per instance with --calibration (default: unbounded)");
  args.Declare("overhead-ms", "MS",
               "added to every request's first token and end: HTTP, tokenizing (default: the "
               "calibration's when it measured one, else 0)");
  args.DeclareSwitch("no-step-noise",
                     "time every simulated step as the fit predicts, without the calibration "
                     "steps' spread around it");
  args.Declare("max-num-seqs", "N", "engine running batch (default: the calibration's, else 64)");
  args.Declare("max-num-batched-tokens", "N",
               "engine tokens per step and prefill chunk (default: the calibration's, else 512)");
  args.Declare("ttft-slo", "SECONDS", "time-to-first-token objective");
  args.Declare("tpot-slo", "SECONDS", "time-per-output-token objective");
  args.Declare("attainment", "FRACTION", "share of requests that must meet both (default 0.9)");
  args.Declare("input-len", "I", "prompt tokens (mean; default 256)");
  args.Declare("input-len-dist", "KIND", "fixed | uniform | normal | lognormal (default fixed)");
  args.Declare("input-len-range", "R", "uniform: lengths in [I-R, I+R]");
  args.Declare("input-len-std", "S", "normal, lognormal: standard deviation");
  args.Declare("output-len", "O", "output tokens (mean; default 64)");
  args.Declare("output-len-dist", "KIND", "fixed | uniform | normal | lognormal (default fixed)");
  args.Declare("output-len-range", "R", "uniform: lengths in [O-R, O+R]");
  args.Declare("output-len-std", "S", "normal, lognormal: standard deviation");
  args.Declare("burstiness", "B", "gamma shape of the arrival gaps; 1 = Poisson (default 1)");
  args.Declare("num-requests", "N", "requests per simulation (default 400)");
  args.Declare("seed", "N", "seed of the arrivals and lengths (default 0)");
  args.Declare("json", "FILE", "also write the result as JSON");
}

absl::StatusOr<LengthDist> LengthFlags(const Args& args, const std::string& name,
                                       double fallback) {
  const std::string flag = absl::StrCat("--", name, "-len");
  LengthDist dist;
  dist.kind = args.GetOr(name + "-len-dist", "fixed");
  TANDEM_ASSIGN_OR_RETURN(dist.mean, args.Double(name + "-len", fallback));
  TANDEM_ASSIGN_OR_RETURN(dist.range, args.Int(name + "-len-range", 0));
  TANDEM_ASSIGN_OR_RETURN(dist.std, args.Double(name + "-len-std", 0));
  if (args.Has(name + "-len-range") && dist.kind != "uniform") {
    return absl::InvalidArgumentError(
        absl::StrCat(args.command(), ": ", flag, "-range goes with ", flag, "-dist uniform"));
  }
  if (args.Has(name + "-len-std") && dist.kind != "normal" && dist.kind != "lognormal") {
    return absl::InvalidArgumentError(absl::StrCat(args.command(), ": ", flag, "-std goes with ",
                                                   flag, "-dist normal or lognormal"));
  }
  if (dist.kind == "fixed" && (dist.mean < 1 || dist.mean != std::floor(dist.mean))) {
    return absl::InvalidArgumentError(
        absl::StrCat(args.command(), ": ", flag, " must be a positive integer"));
  }
  absl::Status valid = ValidateLengthDist(dist, flag);
  if (!valid.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(args.command(), ": ", valid.message()));
  }
  return dist;
}

// What `plan` and `plan simulate` share: the shape, the hardware, how to build an instance on a
// TP degree, the workload and the SLOs.
struct Setup {
  RooflineShape shape;
  ClusterHardware hardware;
  InstanceFactory factory;
  WorkloadSpec workload;
  Slo slo;
  double attainment = 0.9;
  std::string source;  // "roofline" or "calibration FILE"
};

absl::StatusOr<Setup> SetupFromFlags(const Args& args, bool slo_required) {
  Setup s;
  const std::string cmd = args.command();
  if (args.Has("model") && args.Has("preset")) {
    return absl::InvalidArgumentError(absl::StrCat(cmd, ": give --model or --preset, not both"));
  }
  if (args.Has("model")) {
    const std::filesystem::path dir = *args.Get("model");
    absl::StatusOr<text::ModelConfig> config =
        text::ModelConfig::FromFile((dir / "config.json").string());
    if (!config.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(cmd, ": --model: ", config.status().message()));
    }
    s.shape = ShapeFromConfig(*config);
  } else {
    absl::StatusOr<RooflineShape> shape = PlannerShape(args.GetOr("preset", "small"));
    if (!shape.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(cmd, ": --preset: ", shape.status().message()));
    }
    s.shape = *shape;
  }
  absl::StatusOr<ClusterHardware> hw = FindClusterHardware(args.GetOr("hardware", "A100-80G"));
  if (!hw.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(cmd, ": --hardware: ", hw.status().message()));
  }
  s.hardware = *hw;
  if (args.Has("kv-link-gbps")) {
    TANDEM_ASSIGN_OR_RETURN(double gbps, PositiveDouble(args, "kv-link-gbps", 1));
    s.hardware.kv_link_bytes = gbps * kBytesPerGB;
  }
  TANDEM_ASSIGN_OR_RETURN(double overhead_ms, args.Double("overhead-ms", 0));
  if (!(overhead_ms >= 0) || std::isinf(overhead_ms)) {
    return absl::InvalidArgumentError(absl::StrCat(cmd, ": --overhead-ms must be >= 0"));
  }
  if (args.Switch("no-step-noise") && !args.Has("calibration")) {
    return absl::InvalidArgumentError(
        absl::StrCat(cmd, ": --no-step-noise goes with --calibration (the roofline has none)"));
  }

  std::optional<Calibration> calibration;
  if (args.Has("calibration")) {
    absl::StatusOr<Calibration> c = ReadCalibration(*args.Get("calibration"));
    if (!c.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(cmd, ": --calibration: ", c.status().message()));
    }
    calibration = *c;
    s.source = absl::StrCat("calibration ", *args.Get("calibration"));
  } else {
    if (args.Has("kv-cache-bytes")) {
      return absl::InvalidArgumentError(
          absl::StrCat(cmd, ": --kv-cache-bytes goes with --calibration (the roofline model "
                            "derives KV capacity from the GPU memory)"));
    }
    s.source = absl::StrCat("roofline ", s.hardware.gpu.name);
  }
  const int64_t default_seqs = calibration && calibration->max_num_seqs > 0
                                   ? calibration->max_num_seqs
                                   : 64;
  const int64_t default_batched =
      calibration && calibration->max_num_batched_tokens > 0
          ? calibration->max_num_batched_tokens
          : 512;
  TANDEM_ASSIGN_OR_RETURN(int64_t max_seqs, PositiveInt(args, "max-num-seqs", default_seqs, 65536));
  TANDEM_ASSIGN_OR_RETURN(int64_t max_batched,
                          PositiveInt(args, "max-num-batched-tokens", default_batched, 1 << 20));
  TANDEM_ASSIGN_OR_RETURN(int64_t kv_cache_bytes,
                          args.Int("kv-cache-bytes", 0));
  if (kv_cache_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(cmd, ": --kv-cache-bytes must be >= 0"));
  }

  s.factory.kv_link_bytes = s.hardware.kv_link_bytes;
  s.factory.request_overhead = overhead_ms * 1e-3;
  const RooflineShape shape = s.shape;
  const ClusterHardware hardware = s.hardware;
  if (calibration) {
    TANDEM_ASSIGN_OR_RETURN(double trim, args.Double("fit-trim", 0.2));
    if (!(trim >= 0) || trim >= 1) {
      return absl::InvalidArgumentError(absl::StrCat(cmd, ": --fit-trim must be in [0, 1)"));
    }
    TANDEM_ASSIGN_OR_RETURN(LatencyModel measured, FitLatencyModel(calibration->samples, trim));
    measured.step_gap = calibration->step_gap;
    if (!args.Switch("no-step-noise")) SetStepNoise(measured, calibration->samples);
    if (!args.Has("overhead-ms") && calibration->request_overhead > 0) {
      s.factory.request_overhead = calibration->request_overhead;
      s.factory.request_overhead_samples = calibration->request_overhead_samples;
    }
    const double kv_per_token = calibration->kv_bytes_per_token > 0
                                    ? calibration->kv_bytes_per_token
                                    : KvBytesPerToken(shape);
    s.factory.kv_bytes_per_token = kv_per_token;
    s.factory.make = [=](int tp) -> absl::StatusOr<InstanceSpec> {
      InstanceSpec spec;
      spec.tp = tp;
      spec.max_num_seqs = static_cast<int>(max_seqs);
      spec.max_num_batched_tokens = static_cast<int>(max_batched);
      spec.model = ScaleModelToTp(measured, shape, hardware, tp);
      if (kv_cache_bytes > 0) {
        spec.kv_capacity_tokens = static_cast<int64_t>(kv_cache_bytes / kv_per_token);
      }
      return spec;
    };
  } else {
    s.factory.kv_bytes_per_token = KvBytesPerToken(shape);
    s.factory.make = [=](int tp) -> absl::StatusOr<InstanceSpec> {
      // 90% of the memory of the tp GPUs, less the weights, holds KV; KV heads are replicated
      // when there are fewer of them than GPUs.
      const double usable = 0.9 * hardware.memory_bytes * tp - WeightBytes(shape);
      const double kv_per_token =
          KvBytesPerToken(shape) *
          std::max(1.0, static_cast<double>(tp) / static_cast<double>(shape.kv_heads));
      if (usable < kv_per_token * 4096) {
        return absl::InvalidArgumentError(absl::StrCat("the weights leave no KV room on TP", tp));
      }
      InstanceSpec spec;
      spec.tp = tp;
      spec.max_num_seqs = static_cast<int>(max_seqs);
      spec.max_num_batched_tokens = static_cast<int>(max_batched);
      spec.kv_capacity_tokens = static_cast<int64_t>(usable / kv_per_token);
      TANDEM_ASSIGN_OR_RETURN(spec.model, RooflineLatencyModel(shape, hardware, tp));
      return spec;
    };
  }

  TANDEM_ASSIGN_OR_RETURN(s.workload.input, LengthFlags(args, "input", 256));
  TANDEM_ASSIGN_OR_RETURN(s.workload.output, LengthFlags(args, "output", 64));
  TANDEM_ASSIGN_OR_RETURN(s.workload.burstiness, PositiveDouble(args, "burstiness", 1));
  TANDEM_ASSIGN_OR_RETURN(s.workload.num_requests, PositiveInt(args, "num-requests", 400, 1000000));
  TANDEM_ASSIGN_OR_RETURN(int64_t seed, args.Int("seed", 0));
  s.workload.seed = static_cast<uint64_t>(seed);

  if (slo_required && (!args.Has("ttft-slo") || !args.Has("tpot-slo"))) {
    return absl::InvalidArgumentError(absl::StrCat(cmd, ": --ttft-slo and --tpot-slo are required"));
  }
  if (args.Has("ttft-slo") != args.Has("tpot-slo")) {
    return absl::InvalidArgumentError(absl::StrCat(cmd, ": --ttft-slo and --tpot-slo go together"));
  }
  if (args.Has("ttft-slo")) {
    TANDEM_ASSIGN_OR_RETURN(s.slo.ttft, PositiveDouble(args, "ttft-slo", 1));
    TANDEM_ASSIGN_OR_RETURN(s.slo.tpot, PositiveDouble(args, "tpot-slo", 1));
  }
  TANDEM_ASSIGN_OR_RETURN(s.attainment, args.Double("attainment", 0.9));
  if (!(s.attainment > 0) || s.attainment > 1) {
    return absl::InvalidArgumentError(absl::StrCat(cmd, ": --attainment must be in (0, 1]"));
  }
  return s;
}

std::string Ms(const MetricSummary& m) {
  return absl::StrFormat("%9.2f %9.2f %9.2f", m.p50 * 1e3, m.p90 * 1e3, m.p99 * 1e3);
}

// --- tandem plan ---

absl::Status Plan(int argc, char** argv) {
  Args args("plan");
  DeclareModelFlags(args);
  args.Declare("gpus", "N", "GPU budget (default 8)");
  args.Declare("tp", "LIST", "tensor-parallel degrees to try (default 1,2,4,8)");
  TANDEM_RETURN_IF_ERROR(args.Parse(argc, argv));
  if (args.HandleHelp()) {
    std::printf(
        "\nsubcommands: `tandem plan simulate --help` (one configuration), `tandem plan "
        "calibrate --help` (measure step times)\n");
    return absl::OkStatus();
  }
  TANDEM_ASSIGN_OR_RETURN(Setup setup, SetupFromFlags(args, /*slo_required=*/true));
  SearchOptions options;
  options.slo = setup.slo;
  options.attainment = setup.attainment;
  options.workload = setup.workload;
  TANDEM_ASSIGN_OR_RETURN(int64_t gpus, PositiveInt(args, "gpus", 8, 4096));
  options.gpus = static_cast<int>(gpus);
  if (args.Has("tp")) {
    options.tps.clear();
    for (absl::string_view part : absl::StrSplit(*args.Get("tp"), ',')) {
      int tp = 0;
      if (!absl::SimpleAtoi(part, &tp) || tp < 1 || tp > 64) {
        return absl::InvalidArgumentError(
            absl::StrCat("plan: --tp must be a comma-separated list of degrees in [1, 64], got ",
                         *args.Get("tp")));
      }
      options.tps.push_back(tp);
    }
  }
  TANDEM_ASSIGN_OR_RETURN(PlanResult plan, SearchPlacement(setup.factory, options));

  std::printf("tandem plan: %s, %d GPU budget, SLO TTFT %.3g s / TPOT %.3g s at %.0f%%\n",
              setup.source.c_str(), options.gpus, options.slo.ttft, options.slo.tpot,
              options.attainment * 100);
  std::printf("workload: input %s mean %g, output %s mean %g, %s arrivals, %lld requests\n\n",
              options.workload.input.kind.c_str(), options.workload.input.mean,
              options.workload.output.kind.c_str(), options.workload.output.mean,
              options.workload.burstiness == 1 ? "Poisson" : "gamma",
              static_cast<long long>(options.workload.num_requests));
  std::printf("%-38s %5s %10s %12s %29s %29s %7s\n", "", "GPUs", "rate req/s", "req/s/GPU",
              "TTFT ms p50 / p90 / p99", "TPOT ms p50 / p90 / p99", "attain");
  auto row = [](const char* label, const Placement& p) {
    if (p.max_rate <= 0) {
      std::printf("%-12s %-25s\n", label, "none meets the SLOs");
      return;
    }
    std::printf("%-12s %-25s %5d %10.3f %12.3f %29s %29s %7.3f\n", label,
                p.cluster.Describe().c_str(), p.cluster.Gpus(), p.max_rate, p.per_gpu_goodput,
                Ms(p.at_max_rate.ttft).c_str(), Ms(p.at_max_rate.tpot).c_str(),
                p.at_max_rate.attainment);
  };
  row("best disagg", plan.best_disaggregated);
  row("colocated", plan.best_colocated);
  if (plan.best_disaggregated.max_rate > 0 && plan.best_colocated.max_rate > 0) {
    std::printf("\ndisaggregated / colocated goodput per GPU: %.2fx\n",
                plan.best_disaggregated.per_gpu_goodput / plan.best_colocated.per_gpu_goodput);
  }
  std::printf("(%zu configurations evaluated)\n", plan.evaluated.size());

  if (args.Has("json")) {
    json evaluated = json::array();
    for (const Placement& p : plan.evaluated) evaluated.push_back(p.ToJson());
    json out = {{"source", setup.source},
                {"gpus", options.gpus},
                {"slo", {{"ttft_s", options.slo.ttft}, {"tpot_s", options.slo.tpot},
                         {"attainment", options.attainment}}},
                {"best_disaggregated", plan.best_disaggregated.max_rate > 0
                                           ? plan.best_disaggregated.ToJson()
                                           : json(nullptr)},
                {"best_colocated", plan.best_colocated.max_rate > 0
                                       ? plan.best_colocated.ToJson()
                                       : json(nullptr)},
                {"evaluated", std::move(evaluated)}};
    TANDEM_RETURN_IF_ERROR(WriteJson(*args.Get("json"), out));
  }
  return absl::OkStatus();
}

// --- tandem plan simulate ---

absl::Status Simulate(int argc, char** argv) {
  Args args("plan simulate");
  DeclareModelFlags(args);
  args.Declare("rate", "R", "arrival rate in requests/s");
  args.Declare("trace", "FILE",
               "replay the requests of a `tandem bench --json` report (send times, prompt and "
               "output tokens) instead of --rate and the length flags");
  args.Declare("config", "KIND", "colocated | disagg (default colocated)");
  args.Declare("replicas", "N",
               "simulate the same arrivals N times with different draws of the calibration's "
               "step spread and summarize them together: the expected percentiles rather than "
               "one draw's (default 1)");
  args.Declare("tp", "N", "colocated: tensor-parallel degree (default 1)");
  args.Declare("instances", "N", "colocated: instances (default 1)");
  args.Declare("prefill-tp", "N", "disagg: prefill tensor-parallel degree (default 1)");
  args.Declare("num-prefill", "N", "disagg: prefill instances (default 1)");
  args.Declare("decode-tp", "N", "disagg: decode tensor-parallel degree (default 1)");
  args.Declare("num-decode", "N", "disagg: decode instances (default 1)");
  TANDEM_RETURN_IF_ERROR(args.Parse(argc, argv));
  if (args.HandleHelp()) return absl::OkStatus();
  TANDEM_ASSIGN_OR_RETURN(Setup setup, SetupFromFlags(args, /*slo_required=*/false));
  const std::string kind = args.GetOr("config", "colocated");
  if (kind != "colocated" && kind != "disagg") {
    return absl::InvalidArgumentError(
        absl::StrCat("plan simulate: --config must be colocated or disagg, got ", kind));
  }
  if (args.Has("rate") == args.Has("trace")) {
    return absl::InvalidArgumentError("plan simulate: give exactly one of --rate and --trace");
  }
  for (const char* f : kind == "colocated"
                           ? std::vector<const char*>{"prefill-tp", "num-prefill", "decode-tp",
                                                      "num-decode"}
                           : std::vector<const char*>{"tp", "instances"}) {
    if (args.Has(f)) {
      return absl::InvalidArgumentError(
          absl::StrCat("plan simulate: --", f, " has no use with --config ", kind));
    }
  }
  ClusterSpec cluster;
  auto make = [&](const std::string& flag) -> absl::StatusOr<InstanceSpec> {
    TANDEM_ASSIGN_OR_RETURN(int64_t tp, PositiveInt(args, flag, 1, 64));
    absl::StatusOr<InstanceSpec> spec = setup.factory.make(static_cast<int>(tp));
    if (!spec.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("plan simulate: --", flag, ": ", spec.status().message()));
    }
    return spec;
  };
  if (kind == "colocated") {
    TANDEM_ASSIGN_OR_RETURN(InstanceSpec spec, make("tp"));
    TANDEM_ASSIGN_OR_RETURN(int64_t n, PositiveInt(args, "instances", 1, 4096));
    cluster = ColocatedCluster(spec, static_cast<int>(n));
  } else {
    TANDEM_ASSIGN_OR_RETURN(InstanceSpec p, make("prefill-tp"));
    TANDEM_ASSIGN_OR_RETURN(InstanceSpec d, make("decode-tp"));
    TANDEM_ASSIGN_OR_RETURN(int64_t np, PositiveInt(args, "num-prefill", 1, 4096));
    TANDEM_ASSIGN_OR_RETURN(int64_t nd, PositiveInt(args, "num-decode", 1, 4096));
    cluster = DisaggCluster(p, static_cast<int>(np), d, static_cast<int>(nd),
                            setup.factory.kv_bytes_per_token, setup.factory.kv_link_bytes);
  }
  cluster.request_overhead = setup.factory.request_overhead;
  cluster.request_overhead_samples = setup.factory.request_overhead_samples;

  std::vector<SimArrival> arrivals;
  std::string workload_text;
  if (args.Has("trace")) {
    for (const char* f : {"input-len", "input-len-dist", "output-len", "output-len-dist",
                          "num-requests", "burstiness", "seed"}) {
      if (args.Has(f)) {
        return absl::InvalidArgumentError(
            absl::StrCat("plan simulate: --", f, " has no use with --trace"));
      }
    }
    std::ifstream in(*args.Get("trace"));
    if (!in) {
      return absl::InvalidArgumentError(
          absl::StrCat("plan simulate: --trace: cannot read ", *args.Get("trace")));
    }
    json report = json::parse(in, nullptr, false);
    if (report.is_discarded()) {
      return absl::InvalidArgumentError("plan simulate: --trace: not valid JSON");
    }
    absl::StatusOr<std::vector<SimArrival>> a = ArrivalsFromBenchReport(report);
    if (!a.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("plan simulate: --trace: ", a.status().message()));
    }
    arrivals = *std::move(a);
    workload_text = absl::StrCat("trace ", *args.Get("trace"), " (", arrivals.size(), " requests)");
  } else {
    TANDEM_ASSIGN_OR_RETURN(setup.workload.rate, PositiveDouble(args, "rate", 1));
    arrivals = MakeArrivals(setup.workload);
    workload_text = absl::StrFormat("%g req/s, %lld requests", setup.workload.rate,
                                    static_cast<long long>(setup.workload.num_requests));
  }
  TANDEM_ASSIGN_OR_RETURN(int64_t replicas, PositiveInt(args, "replicas", 1, 10000));
  SimResult result;
  for (int64_t i = 0; i < replicas; ++i) {
    cluster.noise_seed = static_cast<uint64_t>(i + 1);
    TANDEM_ASSIGN_OR_RETURN(SimResult one, Simulate(cluster, arrivals));
    result.requests.insert(result.requests.end(), one.requests.begin(), one.requests.end());
    result.duration += one.duration;
    result.steps += one.steps;
  }
  const bool with_slo = setup.slo.ttft > 0;
  SimSummary summary = SummarizeSim(result, with_slo ? setup.slo : Slo{1e30, 1e30},
                                    cluster.Gpus());

  std::printf("tandem plan simulate: %s, %s, %s\n", cluster.Describe().c_str(),
              setup.source.c_str(), workload_text.c_str());
  std::printf("duration %.3f s, %lld steps, throughput %.3f req/s\n", result.duration,
              static_cast<long long>(result.steps), summary.throughput);
  std::printf("%-6s %9s %9s %9s %9s   (ms)\n", "", "mean", "p50", "p90", "p99");
  for (const auto& [name, m] : {std::pair<const char*, MetricSummary>{"TTFT", summary.ttft},
                                {"TPOT", summary.tpot},
                                {"E2E", summary.e2e}}) {
    std::printf("%-6s %9.2f %9.2f %9.2f %9.2f\n", name, m.mean * 1e3, m.p50 * 1e3, m.p90 * 1e3,
                m.p99 * 1e3);
  }
  if (with_slo) {
    std::printf("SLO attainment %.4f, goodput %.3f req/s, per GPU %.3f\n", summary.attainment,
                summary.goodput, summary.per_gpu_goodput);
  }
  if (args.Has("json")) {
    json out = SimSummaryJson(summary);
    if (!with_slo) {
      out.erase("attainment");
      out.erase("goodput");
      out.erase("per_gpu_goodput");
    }
    out["config"] = cluster.Describe();
    out["gpus"] = cluster.Gpus();
    out["source"] = setup.source;
    out["duration_s"] = result.duration;
    out["steps"] = result.steps;
    out["requests"] = arrivals.size();
    out["replicas"] = replicas;
    out["model"] = cluster.disaggregated
                       ? json{{"prefill", cluster.prefill.model.ToJson()},
                              {"decode", cluster.decode.model.ToJson()}}
                       : cluster.colocated.model.ToJson();
    TANDEM_RETURN_IF_ERROR(WriteJson(*args.Get("json"), out));
  }
  return absl::OkStatus();
}

// --- tandem plan calibrate ---

struct Timer {
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  double Seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
};

double Median(std::vector<double> v) { return v.empty() ? 0 : Percentile(std::move(v), 50); }

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
    // Per token, every layer, K and V: what an engine's cache of this model holds (fp32).
    cal.kv_bytes_per_token =
        static_cast<double>(engine::ModelRunner::KvBytesPerBlock(config, 1));
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
  std::printf("prefill: t = %.4g + %.4g*tokens + %.4g*seqs + %.4g*context s\n",
              fit.prefill.intercept, fit.prefill.per_token, fit.prefill.per_seq,
              fit.prefill.per_context_token);
  std::printf("decode:  t = %.4g + %.4g*tokens + %.4g*seqs + %.4g*context s\n",
              fit.decode.intercept, fit.decode.per_token, fit.decode.per_seq,
              fit.decode.per_context_token);
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
  std::printf("prefill: t = %.4g + %.4g*tokens + %.4g*seqs + %.4g*context s\n",
              fit.prefill.intercept, fit.prefill.per_token, fit.prefill.per_seq,
              fit.prefill.per_context_token);
  std::printf("decode:  t = %.4g + %.4g*tokens + %.4g*seqs + %.4g*context s\n",
              fit.decode.intercept, fit.decode.per_token, fit.decode.per_seq,
              fit.decode.per_context_token);
  return absl::OkStatus();
}

}  // namespace

int RunPlan(int argc, char** argv) {
  if (argc >= 2 && std::strcmp(argv[1], "simulate") == 0) {
    return ExitCode("plan simulate", Simulate(argc - 1, argv + 1));
  }
  if (argc >= 2 && std::strcmp(argv[1], "calibrate") == 0) {
    return ExitCode("plan calibrate", Calibrate(argc - 1, argv + 1));
  }
  return ExitCode("plan", Plan(argc, argv));
}

}  // namespace tandem::tools
