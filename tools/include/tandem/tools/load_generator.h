// Load generator behind `tandem bench`: sends streaming requests to an OpenAI-compatible endpoint
// on a Poisson or gamma arrival schedule, records per-request latencies and summarizes them.
//
//   LoadConfig config;
//   config.url = "http://127.0.0.1:8000";
//   config.model = "tiny";
//   std::vector<BenchRequest> requests = SyntheticRequests(16, 8, 20, /*seed=*/0);
//   absl::StatusOr<BenchResult> result = RunLoad(config, requests);
//
// The arithmetic (percentiles, arrival times, SLO attainment) is exposed as pure functions.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace tandem::tools {

// One request to send: its prompt and how many tokens to ask for. In a multi-turn conversation
// (`conversation` >= 0), turn k > 0 is sent once turn k - 1 of the same conversation finished,
// with that turn's prompt and answer before its own `prompt` (the user's new message): the
// history is resent, as chat clients do.
struct BenchRequest {
  std::string prompt;
  int64_t max_tokens = 16;
  int64_t conversation = -1;
  int turn = 0;
};

// What was measured for one request. Times are seconds.
struct RequestRecord {
  bool success = false;
  std::string error;          // set when !success
  double start = 0;           // send time, relative to the start of the run
  double ttft = 0;            // time to the first content chunk
  double e2e = 0;             // time to the end of the stream
  std::vector<double> itls;   // gaps between consecutive content chunks
  int64_t output_tokens = 0;  // from the usage chunk (content chunk count when absent)
  int64_t prompt_tokens = 0;
  std::string id;  // the response's "id" (the server's request id), when it sent one
  std::string text;  // the streamed answer
  int turn = 0;      // BenchRequest::turn
  // (e2e - ttft) / (output_tokens - 1); 0 with fewer than two tokens.
  double Tpot() const;
};

struct LoadConfig {
  std::string url;  // http://host:port, optionally followed by /v1
  std::string model;
  std::string endpoint = "completions";  // or "chat"
  std::string api_key;
  double request_rate = 0;      // requests/s; <= 0 or inf: all at once
  double burstiness = 1.0;      // gamma shape; 1 = Poisson
  int64_t max_concurrency = 0;  // 0 = unbounded
  // Multi-turn: when set, a user reads each answer this many seconds before sending the next
  // turn, and max_concurrency counts turns in flight (first come, first served), so other
  // conversations' turns run in between. Unset: a conversation holds its slot from its first
  // turn to its last.
  std::optional<double> think_time;
  bool ignore_eos = true;
  uint64_t seed = 0;
  // A progress line on stderr, redrawn a few times a second (for a terminal), prefixed with
  // progress_label.
  bool progress = false;
  std::string progress_label;
};

// Mean and percentiles of one metric, in the unit of the samples.
struct MetricSummary {
  double mean = 0, p50 = 0, p90 = 0, p99 = 0;
};

struct BenchResult {
  std::vector<RequestRecord> records;
  double duration = 0;  // seconds from the first send to the last completion
};

// Percentile `p` in [0, 100] of `samples` with linear interpolation between closest ranks
// (numpy's default). 0 for an empty set.
double Percentile(std::vector<double> samples, double p);
MetricSummary Summarize(const std::vector<double>& samples);

// Send times (seconds from the start) of `n` requests: gamma-distributed gaps with shape
// `burstiness` and mean 1/rate (burstiness 1 is a Poisson process). rate <= 0 or infinite:
// all zero.
std::vector<double> ArrivalTimes(int64_t n, double rate, double burstiness, uint64_t seed);

// Fraction of successful requests meeting both TTFT <= ttft_slo and TPOT <= tpot_slo, over all
// requests (failed requests miss). 0 for none.
double SloAttainment(const std::vector<RequestRecord>& records, double ttft_slo, double tpot_slo);
// Requests per second meeting both SLOs.
double Goodput(const std::vector<RequestRecord>& records, double duration, double ttft_slo,
               double tpot_slo);

// `n` prompts of `input_len` random words each, asking for `output_len` tokens.
std::vector<BenchRequest> SyntheticRequests(int64_t input_len, int64_t output_len, int64_t n,
                                            uint64_t seed);
// One prompt per entry: input_lens[i] random words, asking for output_lens[i] tokens (the two
// have the same size). With constant lengths, the same prompts as the overload above.
std::vector<BenchRequest> SyntheticRequests(const std::vector<int64_t>& input_lens,
                                            const std::vector<int64_t>& output_lens,
                                            uint64_t seed);

// `conversations` conversations of `turns` turns each (conversation-major): every turn is a user
// message of `message_len` random words (0 with a system prompt: the prompt is the system
// prompt alone), asking for `output_len` tokens; the first turn of every conversation starts
// with the same `system_prompt_len` random words (0: none).
std::vector<BenchRequest> MultiTurnRequests(int64_t conversations, int turns,
                                            int64_t system_prompt_len, int64_t message_len,
                                            int64_t output_len, uint64_t seed);

// A distribution of synthetic prompt or output lengths.
//   fixed:     always `mean`
//   uniform:   integers in [mean - range, mean + range]
//   normal:    mean `mean`, standard deviation `std`, rounded
//   lognormal: a log-normal whose own mean and standard deviation are `mean` and `std`, rounded
// Every draw is clamped to at least 1.
struct LengthDist {
  std::string kind = "fixed";
  double mean = 32;
  int64_t range = 0;
  double std = 0;
};
// Checks the parameters: a known kind, mean >= 1, 0 <= range < mean for uniform, std > 0 for
// normal and lognormal. `flag` names the flag in the message (e.g. "--input-len").
absl::Status ValidateLengthDist(const LengthDist& dist, const std::string& flag);
// `n` lengths drawn from `dist`; the same seed gives the same lengths.
std::vector<int64_t> SampleLengths(const LengthDist& dist, int64_t n, uint64_t seed);
// Up to `n` requests from a ShareGPT-format file: prompt = first human turn; max_tokens =
// `output_len` when given, else the word count of the following gpt turn. Entries without a
// human turn are skipped; they are reused in order when the file has fewer than n.
absl::StatusOr<std::vector<BenchRequest>> ShareGptRequests(const std::string& path, int64_t n,
                                                           std::optional<int64_t> output_len);

// At most `limit` holders at once (0: unbounded), given out first come, first served: a
// holder that releases and asks again queues behind everyone already waiting. Thread-safe.
class FifoGate {
 public:
  explicit FifoGate(int64_t limit) : limit_(limit) {}
  void Acquire();
  void Release();
  // Threads blocked in Acquire.
  int64_t waiting() const;

 private:
  const int64_t limit_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  int64_t held_ = 0;         // guarded by mu_
  uint64_t next_ticket_ = 0;  // guarded by mu_: the next Acquire's place in line
  uint64_t serving_ = 0;      // guarded by mu_: the first ticket not yet let through
};

// Sends every request on its arrival time (threads, at most max_concurrency in flight) and
// waits for all. Per-request failures are recorded, not returned; an invalid URL is an error.
// Multi-turn requests: the arrival times are of conversations, whose turns follow one another
// (a failed turn ends its conversation: the later turns fail too); the concurrency limit is of
// conversations, or with think_time of turns.
absl::StatusOr<BenchResult> RunLoad(const LoadConfig& config,
                                    const std::vector<BenchRequest>& requests);

// The report as JSON: counts, duration, throughputs, metric summaries in milliseconds, SLO
// numbers when slos are given (> 0), per-request records, and for multi-turn runs the TTFT
// summary of each turn ("ttft_ms_by_turn").
nlohmann::json ReportJson(const BenchResult& result, double ttft_slo, double tpot_slo);
// The same numbers as a human-readable table.
std::string ReportTable(const nlohmann::json& report);
// Several reports side by side, one column each (headed by its "label" and "request_rate"
// fields when set): counts, throughputs, SLO attainment and goodput, then the mean, p50, p90 and
// p99 of each metric.
std::string ComparisonTable(const std::vector<nlohmann::json>& reports);

// The progress line of a run: label, a bar of finished/total, sent, failed and elapsed seconds.
std::string ProgressLine(const std::string& label, int64_t total, int64_t sent, int64_t finished,
                         int64_t failed, double elapsed);

// Plots of a set of reports (each with "label" and "request_rate" set, and its per-request
// records), as SVG documents by file name:
//   latency_cdf.svg         CDFs of TTFT, TPOT and E2E, one line per report
//   attainment_vs_rate.svg  SLO attainment, goodput and throughput against the request rate,
//                           one line per label; only when the reports carry SLO numbers and
//                           finite rates.
std::map<std::string, std::string> BenchPlots(const std::vector<nlohmann::json>& reports);

}  // namespace tandem::tools
