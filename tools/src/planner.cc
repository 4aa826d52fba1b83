// The capacity planner's step latency models: fitting and calibration files, and the
// roofline-based model for hardware that was not measured.
#include "tandem/tools/planner.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <numeric>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "tandem/base/status_macros.h"
#include "tandem/tools/synth_model.h"

namespace tandem::tools {
namespace {

using json = nlohmann::json;

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// The roofline shape of one of `tp` tensor-parallel shards: heads, KV heads (at least one, and
// dividing the heads), MLP width and vocabulary divided by tp, rounded up.
RooflineShape ShardShape(const RooflineShape& shape, int tp) {
  RooflineShape s = shape;
  auto div_up = [](int64_t v, int64_t d) { return (v + d - 1) / d; };
  s.heads = div_up(shape.heads, tp);
  s.kv_heads = std::max<int64_t>(1, div_up(shape.kv_heads, tp));
  while (s.heads % s.kv_heads != 0) --s.kv_heads;
  s.intermediate = div_up(shape.intermediate, tp);
  s.vocab = div_up(shape.vocab, tp);
  return s;
}

}  // namespace

// --- latency model ---

double LatencyModel::StepSeconds(int64_t tokens, int64_t prefill_tokens, int64_t seqs,
                                 int64_t context) const {
  const engine::StepCoefficients& c = prefill_tokens > 0 ? prefill : decode;
  return std::max(0.0, c.Seconds(static_cast<double>(tokens), static_cast<double>(seqs),
                                 static_cast<double>(context)));
}

json LatencyModel::ToJson() const {
  auto coeffs = [](const engine::StepCoefficients& c) {
    return json{{"a", c.intercept}, {"b", c.per_token}, {"c", c.per_seq},
                {"d", c.per_context_token}};
  };
  return json{{"prefill", coeffs(prefill)}, {"decode", coeffs(decode)}};
}

namespace {

// Plain least squares, no coefficient negative.
absl::StatusOr<engine::StepCoefficients> FitOnce(const std::vector<StepSample>& samples) {
  std::vector<engine::StepObservation> steps;
  steps.reserve(samples.size());
  for (const StepSample& s : samples) {
    steps.push_back({static_cast<double>(s.tokens), static_cast<double>(s.seqs),
                     static_cast<double>(s.context), s.seconds});
  }
  auto fit = engine::FitStepCoefficients(steps, {.non_negative = true});
  if (!fit) return absl::InvalidArgumentError("no step samples to fit");
  return *fit;
}

}  // namespace

absl::StatusOr<engine::StepCoefficients> FitStepCoeffs(const std::vector<StepSample>& samples,
                                                       double trim) {
  TANDEM_ASSIGN_OR_RETURN(engine::StepCoefficients fit, FitOnce(samples));
  if (!(trim > 0) || trim >= 1) return fit;
  const size_t keep = std::max<size_t>(
      1, static_cast<size_t>(std::ceil((1 - trim) * static_cast<double>(samples.size()))));
  for (int round = 0; round < 2; ++round) {
    std::vector<std::pair<double, size_t>> slow;
    for (size_t i = 0; i < samples.size(); ++i) {
      const StepSample& s = samples[i];
      const double pred = std::max(1e-12, fit.Seconds(static_cast<double>(s.tokens),
                                                      static_cast<double>(s.seqs),
                                                      static_cast<double>(s.context)));
      slow.emplace_back((s.seconds - pred) / pred, i);
    }
    std::sort(slow.begin(), slow.end());
    std::vector<StepSample> kept;
    for (size_t i = 0; i < keep; ++i) kept.push_back(samples[slow[i].second]);
    TANDEM_ASSIGN_OR_RETURN(fit, FitOnce(kept));
  }
  return fit;
}

absl::StatusOr<LatencyModel> FitLatencyModel(const std::vector<StepSample>& samples,
                                             double trim) {
  std::vector<StepSample> prefill, decode;
  for (const StepSample& s : samples) (s.prefill_tokens > 0 ? prefill : decode).push_back(s);
  if (samples.empty()) return absl::InvalidArgumentError("no step samples to fit");
  LatencyModel model;
  if (!prefill.empty()) {
    TANDEM_ASSIGN_OR_RETURN(model.prefill, FitStepCoeffs(prefill, trim));
  }
  if (!decode.empty()) {
    TANDEM_ASSIGN_OR_RETURN(model.decode, FitStepCoeffs(decode, trim));
  }
  if (prefill.empty()) model.prefill = model.decode;
  if (decode.empty()) model.decode = model.prefill;
  return model;
}

void SetStepNoise(LatencyModel& model, const std::vector<StepSample>& samples) {
  model.prefill_noise.clear();
  model.decode_noise.clear();
  for (const StepSample& s : samples) {
    const double predicted = model.StepSeconds(s.tokens, s.prefill_tokens, s.seqs, s.context);
    if (!(predicted > 0) || !(s.seconds > 0)) continue;
    (s.prefill_tokens > 0 ? model.prefill_noise : model.decode_noise)
        .push_back(s.seconds / predicted);
  }
  if (model.prefill_noise.empty()) model.prefill_noise = model.decode_noise;
  if (model.decode_noise.empty()) model.decode_noise = model.prefill_noise;
}

json Calibration::ToJson() const {
  json rows = json::array();
  for (const StepSample& s : samples) {
    rows.push_back({{"tokens", s.tokens},
                    {"prefill_tokens", s.prefill_tokens},
                    {"seqs", s.seqs},
                    {"context", s.context},
                    {"seconds", s.seconds}});
  }
  return json{{"model", model},
              {"device", device},
              {"max_num_batched_tokens", max_num_batched_tokens},
              {"max_num_seqs", max_num_seqs},
              {"kv_bytes_per_token", kv_bytes_per_token},
              {"step_gap_seconds", step_gap},
              {"request_overhead_seconds", request_overhead},
              {"request_overhead_samples_seconds", request_overhead_samples},
              {"samples", std::move(rows)}};
}

absl::StatusOr<Calibration> CalibrationFromJson(const json& j) {
  if (!j.is_object() || !j.contains("samples") || !j["samples"].is_array()) {
    return absl::InvalidArgumentError("calibration: expected an object with a 'samples' array");
  }
  Calibration c;
  try {
    c.model = j.value("model", "");
    c.device = j.value("device", "");
    c.max_num_batched_tokens = j.value("max_num_batched_tokens", int64_t{0});
    c.max_num_seqs = j.value("max_num_seqs", int64_t{0});
    c.kv_bytes_per_token = j.value("kv_bytes_per_token", 0.0);
    c.step_gap = j.value("step_gap_seconds", 0.0);
    c.request_overhead = j.value("request_overhead_seconds", -1.0);
    c.request_overhead_samples =
        j.value("request_overhead_samples_seconds", std::vector<double>{});
    for (double o : c.request_overhead_samples) {
      if (!(o >= 0) || !std::isfinite(o)) {
        return absl::InvalidArgumentError(
            "calibration: request_overhead_samples_seconds must be >= 0");
      }
    }
    if (!(c.step_gap >= 0) || !std::isfinite(c.step_gap) || !std::isfinite(c.request_overhead)) {
      return absl::InvalidArgumentError("calibration: step_gap_seconds must be >= 0");
    }
    for (const json& row : j["samples"]) {
      StepSample s;
      s.tokens = row.at("tokens").get<int64_t>();
      s.prefill_tokens = row.value("prefill_tokens", int64_t{0});
      s.seqs = row.at("seqs").get<int64_t>();
      s.context = row.at("context").get<int64_t>();
      s.seconds = row.at("seconds").get<double>();
      if (s.tokens < 0 || s.seqs < 0 || s.context < 0 || !(s.seconds >= 0)) {
        return absl::InvalidArgumentError("calibration: negative field in a sample");
      }
      c.samples.push_back(s);
    }
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("calibration: ", e.what()));
  }
  if (c.samples.empty()) return absl::InvalidArgumentError("calibration: no samples");
  return c;
}

absl::StatusOr<Calibration> ReadCalibration(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read calibration file ", path));
  json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not valid JSON"));
  }
  return CalibrationFromJson(j);
}

// --- hardware and the roofline-based model ---

absl::StatusOr<ClusterHardware> FindClusterHardware(const std::string& name) {
  TANDEM_ASSIGN_OR_RETURN(HardwareProfile gpu, FindHardware(name));
  ClusterHardware h;
  h.gpu = gpu;
  const std::string lower = Lower(gpu.name);
  const double gib = 1024.0 * 1024.0 * 1024.0;
  h.memory_bytes = (lower == "h200" ? 141 : 80) * gib;
  h.interconnect_bytes = (lower == "a100-80g" ? 300 : 450) * kBytesPerGB;
  h.allreduce_latency = 10e-6;
  h.kv_link_bytes = 25 * kBytesPerGB;
  return h;
}

absl::StatusOr<RooflineShape> PlannerShape(const std::string& name) {
  const std::string lower = Lower(name);
  if (lower == "small") {
    // The synthetic `small` preset as `tandem synth-model` writes it (its trained tokenizer
    // has about 4096 tokens).
    TANDEM_ASSIGN_OR_RETURN(text::ModelConfig config, SyntheticConfig("small", "llama", 4096));
    return ShapeFromConfig(config);
  }
  if (lower == "llama3-8b") return Llama3_8BShape();
  return FindShape(name);
}

double KvBytesPerToken(const RooflineShape& s) {
  return static_cast<double>(s.layers * 2 * s.kv_heads * s.head_dim) * s.KvBytes();
}

double WeightBytes(const RooflineShape& s) {
  return DecodeWeightBytes(s) + static_cast<double>(s.dtype_bytes * s.hidden * s.vocab);
}

double RooflineStepSeconds(const RooflineShape& shape, const ClusterHardware& hardware, int tp,
                           int64_t tokens, int64_t seqs, int64_t context, bool prefill) {
  if (tokens <= 0 || seqs <= 0) return 0;
  RooflineShape s = ShardShape(shape, std::max(1, tp));
  s.batch = seqs;
  double seconds = 0;
  if (prefill) {
    s.seq_len = std::max<int64_t>(1, (tokens + seqs - 1) / seqs);
    absl::StatusOr<RooflineReport> r = AnalyzeRoofline(s, hardware.gpu);
    if (!r.ok()) return 0;
    seconds = r->prefill.step_seconds;
  } else {
    s.seq_len = std::max<int64_t>(1, context / seqs);
    absl::StatusOr<RooflineReport> r = AnalyzeRoofline(s, hardware.gpu);
    if (!r.ok()) return 0;
    seconds = r->decode.step_seconds;
  }
  if (tp > 1) {
    // Two all-reduces per layer (after the attention output and after the MLP) of the step's
    // activations; a ring moves 2 (tp-1)/tp of them through each GPU's link.
    const double bytes = static_cast<double>(tokens * shape.hidden * shape.dtype_bytes);
    const double per_allreduce = hardware.allreduce_latency +
                                 2.0 * (tp - 1) / tp * bytes / hardware.interconnect_bytes;
    seconds += 2.0 * static_cast<double>(shape.layers) * per_allreduce;
  }
  return seconds;
}

absl::StatusOr<LatencyModel> RooflineLatencyModel(const RooflineShape& shape,
                                                  const ClusterHardware& hardware, int tp) {
  RooflineShape check = shape;
  check.batch = 1;
  check.seq_len = 1;
  TANDEM_RETURN_IF_ERROR(check.Validate());
  if (tp < 1) return absl::InvalidArgumentError("tensor-parallel degree must be >= 1");
  std::vector<StepSample> samples;
  for (int64_t b : {1, 2, 4, 8}) {
    for (int64_t t : {32, 64, 128, 256, 512, 1024, 2048, 4096}) {
      if (b * t > 8192) continue;
      samples.push_back({b * t, b * t, b, b * t,
                         RooflineStepSeconds(shape, hardware, tp, b * t, b, b * t, true)});
    }
  }
  for (int64_t b : {1, 2, 4, 8, 16, 32, 64, 128, 256}) {
    for (int64_t t : {64, 256, 1024, 4096}) {
      samples.push_back(
          {b, 0, b, b * t, RooflineStepSeconds(shape, hardware, tp, b, b, b * t, false)});
    }
  }
  return FitLatencyModel(samples);
}

LatencyModel ScaleModelToTp(const LatencyModel& measured, const RooflineShape& shape,
                            const ClusterHardware& hardware, int tp) {
  if (tp <= 1) return measured;
  auto ratio = [&](int64_t tokens, int64_t seqs, int64_t context, bool prefill) {
    const double one = RooflineStepSeconds(shape, hardware, 1, tokens, seqs, context, prefill);
    const double many = RooflineStepSeconds(shape, hardware, tp, tokens, seqs, context, prefill);
    return one > 0 ? many / one : 1.0;
  };
  auto scaled = [](engine::StepCoefficients c, double r) {
    c.intercept *= r;
    c.per_token *= r;
    c.per_seq *= r;
    c.per_context_token *= r;
    return c;
  };
  LatencyModel m = measured;  // the gap and the noise carry over as they are
  m.prefill = scaled(measured.prefill, ratio(512, 1, 512, true));
  m.decode = scaled(measured.decode, ratio(32, 32, 32 * 512, false));
  return m;
}

}  // namespace tandem::tools
