#include "tandem/engine/step_trace.h"

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

namespace tandem::engine {

absl::StatusOr<std::shared_ptr<StepTrace>> StepTrace::Open(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "w");
  if (file == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot write the step trace ", path, ": ", std::strerror(errno)));
  }
  return std::shared_ptr<StepTrace>(new StepTrace(file));
}

StepTrace::~StepTrace() { std::fclose(file_); }

void StepTrace::RecordStep(std::string_view role, const StepRecord& step) {
  Write(absl::StrFormat(
      "{\"role\":\"%s\",\"t\":%.6f,\"step_s\":%.9g,\"gap_s\":%.9g,\"tokens\":%d,"
      "\"prefill_tokens\":%d,\"seqs\":%d,\"context\":%d}\n",
      role, absl::ToUnixMicros(absl::Now()) / 1e6, step.seconds, step.gap_seconds, step.tokens,
      step.prefill_tokens, step.seqs, step.context));
}

void StepTrace::RecordFirstToken(std::string_view role, std::string_view request_id,
                                 int64_t prompt_tokens, double seconds) {
  // Request ids are the router's or the engine's own (letters, digits, '-', '~'); anything but
  // printable ASCII, or what a JSON string could not hold as is, is left out, not escaped.
  std::string id;
  for (char c : request_id) {
    if (c != '"' && c != '\\' && c >= 0x20 && c < 0x7f) id += c;
  }
  Write(absl::StrFormat(
      "{\"role\":\"%s\",\"t\":%.6f,\"request_id\":\"%s\",\"first_token_s\":%.9g,"
      "\"prompt_tokens\":%d}\n",
      role, absl::ToUnixMicros(absl::Now()) / 1e6, id, seconds, prompt_tokens));
}

int64_t StepTrace::failed_writes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_writes_;
}

void StepTrace::Write(const std::string& line) {
  std::lock_guard<std::mutex> lock(mu_);
  // Flushed per line: a trace read while the server runs (or after it was killed) is whole.
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0) {
    ++failed_writes_;
  }
}

}  // namespace tandem::engine
