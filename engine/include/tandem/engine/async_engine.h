// A thread-safe front for LlmEngine: one background thread runs the engine loop, any thread
// submits and aborts requests, and outputs arrive through per-request callbacks.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

#include "absl/status/statusor.h"
#include "tandem/engine/generator.h"
#include "tandem/engine/llm_engine.h"

namespace tandem::engine {

//   TANDEM_ASSIGN_OR_RETURN(auto engine, AsyncEngine::Create(options));
//   TANDEM_RETURN_IF_ERROR(engine->Submit(std::move(request), [](auto& out, auto& st) {...}));
//   engine->Abort(request_id);  // e.g. when the client goes away
class AsyncEngine : public Generator {
 public:
  static absl::StatusOr<std::unique_ptr<AsyncEngine>> Create(const EngineOptions& options);
  // Stops the loop; requests still running get a final callback with an Unavailable status.
  ~AsyncEngine() override;

  // Validates like LlmEngine::AddRequest (the same errors, returned here, synchronously) and
  // queues the request. AlreadyExists for an id that is still running.
  absl::Status Submit(GenerateRequest request, OutputCallback callback) override;
  absl::Status PrepareConstraint(const SamplingParams& params) const override {
    return engine_->PrepareConstraint(params);
  }
  // Cancels a request; its KV blocks are freed before the next step. Its callback is not
  // called again. Unknown ids are ignored.
  void Abort(const std::string& request_id) override;

  // Immutable after Create: safe from any thread.
  const text::ModelConfig& config() const override { return engine_->config(); }
  const text::Tokenizer& tokenizer() const override { return engine_->tokenizer(); }
  const text::ChatFormatter& chat_formatter() const override { return engine_->chat_formatter(); }
  int max_model_len() const override { return engine_->max_model_len(); }

  // Snapshot taken after the latest step.
  EngineStats stats() const override;
  // Requests submitted and not yet finished or aborted.
  int num_active() const override;

 private:
  explicit AsyncEngine(std::unique_ptr<LlmEngine> engine);
  void Loop();

  std::unique_ptr<LlmEngine> engine_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::deque<std::pair<GenerateRequest, OutputCallback>> pending_adds_;  // guarded by mu_
  std::deque<std::string> pending_aborts_;                               // guarded by mu_
  std::unordered_map<std::string, OutputCallback> callbacks_;            // guarded by mu_
  EngineStats stats_;                                                    // guarded by mu_
  bool stopping_ = false;                                                // guarded by mu_
  std::thread thread_;
};

}  // namespace tandem::engine
