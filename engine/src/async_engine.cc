#include "tandem/engine/async_engine.h"

#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"

namespace tandem::engine {

absl::StatusOr<std::unique_ptr<AsyncEngine>> AsyncEngine::Create(const EngineOptions& options) {
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<LlmEngine> engine, LlmEngine::Create(options));
  return std::unique_ptr<AsyncEngine>(new AsyncEngine(std::move(engine)));
}

AsyncEngine::AsyncEngine(std::unique_ptr<LlmEngine> engine) : engine_(std::move(engine)) {
  stats_ = engine_->stats();
  thread_ = std::thread([this] { Loop(); });
}

AsyncEngine::~AsyncEngine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

absl::Status AsyncEngine::Submit(GenerateRequest request, OutputCallback callback) {
  TANDEM_RETURN_IF_ERROR(engine_->Validate(request));
  if (request.arrival == std::chrono::steady_clock::time_point{}) {
    request.arrival = std::chrono::steady_clock::now();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return absl::UnavailableError("the engine is shutting down");
    if (!callbacks_.emplace(request.request_id, std::move(callback)).second) {
      return absl::AlreadyExistsError(absl::StrCat("request ", request.request_id, " exists"));
    }
    pending_adds_.emplace_back(std::move(request), nullptr);
  }
  wake_.notify_one();
  return absl::OkStatus();
}

void AsyncEngine::Abort(const std::string& request_id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (callbacks_.erase(request_id) == 0) return;
    pending_aborts_.push_back(request_id);
  }
  wake_.notify_one();
}

EngineStats AsyncEngine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

int AsyncEngine::num_active() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(callbacks_.size());
}

void AsyncEngine::Loop() {
  std::vector<std::pair<OutputCallback, std::pair<RequestOutput, absl::Status>>> deliveries;
  for (;;) {
    std::deque<std::pair<GenerateRequest, OutputCallback>> adds;
    std::deque<std::string> aborts;
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] {
        return stopping_ || !pending_adds_.empty() || !pending_aborts_.empty() ||
               engine_->has_unfinished();
      });
      if (stopping_) break;
      adds.swap(pending_adds_);
      aborts.swap(pending_aborts_);
    }
    // Aborts first: a request submitted and aborted before this point never starts.
    for (const std::string& id : aborts) engine_->Abort(id);
    for (auto& [request, unused] : adds) {
      std::string id = request.request_id;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (callbacks_.count(id) == 0) continue;  // aborted while queued
      }
      absl::Status status = engine_->AddRequest(std::move(request));
      if (!status.ok()) {
        OutputCallback cb;
        {
          std::lock_guard<std::mutex> lock(mu_);
          auto it = callbacks_.find(id);
          if (it != callbacks_.end()) {
            cb = std::move(it->second);
            callbacks_.erase(it);
          }
        }
        RequestOutput failed;
        failed.request_id = id;
        failed.finished = true;
        if (cb) cb(failed, status);
      }
    }
    if (!engine_->has_unfinished()) {
      std::lock_guard<std::mutex> lock(mu_);
      stats_ = engine_->stats();
      continue;
    }

    absl::StatusOr<std::vector<RequestOutput>> outputs = engine_->Step();
    deliveries.clear();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!outputs.ok()) {
        // A failed step leaves no request in a known state: fail and drop all of them.
        for (auto& [id, cb] : callbacks_) {
          RequestOutput failed;
          failed.request_id = id;
          failed.finished = true;
          deliveries.push_back({std::move(cb), {failed, outputs.status()}});
          engine_->Abort(id);
        }
        callbacks_.clear();
      } else {
        for (RequestOutput& out : *outputs) {
          auto it = callbacks_.find(out.request_id);
          if (it == callbacks_.end()) {
            // Aborted by the client while this step ran.
            engine_->Abort(out.request_id);
            continue;
          }
          if (out.finished) {
            deliveries.push_back({std::move(it->second), {std::move(out), absl::OkStatus()}});
            callbacks_.erase(it);
          } else {
            deliveries.push_back({it->second, {std::move(out), absl::OkStatus()}});
          }
        }
      }
      stats_ = engine_->stats();
    }
    for (auto& [cb, payload] : deliveries) cb(payload.first, payload.second);
  }

  // Shutting down: tell every waiting client.
  std::unordered_map<std::string, OutputCallback> remaining;
  {
    std::lock_guard<std::mutex> lock(mu_);
    remaining.swap(callbacks_);
  }
  for (auto& [id, cb] : remaining) {
    RequestOutput out;
    out.request_id = id;
    out.finished = true;
    cb(out, absl::UnavailableError("the engine is shutting down"));
  }
}

}  // namespace tandem::engine
