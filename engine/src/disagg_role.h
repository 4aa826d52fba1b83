// What an engine's disaggregation role (EngineOptions::role) changes in LlmEngine, in one
// object, so that the serving loop itself does not branch on the role:
//   - prefill: a sample whose first token does not end it leaves the engine at the hand-over
//     point with its prompt KV (a PrefillHandoff, held here until TakeHandoffs);
//   - decode: requests continued from prefilled samples (AddPrefilled) report their first tokens
//     in the next Step(), without a step (held here until then);
//   - which SLO controller sizes the steps: the TPOT one (decode, colocated), the TTFT one
//     (prefill, colocated).
// Blocks change hands at one point only, LlmEngine::HandOver: for a prefill hand-off and for
// Park alike; this object never touches blocks or the scheduler.
#pragma once

#include <string>
#include <vector>

#include "tandem/engine/llm_engine.h"

namespace tandem::engine::internal {

class DisaggRole {
 public:
  explicit DisaggRole(EngineRole role) : role_(role) {}

  // "prefill", "decode" or "colocated" (step traces).
  const char* name() const;
  // Whether a sample whose first token does not end it is handed over instead of decoded.
  bool HandsOverPrefilled() const { return role_ == EngineRole::kPrefill; }
  // Whether the TPOT controller caps the running batch, the TTFT one the step's token budget.
  bool SizesDecodeBatch() const { return role_ != EngineRole::kPrefill; }
  bool SizesPrefillSteps() const { return role_ != EngineRole::kDecode; }

  // Prefill: a sample handed over, and those handed over since the last call.
  void AddHandoff(PrefillHandoff handoff) { handoffs_.push_back(std::move(handoff)); }
  std::vector<PrefillHandoff> TakeHandoffs();

  // Decode: the first tokens of a request continued from prefilled samples, returned by the
  // next Step(); dropped when the request is aborted first.
  void AddFirstTokens(RequestOutput output) { first_tokens_.push_back(std::move(output)); }
  std::vector<RequestOutput> TakeFirstTokens();
  void DropFirstTokens(const std::string& request_id);
  bool HasFirstTokens(const std::string& request_id) const;
  bool has_first_tokens() const { return !first_tokens_.empty(); }

 private:
  EngineRole role_;
  std::vector<PrefillHandoff> handoffs_;     // not yet taken
  std::vector<RequestOutput> first_tokens_;  // not yet returned by Step()
};

}  // namespace tandem::engine::internal
