// What moves a sample from one engine to another: a prefill engine's hand-off of a computed
// prompt, the state a decode engine continues a sample from, and a sample parked with its KV.
// Part of the engine API so that the control plane's conversions (tandem::wire) need no engine.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "tandem/engine/request.h"

namespace tandem::engine {

// A sequence's logical-to-physical block map: block i holds tokens [i*B, (i+1)*B).
using BlockTable = std::vector<int32_t>;

// A sequence whose prompt a prefill-role engine has computed, ready to continue on a decode
// engine: its first token, the sampler stream, and the blocks holding its prompt KV (valid
// until LlmEngine::ReleaseHandoff).
struct PrefillHandoff {
  std::string request_id;
  int choice_index = 0;
  int32_t first_token = 0;
  float first_logprob = 0.0f;
  std::vector<TokenLogprob> first_top_logprobs;
  std::array<uint64_t, 4> rng_state{};
  BlockTable blocks;  // prefill engine's blocks: KV of the prompt tokens
};

// What a decode-role engine needs of one sample to continue it (see AddPrefilled).
struct PrefilledChoice {
  int32_t first_token = 0;
  float first_logprob = 0.0f;
  std::vector<TokenLogprob> first_top_logprobs;
  std::array<uint64_t, 4> rng_state{};
  BlockTable blocks;  // this engine's reserved blocks, now holding the prompt KV
  // A continuation of a sample another decode engine parked (Park): every token it generated
  // so far (first_token is then not used), and how many tokens of prompt + generated have their
  // KV in `blocks` (at least one, fewer than all). The sample goes on from the next token.
  std::vector<int32_t> generated;
  int num_kv_tokens = 0;
};

// An unfinished sample taken out of a decode engine with its KV (LlmEngine::Park), in the form
// AddPrefilled takes to continue it: `state.generated`, `state.num_kv_tokens`,
// `state.rng_state` and `state.blocks` (now the caller's: free them with FreeReservation).
// num_kv_tokens is 0 and blocks empty when the sample had been preempted (no KV to move).
struct ParkedSample {
  int choice_index = 0;
  PrefilledChoice state;
};

}  // namespace tandem::engine
