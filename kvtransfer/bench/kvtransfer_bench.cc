// tandem_bench_kvtransfer: bandwidth of pushing a KV-cache-sized region through kvtransfer,
// next to memcpy of the same ranges measured in the same run.
//
//   tandem_bench_kvtransfer [--mib=64] [--iterations=5]
//
// The region stands for the KV of ~2k tokens of a mid-sized model (64 MiB); it is pushed in
// ranges of 4 KiB (one block of one layer of a small model) to 64 KiB. Each line reports the
// median of the iterations. UCX runs two agents in this process over loopback with the
// transports named (the default set, and TCP alone as a network stand-in); "raw tcp loopback"
// streams the same bytes over one plain socket in writes of the range size, the most a TCP
// push could reach here.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "tandem/kvtransfer/agent.h"

namespace {

using tandem::kvtransfer::Agent;
using tandem::kvtransfer::AgentOptions;
using tandem::kvtransfer::PeerId;
using tandem::kvtransfer::Range;

double MedianSeconds(int iterations, const std::function<bool()>& run) {
  std::vector<double> seconds;
  run();  // Warm-up: page faults, connection wire-up, registration caches.
  for (int i = 0; i < iterations; ++i) {
    const auto start = std::chrono::steady_clock::now();
    if (!run()) return -1;
    seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(seconds.begin(), seconds.end());
  return seconds[seconds.size() / 2];
}

std::vector<Range> Ranges(uint64_t bytes, uint64_t range_bytes) {
  std::vector<Range> ranges;
  // Destination ranges are laid out in reverse to stand for a block table that is not
  // contiguous on the receiving side.
  const uint64_t count = bytes / range_bytes;
  for (uint64_t i = 0; i < count; ++i) {
    ranges.push_back({i * range_bytes, (count - 1 - i) * range_bytes, range_bytes});
  }
  return ranges;
}

// Pushes `ranges` from one agent to another of `options`; returns the median seconds, or -1.
double PushSeconds(AgentOptions options, std::vector<char>& src, std::vector<char>& dst,
                   const std::vector<Range>& ranges, int iterations) {
  options.name = "bench-src";
  auto sender = Agent::Create(options);
  options.name = "bench-dst";
  auto receiver = Agent::Create(options);
  if (!sender.ok() || !receiver.ok()) {
    std::fprintf(stderr, "agent: %s %s\n", sender.status().ToString().c_str(),
                 receiver.status().ToString().c_str());
    return -1;
  }
  auto registered = (*sender)->RegisterMemory(0, src.data(), src.size());
  auto descriptor = (*receiver)->RegisterMemory(0, dst.data(), dst.size());
  auto peer = (*sender)->Connect((*receiver)->address(), absl::Now() + absl::Seconds(30));
  if (!registered.ok() || !descriptor.ok() || !peer.ok()) {
    std::fprintf(stderr, "setup: %s\n", peer.status().ToString().c_str());
    return -1;
  }
  return MedianSeconds(iterations, [&] {
    auto handle =
        (*sender)->Submit(*peer, 0, *descriptor, ranges, absl::Now() + absl::Seconds(120));
    const absl::Status status = handle.ok() ? (*handle)->Wait() : handle.status();
    if (!status.ok()) std::fprintf(stderr, "transfer: %s\n", status.ToString().c_str());
    return status.ok();
  });
}

// Streams `src` over one loopback TCP connection in writes of `write_bytes`, read into `dst` by
// another thread: what a hand-written TCP push could reach on this machine, the yardstick for
// the UCX rows.
double RawTcpSeconds(std::vector<char>& src, std::vector<char>& dst, uint64_t write_bytes,
                     int iterations) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(listener, 1) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    close(listener);
    return -1;
  }
  const int sender = socket(AF_INET, SOCK_STREAM, 0);
  if (connect(sender, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return -1;
  const int receiver = accept(listener, nullptr, nullptr);
  close(listener);
  const int one = 1;
  setsockopt(sender, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  const double seconds = MedianSeconds(iterations, [&] {
    std::thread reader([&] {
      for (uint64_t done = 0; done < dst.size();) {
        const ssize_t n = read(receiver, dst.data() + done, dst.size() - done);
        if (n <= 0) return;
        done += n;
      }
    });
    bool ok = true;
    for (uint64_t done = 0; ok && done < src.size();) {
      const ssize_t n =
          write(sender, src.data() + done, std::min<uint64_t>(write_bytes, src.size() - done));
      ok = n > 0;
      done += ok ? n : 0;
    }
    reader.join();
    return ok;
  });
  close(sender);
  close(receiver);
  return seconds;
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t mib = 64;
  int iterations = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (absl::StartsWith(arg, "--mib=")) {
      if (!absl::SimpleAtoi(arg.substr(6), &mib) || mib == 0) return 2;
    } else if (absl::StartsWith(arg, "--iterations=")) {
      if (!absl::SimpleAtoi(arg.substr(13), &iterations) || iterations <= 0) return 2;
    } else {
      std::fprintf(stderr, "usage: %s [--mib=64] [--iterations=5]\n", argv[0]);
      return 2;
    }
  }
  const uint64_t bytes = mib << 20;
  std::vector<char> src(bytes), dst(bytes);
  for (uint64_t i = 0; i < bytes; ++i) src[i] = static_cast<char>(i * 2654435761u >> 24);
  std::memset(dst.data(), 0, bytes);

  std::printf("%-28s %8s %10s %10s\n", "path", "range", "ms", "GB/s");
  const auto report = [&](const std::string& path, uint64_t range_bytes, double seconds) {
    if (seconds < 0) {
      std::printf("%-28s %7lluK %10s %10s\n", path.c_str(),
                  static_cast<unsigned long long>(range_bytes >> 10), "failed", "-");
      return;
    }
    std::printf("%-28s %7lluK %10.2f %10.2f\n", path.c_str(),
                static_cast<unsigned long long>(range_bytes >> 10), seconds * 1e3,
                bytes / seconds / 1e9);
  };
  for (uint64_t range_bytes : {uint64_t{4} << 10, uint64_t{16} << 10, uint64_t{64} << 10}) {
    const std::vector<Range> ranges = Ranges(bytes, range_bytes);
    report("memcpy", range_bytes, MedianSeconds(iterations, [&] {
             for (const Range& r : ranges) {
               std::memcpy(dst.data() + r.dst_offset, src.data() + r.src_offset, r.bytes);
             }
             return true;
           }));
    report("raw tcp loopback", range_bytes, RawTcpSeconds(src, dst, range_bytes, iterations));
    report("local", range_bytes, PushSeconds({.backend = "local"}, src, dst, ranges, iterations));
    report("ucx loopback (tcp,sm,self)", range_bytes,
           PushSeconds({.backend = "ucx", .ucx_transports = "tcp,sm,self"}, src, dst, ranges,
                       iterations));
    report("ucx loopback (tcp)", range_bytes,
           PushSeconds({.backend = "ucx", .ucx_transports = "tcp"}, src, dst, ranges, iterations));
  }
  return 0;
}
