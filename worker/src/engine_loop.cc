#include "tandem/worker/engine_loop.h"

#include <algorithm>
#include <chrono>
#include <utility>
#include <vector>

namespace tandem::worker {

EngineLoop::EngineLoop(Options options) : options_(std::move(options)) {
  if (!options_.clock) options_.clock = [] { return absl::Now(); };
  if (!options_.drained) options_.drained = [] { return true; };
  if (!options_.iterate) options_.iterate = [] { return absl::InfiniteDuration(); };
}

void EngineLoop::Start() {
  if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
}

EngineLoop::~EngineLoop() { Stop(); }

// Posters notify while holding the lock: once the loop thread has seen the post it may finish,
// and the loop be destroyed, while a poster that had already unlocked was still inside
// notify_all on the destroyed condition variable.
bool EngineLoop::Post(std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_) return false;
  posted_.push_back(std::move(fn));
  wake_.notify_all();
  return true;
}

void EngineLoop::Wake() {
  std::lock_guard<std::mutex> lock(mu_);
  wake_requested_ = true;
  wake_.notify_all();
}

void EngineLoop::SetDeadline(std::string key, absl::Time when, std::function<void()> on_expiry) {
  ClearDeadline(key);
  by_time_.emplace(when, key);
  deadlines_[std::move(key)] = {when, std::move(on_expiry)};
}

void EngineLoop::ClearDeadline(const std::string& key) {
  auto it = deadlines_.find(key);
  if (it == deadlines_.end()) return;
  by_time_.erase({it->second.when, key});
  deadlines_.erase(it);
}

void EngineLoop::RequestStop() {
  std::lock_guard<std::mutex> lock(mu_);
  stop_requested_ = true;
  wake_.notify_all();
}

void EngineLoop::Stop() {
  RequestStop();
  std::call_once(joined_, [this] {
    if (thread_.joinable()) thread_.join();
  });
}

absl::Time EngineLoop::SweepDeadlines() {
  const absl::Time now = options_.clock();
  while (!by_time_.empty() && by_time_.begin()->first <= now) {
    const std::string key = by_time_.begin()->second;
    by_time_.erase(by_time_.begin());
    auto it = deadlines_.find(key);
    std::function<void()> on_expiry = std::move(it->second.on_expiry);
    deadlines_.erase(it);
    on_expiry();  // may set or clear deadlines
  }
  return by_time_.empty() ? absl::InfiniteFuture() : by_time_.begin()->first;
}

void EngineLoop::Run() {
  absl::Duration sleep = absl::ZeroDuration();
  absl::Time next_deadline = absl::InfiniteFuture();
  while (true) {
    std::deque<std::function<void()>> posted;
    {
      std::unique_lock<std::mutex> lock(mu_);
      absl::Duration wait = std::min(sleep, options_.idle_wake);
      if (next_deadline != absl::InfiniteFuture()) {
        wait = std::min(wait, std::max(next_deadline - options_.clock(), absl::ZeroDuration()));
      }
      const bool stop_news = stop_requested_ && !stop_since_.has_value();
      if (posted_.empty() && !wake_requested_ && !stop_news && wait > absl::ZeroDuration()) {
        wake_.wait_for(lock, absl::ToChronoNanoseconds(wait));
      }
      posted.swap(posted_);
      wake_requested_ = false;
      if (stop_requested_ && !stop_since_.has_value()) stop_since_ = options_.clock();
    }
    for (std::function<void()>& fn : posted) fn();
    posted.clear();
    next_deadline = SweepDeadlines();
    sleep = options_.iterate();
    if (!stop_since_.has_value() || !options_.drained()) continue;
    std::lock_guard<std::mutex> lock(mu_);
    if (posted_.empty()) {
      finished_ = true;
      break;
    }
  }
  if (options_.finish) options_.finish();
}

}  // namespace tandem::worker
