// Capacity planner behind `tandem plan`: a latency model of one engine step, a discrete-event
// simulator of Tandem serving a workload (colocated engines, or prefill and decode pools with a
// KV transfer between them), and a placement search over tensor-parallel degrees and instance
// counts for the best goodput per GPU under TTFT and TPOT objectives.
//
//   TANDEM_ASSIGN_OR_RETURN(LatencyModel model, RooflineLatencyModel(shape, hardware, /*tp=*/1));
//   ClusterSpec cluster = ColocatedCluster(InstanceSpec{.model = model}, /*instances=*/1);
//   std::vector<SimArrival> arrivals = MakeArrivals(workload);
//   TANDEM_ASSIGN_OR_RETURN(SimResult result, Simulate(cluster, arrivals));
//   SimSummary summary = SummarizeSim(result, slo, cluster.Gpus());
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "tandem/engine/step_latency_model.h"
#include "tandem/tools/load_generator.h"
#include "tandem/tools/roofline.h"

namespace tandem::tools {

// --- latency model ---

// One timed step.
struct StepSample {
  int64_t tokens = 0;
  int64_t prefill_tokens = 0;  // of `tokens`, prompt tokens (0 for a decode-only step)
  int64_t seqs = 0;
  int64_t context = 0;
  double seconds = 0;
};

// Step time of a worker: steps with any prompt tokens use `prefill`, decode-only steps `decode`.
struct LatencyModel {
  engine::StepCoefficients prefill;
  engine::StepCoefficients decode;
  // Seconds the serving loop spends between two steps while work is pending (streaming the
  // outputs, RPCs); the simulator adds it before every step that follows another at once.
  double step_gap = 0;
  // Measured step time over the fit's prediction, one per calibration step and phase (empty:
  // none). The simulator multiplies each step by one drawn at random, so the steps a shared
  // machine slows down show in the predicted tails as they do in measured ones.
  std::vector<double> prefill_noise;
  std::vector<double> decode_noise;
  double StepSeconds(int64_t tokens, int64_t prefill_tokens, int64_t seqs, int64_t context) const;
  nlohmann::json ToJson() const;
};

// Least-squares fit of the four coefficients to `samples`, none of them negative (a coefficient
// the unconstrained fit makes negative is fixed at 0 and the rest refitted). With trim > 0 the
// fit is repeated twice without the `trim` share of samples that ran slowest relative to the
// previous fit (steps slowed by other processes on a shared machine). Errors with no samples.
absl::StatusOr<engine::StepCoefficients> FitStepCoeffs(const std::vector<StepSample>& samples,
                                                       double trim = 0);
// Fits `prefill` to the samples with prompt tokens and `decode` to the others; when one side has
// no samples it takes the other's fit.
absl::StatusOr<LatencyModel> FitLatencyModel(const std::vector<StepSample>& samples,
                                             double trim = 0);
// Sets model.prefill_noise and decode_noise to every sample's measured / predicted step time.
void SetStepNoise(LatencyModel& model, const std::vector<StepSample>& samples);

// A calibration file: the samples measured on a real engine, and what they were measured with.
struct Calibration {
  std::string model;                 // checkpoint directory or name
  std::string device;                // free text, e.g. "cpu, 2 threads"
  int64_t max_num_batched_tokens = 0;
  int64_t max_num_seqs = 0;
  double kv_bytes_per_token = 0;     // KV cache bytes one token occupies on this engine
  std::vector<StepSample> samples;
  // Measured inside a serving process (`calibrate --trace`): the mean time between consecutive
  // steps, and the client-observed first-token time beyond the engine's own (HTTP, tokenizing,
  // queue hand-off, streaming); negative when not measured.
  double step_gap = 0;
  double request_overhead = -1;
  // With the bench report's response ids paired with the trace's: each request's client TTFT
  // minus its in-engine first-token time (empty when not measured).
  std::vector<double> request_overhead_samples;
  nlohmann::json ToJson() const;
};
absl::StatusOr<Calibration> CalibrationFromJson(const nlohmann::json& j);
absl::StatusOr<Calibration> ReadCalibration(const std::string& path);

// --- hardware and the roofline-based model ---

// One GPU type as the planner sees it: the roofline profile plus memory and links.
struct ClusterHardware {
  HardwareProfile gpu;
  double memory_bytes = 0;          // device memory per GPU
  double interconnect_bytes = 0;    // per-GPU all-reduce bus bandwidth (NVLink), bytes/s
  double allreduce_latency = 0;     // seconds per all-reduce, on top of the bytes
  double kv_link_bytes = 0;         // bytes/s between a prefill and a decode instance
};
// "A100-80G" (80 GiB, NVLink 300 GB/s), "H100" (80 GiB, 450 GB/s), "H200" (141 GiB, 450 GB/s);
// KV link 25 GB/s (a 200 Gb/s NIC) and 10 us per all-reduce for all three.
absl::StatusOr<ClusterHardware> FindClusterHardware(const std::string& name);

// Model shapes by name: "small" and "llama3-8b" (the synthetic presets of `tandem synth-model`),
// and the roofline presets "textbook" and "llama-3-8b".
absl::StatusOr<RooflineShape> PlannerShape(const std::string& name);

// KV cache bytes per token of `shape` (every layer's K and V).
double KvBytesPerToken(const RooflineShape& shape);
// Weight bytes of `shape`, embedding included.
double WeightBytes(const RooflineShape& shape);

// Roofline time of one step on `tp` GPUs: the roofline operators of `shape` with heads, KV heads
// (at least one per GPU), MLP width and vocabulary divided by `tp`, for `seqs` sequences of
// tokens/seqs new tokens each attending to context/seqs tokens, plus two all-reduces per layer
// of the step's activations (2 (tp-1)/tp of them over the interconnect, and the latency) when
// tp > 1.
double RooflineStepSeconds(const RooflineShape& shape, const ClusterHardware& hardware, int tp,
                           int64_t tokens, int64_t seqs, int64_t context, bool prefill);
// A LatencyModel fitted to RooflineStepSeconds over a grid of prefill batches (1 to 8 prompts
// of 32 to 4096 tokens) and decode batches (1 to 256 sequences, contexts 64 to 4096).
absl::StatusOr<LatencyModel> RooflineLatencyModel(const RooflineShape& shape,
                                                  const ClusterHardware& hardware, int tp);
// A measured model moved to `tp` GPUs: each phase's coefficients scaled by the roofline's
// ratio of step times (tp against 1) at a representative batch of that phase.
LatencyModel ScaleModelToTp(const LatencyModel& measured, const RooflineShape& shape,
                            const ClusterHardware& hardware, int tp);

// --- simulator ---

// One serving instance (an engine on `tp` GPUs), scheduled as engine/src/scheduler.cc does:
// running sequences first in arrival order (a decode token, or the next prompt chunk), then
// waiting ones while the token budget and max_num_seqs last.
struct InstanceSpec {
  int tp = 1;
  int max_num_seqs = 64;
  int max_num_batched_tokens = 512;
  // KV capacity in tokens; a waiting request is admitted only when its prompt plus its output
  // fit beside what the running ones will hold. 0: unbounded.
  int64_t kv_capacity_tokens = 0;
  LatencyModel model;
};

struct ClusterSpec {
  bool disaggregated = false;
  // colocated
  InstanceSpec colocated;
  int num_colocated = 1;
  // disaggregated
  InstanceSpec prefill;
  int num_prefill = 1;
  InstanceSpec decode;
  int num_decode = 1;
  double kv_bytes_per_token = 0;   // moved per prompt token from prefill to decode
  double kv_link_bytes = 0;        // bytes/s; <= 0: the transfer is free
  double kv_transfer_latency = 0;  // seconds per request on top of the bytes
  // Seconds added to every request's first token and end (HTTP, tokenization, streaming).
  double request_overhead = 0;
  // When not empty, each request's overhead is one of these instead, drawn at random.
  std::vector<double> request_overhead_samples;
  // Seeds the draws from the latency models' step noise.
  uint64_t noise_seed = 1;

  int Gpus() const;
  std::string Describe() const;  // e.g. "disagg 2xTP1 prefill + 1xTP2 decode"
};
ClusterSpec ColocatedCluster(const InstanceSpec& instance, int instances);
ClusterSpec DisaggCluster(const InstanceSpec& prefill, int num_prefill, const InstanceSpec& decode,
                          int num_decode, double kv_bytes_per_token, double kv_link_bytes);

struct SimArrival {
  double time = 0;
  int64_t input_len = 1;
  int64_t output_len = 1;
};

// The workload: arrival process and length distributions.
struct WorkloadSpec {
  LengthDist input;
  LengthDist output;
  double rate = 1;  // requests/s
  double burstiness = 1;  // gamma shape of the gaps; 1 = Poisson
  int64_t num_requests = 400;
  uint64_t seed = 0;
};
// Arrival times from ArrivalTimes and lengths from SampleLengths (as `tandem bench` draws them).
std::vector<SimArrival> MakeArrivals(const WorkloadSpec& workload);
// The requests of a `tandem bench --json` report: send time, prompt and output tokens of every
// successful request (of the first run when the file holds several).
absl::StatusOr<std::vector<SimArrival>> ArrivalsFromBenchReport(const nlohmann::json& report);

struct SimRequest {
  SimArrival arrival;
  bool finished = false;  // false: never fit in an instance's KV capacity
  double ttft = 0;        // seconds from arrival to the first token
  double e2e = 0;         // seconds from arrival to the last token
  double Tpot() const;    // (e2e - ttft) / (output_len - 1); 0 with fewer than two tokens
};

struct SimResult {
  std::vector<SimRequest> requests;  // in arrival order
  double duration = 0;               // first arrival to last completion
  int64_t steps = 0;                 // engine steps simulated, over every instance
};

absl::StatusOr<SimResult> Simulate(const ClusterSpec& cluster,
                                   const std::vector<SimArrival>& arrivals);

struct Slo {
  double ttft = 0;  // seconds
  double tpot = 0;  // seconds
};
struct SimSummary {
  MetricSummary ttft, tpot, e2e;  // seconds
  double attainment = 0;          // share of requests meeting both objectives
  double goodput = 0;             // such requests per second of the run
  double per_gpu_goodput = 0;
  double throughput = 0;          // finished requests per second
};
SimSummary SummarizeSim(const SimResult& result, const Slo& slo, int gpus);
nlohmann::json SimSummaryJson(const SimSummary& summary);

// --- placement search ---

struct SearchOptions {
  Slo slo;
  double attainment = 0.9;
  int gpus = 8;
  std::vector<int> tps = {1, 2, 4, 8};
  WorkloadSpec workload;   // its rate is what the search varies
  // Each simulation has at least workload.num_requests requests, and more at high rates: enough
  // for this many seconds of arrivals (up to max_requests), so an overloaded configuration
  // shows a growing queue rather than one finite burst.
  double min_sim_seconds = 20;
  int64_t max_requests = 4000;
  double rate_tolerance = 0.02;  // relative width at which the rate bisection stops
  bool search_disaggregated = true;
  bool search_colocated = true;
};

// One configuration and the highest arrival rate at which its simulated SLO attainment still
// reaches the target.
struct Placement {
  ClusterSpec cluster;
  double max_rate = 0;  // requests/s; 0 when even a trickle misses the target
  double per_gpu_goodput = 0;  // max_rate / GPUs
  SimSummary at_max_rate;
  nlohmann::json ToJson() const;
};

struct PlanResult {
  std::vector<Placement> evaluated;
  Placement best_disaggregated;  // max_rate == 0 when none was searched or feasible
  Placement best_colocated;
};

// The latency model of an instance on `tp` GPUs, and its KV capacity in tokens (0: unbounded);
// an error for a TP degree the model cannot run with (weights do not fit).
struct InstanceFactory {
  std::function<absl::StatusOr<InstanceSpec>(int tp)> make;
  double kv_bytes_per_token = 0;
  double kv_link_bytes = 0;
  double request_overhead = 0;
  std::vector<double> request_overhead_samples;
};

// Highest rate in requests/s at which `cluster` meets `options.attainment` on the workload
// (bisection over the rate; the same arrivals seed at every rate).
absl::StatusOr<double> MaxSustainedRate(const ClusterSpec& cluster, const SearchOptions& options,
                                        SimSummary* at_rate = nullptr);

// Every colocated configuration (TP t, n instances, t*n <= gpus) and every disaggregated one
// (prefill TP, count, decode TP, count within gpus), each at its highest sustained rate; the
// best of each kind by goodput per GPU (ties: higher total rate, then fewer GPUs).
absl::StatusOr<PlanResult> SearchPlacement(const InstanceFactory& factory,
                                           const SearchOptions& options);

}  // namespace tandem::tools
