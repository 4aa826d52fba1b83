#include "disagg_role.h"

#include <algorithm>
#include <utility>

namespace tandem::engine::internal {

const char* DisaggRole::name() const {
  switch (role_) {
    case EngineRole::kPrefill:
      return "prefill";
    case EngineRole::kDecode:
      return "decode";
    default:
      return "colocated";
  }
}

std::vector<PrefillHandoff> DisaggRole::TakeHandoffs() {
  std::vector<PrefillHandoff> out;
  out.swap(handoffs_);
  return out;
}

std::vector<RequestOutput> DisaggRole::TakeFirstTokens() {
  std::vector<RequestOutput> out;
  out.swap(first_tokens_);
  return out;
}

void DisaggRole::DropFirstTokens(const std::string& request_id) {
  std::erase_if(first_tokens_,
                [&](const RequestOutput& out) { return out.request_id == request_id; });
}

bool DisaggRole::HasFirstTokens(const std::string& request_id) const {
  return std::any_of(first_tokens_.begin(), first_tokens_.end(),
                     [&](const RequestOutput& out) { return out.request_id == request_id; });
}

}  // namespace tandem::engine::internal
