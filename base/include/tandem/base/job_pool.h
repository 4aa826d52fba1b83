// A fixed set of threads that run posted jobs in order of posting, for work that may block for
// a while (compiling a grammar, connecting to a peer) and must not hold the thread that received
// it: an HTTP I/O thread, a gRPC callback thread.
//
//   base::JobPool pool(4);
//   pool.Post([call] { call->Answer(Prepare()); },   // runs on one of the pool's threads
//             [call] { call->Answer(Stopped()); });  // or this, if the pool stopped first
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tandem::base {

class JobPool {
 public:
  // Starts the threads. A job sees what the posting thread did before Post, and what the
  // creating thread did before creating the pool; so create the pool after setting up what its
  // jobs read, or hand that over in each job.
  explicit JobPool(int num_threads);
  // Stop().
  ~JobPool();
  JobPool(const JobPool&) = delete;
  JobPool& operator=(const JobPool&) = delete;

  // Queues `run`. Returns false, and runs neither function, once Stop() has begun. `dropped`,
  // if given, runs instead of `run` when the pool stops before `run` starts (on the thread
  // calling Stop), so that work owed an answer always gets one.
  bool Post(std::function<void()> run, std::function<void()> dropped = nullptr);

  // Refuses new jobs, runs the `dropped` of the jobs not started, waits for the running ones
  // and joins the threads. Later calls return at once.
  void Stop();

 private:
  struct Job {
    std::function<void()> run;
    std::function<void()> dropped;
  };
  void Work();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;  // guarded by mu_
  bool stopping_ = false;  // guarded by mu_
  std::vector<std::thread> threads_;
  std::once_flag stop_once_;
};

}  // namespace tandem::base
