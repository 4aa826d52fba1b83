#include "tandem/tools/planner.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <fstream>
#include <limits>
#include <numeric>
#include <queue>
#include <random>
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
  return static_cast<double>(s.layers * 2 * s.kv_heads * s.head_dim * s.dtype_bytes);
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

// --- simulator ---

int ClusterSpec::Gpus() const {
  return disaggregated ? prefill.tp * num_prefill + decode.tp * num_decode
                       : colocated.tp * num_colocated;
}

std::string ClusterSpec::Describe() const {
  if (disaggregated) {
    return absl::StrCat("disagg ", num_prefill, "xTP", prefill.tp, " prefill + ", num_decode,
                        "xTP", decode.tp, " decode");
  }
  return absl::StrCat("colocated ", num_colocated, "xTP", colocated.tp);
}

ClusterSpec ColocatedCluster(const InstanceSpec& instance, int instances) {
  ClusterSpec c;
  c.disaggregated = false;
  c.colocated = instance;
  c.num_colocated = instances;
  return c;
}

ClusterSpec DisaggCluster(const InstanceSpec& prefill, int num_prefill, const InstanceSpec& decode,
                          int num_decode, double kv_bytes_per_token, double kv_link_bytes) {
  ClusterSpec c;
  c.disaggregated = true;
  c.prefill = prefill;
  c.num_prefill = num_prefill;
  c.decode = decode;
  c.num_decode = num_decode;
  c.kv_bytes_per_token = kv_bytes_per_token;
  c.kv_link_bytes = kv_link_bytes;
  return c;
}

std::vector<SimArrival> MakeArrivals(const WorkloadSpec& w) {
  const std::vector<double> times = ArrivalTimes(w.num_requests, w.rate, w.burstiness, w.seed);
  const std::vector<int64_t> in = SampleLengths(w.input, w.num_requests, w.seed);
  const std::vector<int64_t> out = SampleLengths(w.output, w.num_requests, w.seed + 1);
  std::vector<SimArrival> arrivals(static_cast<size_t>(w.num_requests));
  for (size_t i = 0; i < arrivals.size(); ++i) arrivals[i] = {times[i], in[i], out[i]};
  return arrivals;
}

absl::StatusOr<std::vector<SimArrival>> ArrivalsFromBenchReport(const json& report) {
  const json* run = &report;
  if (report.contains("runs") && report["runs"].is_array() && !report["runs"].empty()) {
    run = &report["runs"][0];
  }
  if (!run->contains("requests") || !(*run)["requests"].is_array()) {
    return absl::InvalidArgumentError("bench report: no 'requests' array");
  }
  std::vector<SimArrival> arrivals;
  for (const json& r : (*run)["requests"]) {
    if (!r.value("success", false)) continue;
    SimArrival a;
    a.time = r.value("start_s", 0.0);
    a.input_len = std::max<int64_t>(1, r.value("prompt_tokens", int64_t{1}));
    a.output_len = std::max<int64_t>(1, r.value("output_tokens", int64_t{1}));
    arrivals.push_back(a);
  }
  if (arrivals.empty()) return absl::InvalidArgumentError("bench report: no successful request");
  std::stable_sort(arrivals.begin(), arrivals.end(),
                   [](const SimArrival& x, const SimArrival& y) { return x.time < y.time; });
  return arrivals;
}

double SimRequest::Tpot() const {
  if (arrival.output_len < 2) return 0;
  return (e2e - ttft) / static_cast<double>(arrival.output_len - 1);
}

namespace {

enum class Role { kColocated, kPrefill, kDecode };

struct SimSeq {
  int request = 0;
  int64_t prompt = 0, output = 0;
  int64_t computed = 0, generated = 0;
  int64_t Uncomputed() const { return prompt + generated - computed; }
};

struct Scheduled {
  size_t index;  // into running
  int64_t new_tokens;
};

// One instance: the engine scheduler's policy over waiting and running sequences.
struct SimInstance {
  Role role = Role::kColocated;
  const InstanceSpec* spec = nullptr;
  std::deque<SimSeq> waiting;
  std::vector<SimSeq> running;
  std::deque<SimSeq> incoming;  // decode role: prefilled, waiting for KV capacity
  int64_t reserved_tokens = 0;  // prompt + output of running sequences
  int64_t assigned = 0;         // decode role: requests routed here, KV not yet arrived
  bool busy = false;
  std::vector<Scheduled> step;

  bool Fits(const SimSeq& s) const {
    return spec->kv_capacity_tokens <= 0 ||
           reserved_tokens + s.prompt + s.output <= spec->kv_capacity_tokens;
  }
  int64_t QueuedPromptTokens() const {
    int64_t n = 0;
    for (const SimSeq& s : waiting) n += s.Uncomputed();
    for (const SimSeq& s : running) n += s.Uncomputed();
    return n;
  }
  // Plans the next step as Scheduler::Schedule does; returns its duration, or a negative value
  // when there is nothing to run. `rng` draws the step's noise; `follows` says the step starts
  // right as the previous one ended (the serving loop's gap comes first).
  double Plan(std::mt19937_64& rng, bool follows) {
    step.clear();
    while (!incoming.empty() && Fits(incoming.front())) {
      reserved_tokens += incoming.front().prompt + incoming.front().output;
      running.push_back(incoming.front());
      incoming.pop_front();
    }
    int64_t budget = spec->max_num_batched_tokens;
    for (size_t i = 0; i < running.size() && budget > 0 &&
                       static_cast<int>(step.size()) < spec->max_num_seqs;
         ++i) {
      const int64_t n = std::min(running[i].Uncomputed(), budget);
      if (n <= 0) continue;
      step.push_back({i, n});
      budget -= n;
    }
    while (budget > 0 && !waiting.empty() &&
           static_cast<int>(running.size()) < spec->max_num_seqs && Fits(waiting.front())) {
      SimSeq s = waiting.front();
      waiting.pop_front();
      reserved_tokens += s.prompt + s.output;
      running.push_back(s);
      const int64_t n = std::min(s.Uncomputed(), budget);
      step.push_back({running.size() - 1, n});
      budget -= n;
    }
    if (step.empty()) return -1;
    int64_t tokens = 0, prefill_tokens = 0, context = 0;
    for (const Scheduled& s : step) {
      const SimSeq& q = running[s.index];
      tokens += s.new_tokens;
      if (q.computed < q.prompt) prefill_tokens += std::min(s.new_tokens, q.prompt - q.computed);
      context += q.computed + s.new_tokens;
    }
    double seconds = spec->model.StepSeconds(tokens, prefill_tokens,
                                             static_cast<int64_t>(step.size()), context);
    const std::vector<double>& noise =
        prefill_tokens > 0 ? spec->model.prefill_noise : spec->model.decode_noise;
    if (!noise.empty()) seconds *= noise[rng() % noise.size()];
    return seconds + (follows ? spec->model.step_gap : 0.0);
  }
};

struct Event {
  double time;
  int64_t order;
  int kind;  // 0 arrival, 1 step end, 2 KV arrival
  int a;     // request (arrival, KV) or instance (step end)
  int b;     // decode instance (KV)
  bool operator>(const Event& o) const {
    return time != o.time ? time > o.time : order > o.order;
  }
};

}  // namespace

absl::StatusOr<SimResult> Simulate(const ClusterSpec& cluster,
                                   const std::vector<SimArrival>& arrivals) {
  auto check = [](const InstanceSpec& s, int count, const char* what) -> absl::Status {
    if (count < 1 || s.tp < 1 || s.max_num_seqs < 1 || s.max_num_batched_tokens < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "simulate: ", what, " instances need count, tp, max_num_seqs and "
          "max_num_batched_tokens >= 1"));
    }
    return absl::OkStatus();
  };
  std::vector<SimInstance> inst;
  int num_prefill = 0;
  if (cluster.disaggregated) {
    TANDEM_RETURN_IF_ERROR(check(cluster.prefill, cluster.num_prefill, "prefill"));
    TANDEM_RETURN_IF_ERROR(check(cluster.decode, cluster.num_decode, "decode"));
    num_prefill = cluster.num_prefill;
    for (int i = 0; i < cluster.num_prefill; ++i) {
      inst.push_back({.role = Role::kPrefill, .spec = &cluster.prefill});
    }
    for (int i = 0; i < cluster.num_decode; ++i) {
      inst.push_back({.role = Role::kDecode, .spec = &cluster.decode});
    }
  } else {
    TANDEM_RETURN_IF_ERROR(check(cluster.colocated, cluster.num_colocated, "colocated"));
    for (int i = 0; i < cluster.num_colocated; ++i) {
      inst.push_back({.role = Role::kColocated, .spec = &cluster.colocated});
    }
  }

  SimResult result;
  result.requests.resize(arrivals.size());
  std::vector<int> decode_of(arrivals.size(), -1);
  std::priority_queue<Event, std::vector<Event>, std::greater<Event>> events;
  int64_t order = 0;
  for (size_t i = 0; i < arrivals.size(); ++i) {
    result.requests[i].arrival = arrivals[i];
    events.push({arrivals[i].time, order++, 0, static_cast<int>(i), -1});
  }
  double last = arrivals.empty() ? 0 : arrivals.front().time;
  double first = last;
  for (const SimArrival& a : arrivals) first = std::min(first, a.time);

  // Each request's serving-path overhead: the constant, or one of the measured ones drawn at
  // random (its own seeded stream, so the step draws do not depend on it).
  std::vector<double> overhead(arrivals.size(), cluster.request_overhead);
  if (!cluster.request_overhead_samples.empty()) {
    std::mt19937_64 draw(cluster.noise_seed ^ 0x6f76657268656164ull);
    for (double& o : overhead) {
      o = cluster.request_overhead_samples[draw() % cluster.request_overhead_samples.size()];
    }
  }
  auto finish = [&](int request, double now) {
    SimRequest& r = result.requests[static_cast<size_t>(request)];
    r.finished = true;
    r.e2e = now + overhead[static_cast<size_t>(request)] - r.arrival.time;
    last = std::max(last, now);
  };
  // Starts a step on an idle instance that has work. A waiting request that could never fit in
  // an empty instance is dropped (unfinished).
  std::mt19937_64 rng(cluster.noise_seed);
  auto try_start = [&](int id, double now, bool follows) {
    SimInstance& in = inst[static_cast<size_t>(id)];
    if (in.busy) return;
    while (true) {
      const double seconds = in.Plan(rng, follows);
      if (seconds >= 0) {
        in.busy = true;
        ++result.steps;
        events.push({now + seconds, order++, 1, id, -1});
        return;
      }
      if (in.running.empty() && !in.waiting.empty()) {
        in.waiting.pop_front();
        continue;
      }
      if (in.running.empty() && !in.incoming.empty()) {
        in.incoming.pop_front();
        continue;
      }
      return;
    }
  };

  while (!events.empty()) {
    const Event e = events.top();
    events.pop();
    const double now = e.time;
    if (e.kind == 0) {
      const SimArrival& a = arrivals[static_cast<size_t>(e.a)];
      SimSeq seq{e.a, a.input_len, std::max<int64_t>(1, a.output_len), 0, 0};
      int best = 0;
      if (!cluster.disaggregated) {
        for (int i = 1; i < static_cast<int>(inst.size()); ++i) {
          auto load = [&](int k) {
            return inst[k].running.size() + inst[k].waiting.size();
          };
          if (load(i) < load(best)) best = i;
        }
      } else {
        for (int i = 1; i < num_prefill; ++i) {
          if (inst[i].QueuedPromptTokens() < inst[best].QueuedPromptTokens()) best = i;
        }
        int dbest = num_prefill;
        auto dload = [&](int k) {
          return static_cast<int64_t>(inst[k].running.size() + inst[k].incoming.size()) +
                 inst[k].assigned;
        };
        for (int i = num_prefill + 1; i < static_cast<int>(inst.size()); ++i) {
          if (dload(i) < dload(dbest)) dbest = i;
        }
        decode_of[static_cast<size_t>(e.a)] = dbest;
        if (seq.output > 1) ++inst[static_cast<size_t>(dbest)].assigned;
      }
      inst[static_cast<size_t>(best)].waiting.push_back(seq);
      try_start(best, now, false);
    } else if (e.kind == 1) {
      SimInstance& in = inst[static_cast<size_t>(e.a)];
      in.busy = false;
      std::vector<bool> done(in.running.size(), false);
      for (const Scheduled& s : in.step) {
        SimSeq& q = in.running[s.index];
        q.computed += s.new_tokens;
        if (q.Uncomputed() > 0) continue;  // a prompt chunk that is not the last
        ++q.generated;
        SimRequest& r = result.requests[static_cast<size_t>(q.request)];
        if (in.role == Role::kColocated) {
          if (q.generated == 1) {
            r.ttft = now + overhead[static_cast<size_t>(q.request)] - r.arrival.time;
          }
          if (q.generated >= q.output) {
            finish(q.request, now);
            done[s.index] = true;
          }
        } else if (in.role == Role::kPrefill) {
          done[s.index] = true;
          double transfer = cluster.kv_transfer_latency;
          if (cluster.kv_link_bytes > 0) {
            transfer += cluster.kv_bytes_per_token * static_cast<double>(q.prompt) /
                        cluster.kv_link_bytes;
          }
          const double landed = now + transfer;
          r.ttft = landed + overhead[static_cast<size_t>(q.request)] - r.arrival.time;
          if (q.output <= 1) {
            finish(q.request, landed);
          } else {
            events.push({landed, order++, 2, q.request, decode_of[static_cast<size_t>(q.request)]});
          }
        } else {
          if (q.generated >= q.output) {
            finish(q.request, now);
            done[s.index] = true;
          }
        }
      }
      std::vector<SimSeq> kept;
      kept.reserve(in.running.size());
      for (size_t i = 0; i < in.running.size(); ++i) {
        if (done[i]) {
          in.reserved_tokens -= in.running[i].prompt + in.running[i].output;
        } else {
          kept.push_back(in.running[i]);
        }
      }
      in.running = std::move(kept);
      try_start(e.a, now, true);
    } else {
      SimInstance& in = inst[static_cast<size_t>(e.b)];
      --in.assigned;
      const SimArrival& a = arrivals[static_cast<size_t>(e.a)];
      // Prompt KV in place and the first token sampled: one token left to compute.
      in.incoming.push_back({e.a, a.input_len, a.output_len, a.input_len, 1});
      try_start(e.b, now, false);
    }
  }
  result.duration = std::max(0.0, last - first);
  return result;
}

SimSummary SummarizeSim(const SimResult& result, const Slo& slo, int gpus) {
  SimSummary s;
  std::vector<double> ttft, tpot, e2e;
  int64_t met = 0, finished = 0;
  for (const SimRequest& r : result.requests) {
    if (!r.finished) continue;
    ++finished;
    ttft.push_back(r.ttft);
    e2e.push_back(r.e2e);
    if (r.arrival.output_len > 1) tpot.push_back(r.Tpot());
    if (r.ttft <= slo.ttft && r.Tpot() <= slo.tpot) ++met;
  }
  s.ttft = Summarize(ttft);
  s.tpot = Summarize(tpot);
  s.e2e = Summarize(e2e);
  const double n = static_cast<double>(result.requests.size());
  s.attainment = n > 0 ? static_cast<double>(met) / n : 0;
  s.goodput = result.duration > 0 ? static_cast<double>(met) / result.duration : 0;
  s.throughput = result.duration > 0 ? static_cast<double>(finished) / result.duration : 0;
  s.per_gpu_goodput = gpus > 0 ? s.goodput / gpus : 0;
  return s;
}

json SimSummaryJson(const SimSummary& s) {
  auto ms = [](const MetricSummary& m) {
    return json{{"mean", m.mean * 1e3}, {"p50", m.p50 * 1e3}, {"p90", m.p90 * 1e3},
                {"p99", m.p99 * 1e3}};
  };
  return json{{"ttft_ms", ms(s.ttft)},         {"tpot_ms", ms(s.tpot)},
              {"e2e_ms", ms(s.e2e)},           {"attainment", s.attainment},
              {"goodput", s.goodput},          {"per_gpu_goodput", s.per_gpu_goodput},
              {"throughput", s.throughput}};
}

// --- placement search ---

json Placement::ToJson() const {
  json j = {{"config", cluster.Describe()},
            {"disaggregated", cluster.disaggregated},
            {"gpus", cluster.Gpus()},
            {"max_rate", max_rate},
            {"per_gpu_goodput", per_gpu_goodput},
            {"at_max_rate", SimSummaryJson(at_max_rate)}};
  if (cluster.disaggregated) {
    j["prefill"] = {{"tp", cluster.prefill.tp}, {"instances", cluster.num_prefill}};
    j["decode"] = {{"tp", cluster.decode.tp}, {"instances", cluster.num_decode}};
  } else {
    j["colocated"] = {{"tp", cluster.colocated.tp}, {"instances", cluster.num_colocated}};
  }
  return j;
}

absl::StatusOr<double> MaxSustainedRate(const ClusterSpec& cluster, const SearchOptions& options,
                                        SimSummary* at_rate) {
  const int gpus = cluster.Gpus();
  SimSummary best_summary;
  auto meets = [&](double rate, bool* ok) -> absl::Status {
    WorkloadSpec w = options.workload;
    w.rate = rate;
    w.num_requests = std::max(
        w.num_requests,
        std::min(options.max_requests,
                 static_cast<int64_t>(std::ceil(rate * options.min_sim_seconds))));
    TANDEM_ASSIGN_OR_RETURN(SimResult r, Simulate(cluster, MakeArrivals(w)));
    SimSummary s = SummarizeSim(r, options.slo, gpus);
    *ok = s.attainment >= options.attainment;
    if (*ok) best_summary = s;
    return absl::OkStatus();
  };
  double lo = 0, hi = 0;
  bool ok = false;
  double rate = 1.0;
  TANDEM_RETURN_IF_ERROR(meets(rate, &ok));
  if (ok) {
    lo = rate;
    hi = rate * 2;
    while (true) {
      TANDEM_RETURN_IF_ERROR(meets(hi, &ok));
      if (!ok) break;
      lo = hi;
      hi *= 2;
      if (hi > 1e7) break;
    }
  } else {
    hi = rate;
    lo = rate / 2;
    while (true) {
      TANDEM_RETURN_IF_ERROR(meets(lo, &ok));
      if (ok) break;
      hi = lo;
      lo /= 2;
      if (lo < 1e-4) {
        if (at_rate != nullptr) *at_rate = SimSummary{};
        return 0.0;
      }
    }
  }
  while ((hi - lo) > options.rate_tolerance * lo) {
    const double mid = 0.5 * (lo + hi);
    TANDEM_RETURN_IF_ERROR(meets(mid, &ok));
    if (ok) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  // The summary at `lo` (the last passing rate evaluated may be a lower one after a failed mid;
  // evaluate it again so the reported numbers belong to the returned rate).
  TANDEM_RETURN_IF_ERROR(meets(lo, &ok));
  if (at_rate != nullptr) *at_rate = best_summary;
  return lo;
}

namespace {

bool Better(const Placement& x, const Placement& y) {
  if (y.max_rate <= 0) return x.max_rate > 0;
  if (x.per_gpu_goodput != y.per_gpu_goodput) {
    // Within 1% counts as a tie.
    if (std::abs(x.per_gpu_goodput - y.per_gpu_goodput) >
        0.01 * std::max(x.per_gpu_goodput, y.per_gpu_goodput)) {
      return x.per_gpu_goodput > y.per_gpu_goodput;
    }
  }
  if (x.max_rate != y.max_rate) return x.max_rate > y.max_rate;
  return x.cluster.Gpus() < y.cluster.Gpus();
}

}  // namespace

absl::StatusOr<PlanResult> SearchPlacement(const InstanceFactory& factory,
                                           const SearchOptions& options) {
  if (options.gpus < 1) return absl::InvalidArgumentError("plan: --gpus must be >= 1");
  if (!(options.slo.ttft > 0) || !(options.slo.tpot > 0)) {
    return absl::InvalidArgumentError("plan: SLOs must be > 0");
  }
  if (!(options.attainment > 0) || options.attainment > 1) {
    return absl::InvalidArgumentError("plan: --attainment must be in (0, 1]");
  }
  std::vector<std::pair<int, InstanceSpec>> specs;
  for (int tp : options.tps) {
    if (tp > options.gpus) continue;
    absl::StatusOr<InstanceSpec> s = factory.make(tp);
    if (s.ok()) specs.emplace_back(tp, *s);
  }
  if (specs.empty()) {
    return absl::InvalidArgumentError(
        "plan: the model fits on none of the tensor-parallel degrees within --gpus");
  }
  PlanResult plan;
  auto evaluate = [&](ClusterSpec cluster) -> absl::Status {
    cluster.kv_bytes_per_token = factory.kv_bytes_per_token;
    cluster.kv_link_bytes = factory.kv_link_bytes;
    cluster.request_overhead = factory.request_overhead;
    cluster.request_overhead_samples = factory.request_overhead_samples;
    Placement p;
    p.cluster = cluster;
    TANDEM_ASSIGN_OR_RETURN(p.max_rate, MaxSustainedRate(cluster, options, &p.at_max_rate));
    p.per_gpu_goodput = p.max_rate / cluster.Gpus();
    Placement& best = cluster.disaggregated ? plan.best_disaggregated : plan.best_colocated;
    if (p.max_rate > 0 && Better(p, best)) best = p;
    plan.evaluated.push_back(std::move(p));
    return absl::OkStatus();
  };
  if (options.search_colocated) {
    for (const auto& [tp, spec] : specs) {
      for (int n = 1; n * tp <= options.gpus; ++n) {
        TANDEM_RETURN_IF_ERROR(evaluate(ColocatedCluster(spec, n)));
      }
    }
  }
  if (options.search_disaggregated) {
    for (const auto& [ptp, pspec] : specs) {
      for (const auto& [dtp, dspec] : specs) {
        for (int np = 1; np * ptp + dtp <= options.gpus; ++np) {
          for (int nd = 1; np * ptp + nd * dtp <= options.gpus; ++nd) {
            TANDEM_RETURN_IF_ERROR(evaluate(DisaggCluster(pspec, np, dspec, nd, 0, 0)));
          }
        }
      }
    }
  }
  return plan;
}

}  // namespace tandem::tools
