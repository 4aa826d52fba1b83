// What the HTTP front end generates with: one engine in this process (AsyncEngine) or a
// disaggregated pool of prefill and decode workers reached over the control plane
// (router::DisaggregatedGenerator). Both stream every request's output through a callback.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "tandem/engine/request.h"
#include "tandem/text/chat_template.h"
#include "tandem/text/model_config.h"
#include "tandem/text/tokenizer.h"

namespace tandem::engine {

// Receives every step's output for one request; the last call has `finished` set (or a non-OK
// `status`). It must return quickly (hand the data to an I/O thread): it runs on the thread
// that produces the output (the engine loop, or a control-plane stream reader).
using OutputCallback = std::function<void(const RequestOutput& output, const absl::Status& status)>;

// What a generator counts beyond EngineStats: the disaggregated router's pools and failovers
// (all zero for one engine).
struct GeneratorCounters {
  int64_t prefill_retries = 0;  // requests started over after their prefill worker went away
  int64_t migrations = 0;       // streams recomputed on another decode worker mid-generation
  int64_t kv_handoffs = 0;      // samples moved to another decode worker with their KV (drain)
  int64_t kv_handoff_bytes = 0;  // KV bytes those handoffs moved
  int prefill_workers = 0;      // in the pools ...
  int decode_workers = 0;
  int prefill_workers_up = 0;   // ... of which answering Stats
  int decode_workers_up = 0;
  // KV-aware routing: block hashes the router's index holds per worker id, and workers chosen
  // per {pool ("prefill" or "decode"), reason ("kv_hit", "kv_miss" or "load")}.
  std::map<std::string, int64_t> kv_index_blocks;
  std::map<std::pair<std::string, std::string>, int64_t> routing_decisions;
};

class Generator {
 public:
  virtual ~Generator() = default;

  // Validates the request (InvalidArgument naming the field, as LlmEngine::AddRequest) and
  // starts it; its outputs then arrive through `callback`. AlreadyExists for an id in flight;
  // ResourceExhausted or Unavailable when no capacity is left to take it now.
  virtual absl::Status Submit(GenerateRequest request, OutputCallback callback) = 0;
  // Compiles the structured-output constraint of `params` for this generator's engine, on the
  // calling thread, so that a Submit soon after finds it compiled (a bounded JSON schema takes
  // seconds for a 128k vocabulary). Safe from any thread; a no-op where no engine is local.
  virtual absl::Status PrepareConstraint(const SamplingParams& params) const {
    return absl::OkStatus();
  }
  // Cancels a request and frees its KV blocks wherever they are; its callback is not called
  // again. Unknown ids are ignored.
  virtual void Abort(const std::string& request_id) = 0;

  // Whether the thread that calls an OutputCallback may do the caller's work on it (write the
  // output to a client) instead of handing it over and returning at once: true where outputs
  // arrive on network threads of their own (the router's gRPC threads), false where they
  // arrive on an engine thread whose next step waits for the callback to return.
  virtual bool callbacks_may_work() const { return false; }

  // Immutable after creation: safe from any thread.
  virtual const text::ModelConfig& config() const = 0;
  virtual const text::Tokenizer& tokenizer() const = 0;
  virtual const text::ChatFormatter& chat_formatter() const = 0;
  virtual int max_model_len() const = 0;

  // The latest snapshot of running/waiting requests and KV blocks (summed over workers).
  virtual EngineStats stats() const = 0;
  // Requests submitted and not yet finished or aborted.
  virtual int num_active() const = 0;
  virtual GeneratorCounters counters() const { return {}; }
};

}  // namespace tandem::engine
