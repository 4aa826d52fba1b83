#include "kernels/src/cpu/thread_pool.h"

#include <chrono>

#include "absl/status/status.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TANDEM_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define TANDEM_CPU_RELAX() asm volatile("yield")
#else
#define TANDEM_CPU_RELAX() \
  do {                     \
  } while (0)
#endif

namespace tandem::kernels::cpu {
namespace {

// How long an idle worker polls for the next job before sleeping. Between two ops of a decode
// step the gap is a few microseconds; between two steps it can be much longer, and a sleeping
// worker costs a futex wake (several microseconds) on the next job.
constexpr auto kSpinBeforeSleep = std::chrono::microseconds(200);

// Waits until done() holds: polls briefly, then yields the core between polls, since on a
// shared machine the thread being waited for may be descheduled.
template <typename Done>
void SpinUntil(const Done& done) {
  for (int spins = 0; !done(); ++spins) {
    if (spins < 4096) {
      TANDEM_CPU_RELAX();
    } else {
      std::this_thread::yield();
    }
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<ThreadPool>> ThreadPool::Create(int num_threads) {
  if (num_threads < 1 || num_threads > 1024) {
    return absl::InvalidArgumentError("ThreadPool needs between 1 and 1024 threads");
  }
  std::unique_ptr<ThreadPool> pool(new ThreadPool());
  pool->workers_.reserve(num_threads - 1);
  for (int t = 1; t < num_threads; ++t) {
    pool->workers_.emplace_back([p = pool.get(), t] { p->WorkerLoop(t); });
  }
  return pool;
}

ThreadPool::~ThreadPool() {
  stop_.store(true);
  epoch_.fetch_add(2);
  epoch_.notify_all();
  for (std::thread& w : workers_) w.join();
}

void ThreadPool::Run(int64_t n, int64_t grain, ChunkFn fn, const void* ctx) {
  // A worker that saw the previous job open may still be inside it (finding no chunk left);
  // the job fields must not change under it.
  SpinUntil([&] { return active_.load() == 0; });
  fn_ = fn;
  ctx_ = ctx;
  n_ = n;
  grain_ = grain;
  num_chunks_ = (n + grain - 1) / grain;
  next_chunk_.store(0, std::memory_order_relaxed);
  done_chunks_.store(0, std::memory_order_relaxed);
  // Open the job (odd epoch). Sequentially consistent with the sleepers_ check below, paired with
  // the worker's increment of sleepers_ before it sleeps: one of the two sees the other.
  epoch_.fetch_add(1);
  if (sleepers_.load() > 0) epoch_.notify_all();

  Work(0);
  SpinUntil([&] { return done_chunks_.load(std::memory_order_acquire) == num_chunks_; });
  // Close the job (even epoch) so that late workers do not enter it.
  epoch_.fetch_add(1);
}

void ThreadPool::Work(int thread) {
  for (;;) {
    const int64_t chunk = next_chunk_.fetch_add(1, std::memory_order_relaxed);
    if (chunk >= num_chunks_) return;
    const int64_t begin = chunk * grain_;
    const int64_t end = begin + grain_ < n_ ? begin + grain_ : n_;
    fn_(ctx_, begin, end, thread);
    done_chunks_.fetch_add(1, std::memory_order_release);
  }
}

void ThreadPool::WorkerLoop(int thread) {
  uint32_t seen = epoch_.load();
  while (!stop_.load(std::memory_order_relaxed)) {
    uint32_t epoch = epoch_.load();
    if (epoch == seen) {
      auto deadline = std::chrono::steady_clock::now() + kSpinBeforeSleep;
      for (int i = 0; (epoch = epoch_.load(std::memory_order_relaxed)) == seen; ++i) {
        TANDEM_CPU_RELAX();
        if ((i & 255) == 255 && std::chrono::steady_clock::now() > deadline) {
          sleepers_.fetch_add(1);
          epoch_.wait(seen);  // returns at once if epoch_ has moved on
          sleepers_.fetch_sub(1);
          deadline = std::chrono::steady_clock::now() + kSpinBeforeSleep;
        }
      }
      continue;
    }
    seen = epoch;
    if ((epoch & 1) == 0) continue;  // closed: nothing to do
    active_.fetch_add(1);
    // Re-check after announcing ourselves: if the job was closed in between, the caller may
    // already be writing the next one, and we must not read its fields.
    if (epoch_.load() == epoch) Work(thread);
    active_.fetch_sub(1);
  }
}

}  // namespace tandem::kernels::cpu
