// KV pushes between two processes on one GPU over the cuda_ipc transfer backend, against the
// device's own copy bandwidth in the same run (run by scripts/gpu-check on a lent GPU).
//
//   tandem_bench_cuda_ipc [OUT_JSON]
//
// This binary re-runs itself as the receiving process (TANDEM_CUDA_IPC_BENCH_PEER set), which
// registers a 1 GiB region and waits; the sender pushes its own 1 GiB region into it as ranges
// of one size at a time (64 KiB: a 16-token block of an 8B-shaped layer's K and V in bf16; up to
// 16 MiB), all submitted in one Submit, timed to the handle's Wait, median of 5 after a
// warm-up. "of copy" compares the payload rate with a same-process cudaMemcpy's (its
// read-plus-write figure halved).
#include <cuda_runtime.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench/cuda_bandwidth.h"
#include "tandem/kvtransfer/agent.h"

extern char** environ;

namespace tandem {
namespace {

constexpr size_t kRegionBytes = size_t{1} << 30;
constexpr char kPeerEnv[] = "TANDEM_CUDA_IPC_BENCH_PEER";

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "tandem_bench_cuda_ipc: %s\n", what.c_str());
  std::exit(1);
}

void* DeviceRegion(unsigned char fill) {
  void* p = nullptr;
  if (cudaMalloc(&p, kRegionBytes) != cudaSuccess) Die("cudaMalloc of the 1 GiB region");
  if (cudaMemset(p, fill, kRegionBytes) != cudaSuccess) Die("cudaMemset");
  if (cudaDeviceSynchronize() != cudaSuccess) Die("cudaDeviceSynchronize");
  return p;
}

// The receiving process: registers its region, says where, and waits for its stdin to close.
int Peer() {
  auto agent = kvtransfer::Agent::Create({.backend = "cuda_ipc", .name = "bench-peer"});
  if (!agent.ok()) Die(std::string(agent.status().message()));
  void* region = DeviceRegion(0xEE);
  auto descriptor = (*agent)->RegisterMemory(2, region, kRegionBytes);
  if (!descriptor.ok()) Die(std::string(descriptor.status().message()));
  std::printf("%s %s\n", (*agent)->address().c_str(), absl::BytesToHexString(*descriptor).c_str());
  std::fflush(stdout);
  char line[64];
  while (std::fgets(line, sizeof(line), stdin) != nullptr) {
  }
  cudaFree(region);
  return 0;
}

}  // namespace
}  // namespace tandem

int main(int argc, char** argv) {
  using namespace tandem;
  if (std::getenv(kPeerEnv) != nullptr) return Peer();
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) Die("no CUDA device");
  const double copy_gbs = bench::MeasureCudaCopyGBs();
  if (copy_gbs <= 0) Die("cannot measure the device copy bandwidth");

  // The peer, with pipes to its stdin and from its stdout.
  int to_peer[2], from_peer[2];
  if (pipe(to_peer) != 0 || pipe(from_peer) != 0) Die("pipe");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, to_peer[0], 0);
  posix_spawn_file_actions_adddup2(&actions, from_peer[1], 1);
  posix_spawn_file_actions_addclose(&actions, to_peer[1]);
  posix_spawn_file_actions_addclose(&actions, from_peer[0]);
  std::vector<std::string> env_strings = {absl::StrCat(kPeerEnv, "=1")};
  for (char** e = environ; *e != nullptr; ++e) env_strings.push_back(*e);
  std::vector<char*> env;
  for (std::string& e : env_strings) env.push_back(e.data());
  env.push_back(nullptr);
  std::string self = "/proc/self/exe";
  char* peer_argv[] = {self.data(), nullptr};
  pid_t peer = 0;
  if (posix_spawn(&peer, self.c_str(), &actions, nullptr, peer_argv, env.data()) != 0) {
    Die("cannot start the receiving process");
  }
  posix_spawn_file_actions_destroy(&actions);
  close(to_peer[0]);
  close(from_peer[1]);
  FILE* from = fdopen(from_peer[0], "r");
  char buf[8192];
  if (std::fgets(buf, sizeof(buf), from) == nullptr) Die("the receiving process said nothing");
  std::vector<std::string> parts =
      absl::StrSplit(absl::StripTrailingAsciiWhitespace(std::string(buf)), ' ');
  if (parts.size() != 2) Die(absl::StrCat("the receiving process said: ", buf));
  const std::string descriptor = absl::HexStringToBytes(parts[1]);

  auto sender = kvtransfer::Agent::Create({.backend = "cuda_ipc", .name = "bench-sender"});
  if (!sender.ok()) Die(std::string(sender.status().message()));
  void* src = DeviceRegion(0x5A);
  if (auto r = (*sender)->RegisterMemory(1, src, kRegionBytes); !r.ok()) {
    Die(std::string(r.status().message()));
  }
  auto connected = (*sender)->Connect(parts[0], absl::Now() + absl::Seconds(60));
  if (!connected.ok()) Die(std::string(connected.status().message()));

  struct Row {
    size_t range_bytes;
    double ms, gbs;
  };
  std::vector<Row> rows;
  for (size_t range : {size_t{64} << 10, size_t{256} << 10, size_t{1} << 20, size_t{16} << 20}) {
    std::vector<kvtransfer::Range> ranges;
    // Range i lands in the receiver's mirrored slot: not one contiguous copy.
    const size_t count = kRegionBytes / range;
    for (size_t i = 0; i < count; ++i) {
      ranges.push_back({i * range, (count - 1 - i) * range, range});
    }
    std::vector<double> ms;
    for (int rep = 0; rep < 6; ++rep) {
      const auto start = std::chrono::steady_clock::now();
      auto handle = (*sender)->Submit(*connected, 1, descriptor, ranges,
                                      absl::Now() + absl::Seconds(120));
      if (!handle.ok()) Die(std::string(handle.status().message()));
      if (absl::Status s = (*handle)->Wait(); !s.ok()) Die(std::string(s.message()));
      const double t =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count();
      if (rep > 0) ms.push_back(t);  // the first one warms up
    }
    std::sort(ms.begin(), ms.end());
    const double median = ms[ms.size() / 2];
    rows.push_back({range, median, kRegionBytes / (median * 1e-3) / 1e9});
  }
  close(to_peer[1]);  // the peer exits
  int status = 0;
  waitpid(peer, &status, 0);

  std::printf("device copy bandwidth (cudaMemcpy 1 GiB, read + write): %.1f GB/s; payload %.1f\n",
              copy_gbs, copy_gbs / 2);
  std::printf("%-12s %10s %12s %8s\n", "range", "ms / GiB", "payload GB/s", "of copy");
  for (const Row& r : rows) {
    std::printf("%-12s %10.2f %12.1f %8.3f\n", absl::StrCat(r.range_bytes >> 10, " KiB").c_str(),
                r.ms, r.gbs, r.gbs / (copy_gbs / 2));
  }
  if (argc > 1) {
    FILE* f = std::fopen(argv[1], "w");
    if (f == nullptr) Die(absl::StrCat("cannot write ", argv[1]));
    std::fprintf(f, "{\"copy_gbs\": %.1f, \"rows\": [\n", copy_gbs);
    for (size_t i = 0; i < rows.size(); ++i) {
      std::fprintf(f, " {\"range_bytes\": %zu, \"ms_per_gib\": %.3f, \"payload_gbs\": %.1f}%s\n",
                   rows[i].range_bytes, rows[i].ms, rows[i].gbs, i + 1 < rows.size() ? "," : "");
    }
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
  return 0;
}
