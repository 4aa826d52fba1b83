// The capacity planner's discrete-event simulator: cluster specs, arrivals, the simulated
// instances and their summaries.
#include "tandem/tools/planner.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <queue>
#include <random>

#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"

namespace tandem::tools {
namespace {

using json = nlohmann::json;

}  // namespace

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

}  // namespace tandem::tools
