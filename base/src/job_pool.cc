#include "tandem/base/job_pool.h"

#include <utility>

namespace tandem::base {

JobPool::JobPool(int num_threads) {
  if (num_threads < 1) num_threads = 1;
  threads_.reserve(num_threads);
  for (int i = 0; i < num_threads; ++i) threads_.emplace_back([this] { Work(); });
}

JobPool::~JobPool() { Stop(); }

bool JobPool::Post(std::function<void()> run, std::function<void()> dropped) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return false;
    jobs_.push_back(Job{std::move(run), std::move(dropped)});
  }
  cv_.notify_one();
  return true;
}

void JobPool::Stop() {
  std::call_once(stop_once_, [this] {
    std::deque<Job> left;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      left.swap(jobs_);
    }
    cv_.notify_all();
    for (Job& job : left) {
      if (job.dropped) job.dropped();
    }
    for (std::thread& thread : threads_) thread.join();
  });
}

void JobPool::Work() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, and nothing left to start
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job.run();
  }
}

}  // namespace tandem::base
