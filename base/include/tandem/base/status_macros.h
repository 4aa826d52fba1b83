// Status helpers used at every module boundary.
//
// The packaged Abseil predates absl's own macros, so Tandem carries these:
//   TANDEM_RETURN_IF_ERROR(expr);              returns a non-OK absl::Status.
//   TANDEM_ASSIGN_OR_RETURN(auto x, expr);     unwraps an absl::StatusOr or returns its error.
//   TANDEM_CHECK(cond) << "why";               aborts on a programmer error (never on bad input).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define TANDEM_STATUS_CONCAT_INNER_(a, b) a##b
#define TANDEM_STATUS_CONCAT_(a, b) TANDEM_STATUS_CONCAT_INNER_(a, b)

#define TANDEM_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::absl::Status tandem_status_ = (expr);          \
    if (!tandem_status_.ok()) return tandem_status_; \
  } while (0)

#define TANDEM_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return std::move(tmp).status();      \
  lhs = std::move(tmp).value()

#define TANDEM_ASSIGN_OR_RETURN(lhs, expr) \
  TANDEM_ASSIGN_OR_RETURN_IMPL_(TANDEM_STATUS_CONCAT_(tandem_statusor_, __LINE__), lhs, expr)

namespace tandem::internal {
// Streams a message, then aborts when destroyed. Used only by TANDEM_CHECK.
class CheckFailure {
 public:
  CheckFailure(const char* file, int line, const char* cond) {
    stream_ << file << ":" << line << ": check failed: " << cond << " ";
  }
  [[noreturn]] ~CheckFailure() {
    std::fprintf(stderr, "%s\n", stream_.str().c_str());
    std::abort();
  }
  std::ostream& stream() { return stream_; }

 private:
  std::ostringstream stream_;
};
}  // namespace tandem::internal

#define TANDEM_CHECK(cond) \
  if (cond) {              \
  } else                   \
    ::tandem::internal::CheckFailure(__FILE__, __LINE__, #cond).stream()
