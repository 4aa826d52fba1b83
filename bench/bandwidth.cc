#include "bench/bandwidth.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

namespace tandem::bench {

double MeasureCopyBandwidthGBs(int threads, size_t bytes, int repetitions) {
  threads = std::max(threads, 1);
  // Shares are whole cache lines, so no two threads write the same line.
  const size_t share = (bytes / threads) & ~size_t{63};
  const size_t total = share * threads;
  std::unique_ptr<char[]> src(new char[total]);
  std::unique_ptr<char[]> dst(new char[total]);
  auto copy_all = [&] {
    std::vector<std::thread> workers;
    for (int t = 1; t < threads; ++t) {
      workers.emplace_back(
          [&, t] { std::memcpy(dst.get() + t * share, src.get() + t * share, share); });
    }
    std::memcpy(dst.get(), src.get(), share);
    for (std::thread& w : workers) w.join();
  };
  // First touch from the copying threads' side, so pages are mapped before timing.
  std::memset(src.get(), 1, total);
  copy_all();
  double best_seconds = 1e30;
  for (int r = 0; r < std::max(repetitions, 1); ++r) {
    const auto start = std::chrono::steady_clock::now();
    copy_all();
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
    best_seconds = std::min(best_seconds, elapsed.count());
  }
  return 2.0 * static_cast<double>(total) / best_seconds / 1e9;
}

double MeasureReadBandwidthGBs(int threads, size_t bytes, int repetitions) {
  threads = std::max(threads, 1);
  const size_t words_per_thread = bytes / sizeof(uint64_t) / threads;
  std::unique_ptr<uint64_t[]> data(new uint64_t[words_per_thread * threads]);
  for (size_t i = 0; i < words_per_thread * threads; ++i) data[i] = i;
  std::vector<uint64_t> sums(threads);
  auto read_all = [&] {
    auto read = [&](int t) {
      // Eight independent sums, which the compiler keeps in vector registers.
      uint64_t lanes[8] = {};
      const uint64_t* p = data.get() + t * words_per_thread;
      for (size_t i = 0; i + 8 <= words_per_thread; i += 8) {
        for (int l = 0; l < 8; ++l) lanes[l] += p[i + l];
      }
      uint64_t total = 0;
      for (uint64_t l : lanes) total += l;
      sums[t] = total;
    };
    std::vector<std::thread> workers;
    for (int t = 1; t < threads; ++t) workers.emplace_back(read, t);
    read(0);
    for (std::thread& w : workers) w.join();
  };
  read_all();
  double best_seconds = 1e30;
  for (int r = 0; r < std::max(repetitions, 1); ++r) {
    const auto start = std::chrono::steady_clock::now();
    read_all();
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
    best_seconds = std::min(best_seconds, elapsed.count());
  }
  // Keeps the sums observable, so the reads cannot be optimised away.
  volatile uint64_t sink = 0;
  for (uint64_t s : sums) sink = sink + s;
  return static_cast<double>(words_per_thread * threads * sizeof(uint64_t)) / best_seconds / 1e9;
}

}  // namespace tandem::bench
