// A persistent pool of worker threads with a low-latency parallel-for.
//
// A decode step calls ParallelFor hundreds of times on small pieces of work, so dispatch must
// cost microseconds, not a condition-variable round trip: workers spin on an epoch counter for
// a short while after each job and only then sleep on it (a futex), and the calling thread
// takes part in the work instead of waiting idle.
//
//   TANDEM_ASSIGN_OR_RETURN(auto pool, ThreadPool::Create(2));
//   pool->ParallelFor(num_panels, /*grain=*/4, [&](int64_t begin, int64_t end, int thread) {
//     for (int64_t p = begin; p < end; ++p) ComputePanel(p, scratch[thread]);
//   });
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem::kernels::cpu {

class ThreadPool {
 public:
  // num_threads counts the calling thread: a pool of 2 starts one worker.
  static absl::StatusOr<std::unique_ptr<ThreadPool>> Create(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(begin, end, thread) on disjoint ranges covering [0, n), on every thread of the
  // pool, and returns when all are done. Ranges are `grain` items (the last may be shorter), or
  // the whole of [0, n) when the pool has one thread or n <= grain. `thread` is in
  // [0, num_threads()) and no two concurrent calls of fn share one, so it can index per-thread
  // scratch. Ranges are handed out dynamically, so which thread runs which range varies from
  // call to call: fn must not let its results depend on it. Not reentrant: fn must not call
  // ParallelFor, and one thread at a time may use the pool.
  template <typename Fn>
  void ParallelFor(int64_t n, int64_t grain, const Fn& fn) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    if (workers_.empty() || n <= grain) {
      fn(int64_t{0}, n, 0);
      return;
    }
    Run(n, grain, &Trampoline<Fn>, &fn);
  }

 private:
  using ChunkFn = void (*)(const void* ctx, int64_t begin, int64_t end, int thread);

  template <typename Fn>
  static void Trampoline(const void* ctx, int64_t begin, int64_t end, int thread) {
    (*static_cast<const Fn*>(ctx))(begin, end, thread);
  }

  ThreadPool() = default;
  void Run(int64_t n, int64_t grain, ChunkFn fn, const void* ctx);
  // Takes chunks of the current job until none are left.
  void Work(int thread);
  void WorkerLoop(int thread);

  // The job being run; written only while no worker is inside it (see Run).
  ChunkFn fn_ = nullptr;
  const void* ctx_ = nullptr;
  int64_t n_ = 0;
  int64_t grain_ = 1;
  int64_t num_chunks_ = 0;

  // Odd while a job is open to workers, even once it is closed; each Run adds 2 in total.
  alignas(64) std::atomic<uint32_t> epoch_{0};
  // Workers that have entered the open job and not yet left it.
  alignas(64) std::atomic<int> active_{0};
  alignas(64) std::atomic<int64_t> next_chunk_{0};
  alignas(64) std::atomic<int64_t> done_chunks_{0};
  // Workers asleep (or about to sleep) on epoch_; the caller skips the wake syscall when zero.
  alignas(64) std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::vector<std::thread> workers_;
};

}  // namespace tandem::kernels::cpu
