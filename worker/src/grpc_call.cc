#include "tandem/worker/grpc_call.h"

#include <limits>

namespace tandem::worker {

absl::Time FromUnixMillisOrInfinite(int64_t ms) {
  return ms > 0 ? absl::FromUnixMillis(ms) : absl::InfiniteFuture();
}

int64_t ToUnixMillisOrZero(absl::Time time) {
  return time == absl::InfiniteFuture() ? 0 : absl::ToUnixMillis(time);
}

absl::Time CallDeadline(const grpc::ServerContextBase& context) {
  const gpr_timespec raw = context.raw_deadline();
  if (raw.tv_sec == std::numeric_limits<int64_t>::max()) return absl::InfiniteFuture();
  return absl::FromChrono(context.deadline());
}

}  // namespace tandem::worker
