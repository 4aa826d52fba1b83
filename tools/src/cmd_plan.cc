// `tandem plan`: the capacity planner (see planner.h and docs/tools.md, "Planner").
//   tandem plan [flags]            placement search: best goodput per GPU, disaggregated and
//                                  colocated side by side
//   tandem plan simulate [flags]   one simulation of one configuration at one rate (or a trace)
//   tandem plan calibrate [flags]  times real engine steps and writes a calibration file
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "cmd_plan.h"
#include "commands.h"
#include "tandem/base/status_macros.h"
#include "tandem/text/model_config.h"
#include "tandem/tools/args.h"
#include "tandem/tools/planner.h"

namespace tandem::tools {
namespace plan_internal {

using json = nlohmann::json;

absl::StatusOr<int64_t> PositiveInt(const Args& args, const std::string& name, int64_t fallback,
                                    int64_t hi) {
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
}  // namespace plan_internal

namespace {

using json = nlohmann::json;
using plan_internal::Calibrate;
using plan_internal::PositiveDouble;
using plan_internal::PositiveInt;
using plan_internal::WriteJson;

// --- shared flags of `plan` and `plan simulate` ---

void DeclareModelFlags(Args& args) {
  args.Declare("model", "DIR", "checkpoint whose config.json gives the shape");
  args.Declare("preset", "NAME", "small | llama3-8b | textbook | llama-3-8b (default small)");
  args.Declare("weight-dtype", "TYPE",
               "projection weights: bfloat16 | float16 | float32 | int8 | int4 (default: the "
               "preset's 2 bytes, or --model's dtype and quantization_config)");
  args.Declare("group-size", "N", "int4 inputs per scale and zero point (default 128)");
  args.Declare("kv-cache-dtype", "TYPE",
               "bfloat16 | float16 | float32 | fp8_e4m3 | fp8_e5m2 (default: the weights' type)");
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
    absl::StatusOr<double> weight_bytes = CheckpointWeightBytes((dir / "config.json").string());
    if (!weight_bytes.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(cmd, ": --model: ", weight_bytes.status().message()));
    }
    s.shape.weight_bytes = *weight_bytes;
  } else {
    absl::StatusOr<RooflineShape> shape = PlannerShape(args.GetOr("preset", "small"));
    if (!shape.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(cmd, ": --preset: ", shape.status().message()));
    }
    s.shape = *shape;
  }
  TANDEM_ASSIGN_OR_RETURN(int64_t group_size, args.Int("group-size", 128));
  if (absl::Status precision =
          SetPrecision(args.GetOr("weight-dtype", "auto"), args.GetOr("kv-cache-dtype", "auto"),
                       static_cast<int>(group_size), &s.shape);
      !precision.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(cmd, ": ", precision.message()));
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
