// A record of every engine step and of each request's first-token latency inside the engine,
// written as JSON lines, so that a latency model can be calibrated from steps measured inside a
// serving process (`tandem plan calibrate --trace`) rather than from an engine run alone.
//
//   TANDEM_ASSIGN_OR_RETURN(auto trace, StepTrace::Open("/tmp/steps.jsonl"));
//   options.step_trace = trace;  // EngineOptions; one trace may be shared by several engines
//
// Lines (one JSON object each; "t" is the Unix time in seconds when the line was written):
//   {"role":"colocated","t":..,"step_s":..,"gap_s":..,"tokens":..,"prefill_tokens":..,
//    "seqs":..,"context":..}
//   {"role":"colocated","t":..,"request_id":"..","first_token_s":..,"prompt_tokens":..}
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace tandem::engine {

// One measured step: its shape as the latency model sees it, its time, and the time the caller
// spent between the previous step's end and this one's start (streaming, RPCs), or a negative
// value when the engine had no work pending in between.
struct StepRecord {
  double seconds = 0;
  double gap_seconds = -1;
  int64_t tokens = 0;
  int64_t prefill_tokens = 0;  // of `tokens`, prompt tokens (prefill chunks)
  int64_t seqs = 0;
  int64_t context = 0;  // sum over the step's sequences of computed + new tokens
};

class StepTrace {
 public:
  // Creates (truncates) `path`.
  static absl::StatusOr<std::shared_ptr<StepTrace>> Open(const std::string& path);
  ~StepTrace();
  StepTrace(const StepTrace&) = delete;
  StepTrace& operator=(const StepTrace&) = delete;

  // Thread-safe; a failed write is counted, not fatal (the trace is a measurement aid).
  // `role` names the engine ("colocated", "prefill", "decode").
  void RecordStep(std::string_view role, const StepRecord& step);
  // Seconds from the request's arrival (GenerateRequest::arrival: at the engine's owner, so a
  // wait for the step then running counts) to the end of the step that sampled its first token.
  // `request_id` is the engine's (the API's response id on a colocated server; the router's id,
  // with a "~N" suffix on a retry, on a prefill worker).
  void RecordFirstToken(std::string_view role, std::string_view request_id, int64_t prompt_tokens,
                        double seconds);
  int64_t failed_writes() const;

 private:
  explicit StepTrace(std::FILE* file) : file_(file) {}
  void Write(const std::string& line);

  mutable std::mutex mu_;
  std::FILE* file_;
  int64_t failed_writes_ = 0;  // guarded by mu_
};

}  // namespace tandem::engine
