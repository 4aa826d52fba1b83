// The nccl backend's control connection: frames, the hello, addresses and TCP sockets. Private
// to kvtransfer (nccl_agent.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvtransfer/src/socket_io.h"

namespace tandem::kvtransfer::nccl {

constexpr uint64_t kHelloMagic = 0x314c43434e4d4454ull;  // "TDMNCCL1"
constexpr size_t kHelloBytes = 24;
constexpr uint32_t kMaxFrameBytes = 64u << 20;
constexpr size_t kFrameHeaderBytes = 8;

// Control frames: u32 type, u32 body bytes, body. Integers little-endian (native order; the
// backend runs between hosts of one architecture, as the descriptors assume).
enum Frame : uint32_t {
  kLinkId = 1,      // connector -> listener: u64 ms left to join, the link id
  kJoined = 2,      // listener -> connector: empty
  kJoinFailed = 3,  // listener -> connector: the reason
  kTransfer = 4,    // u64 seq, u64 region, u64 generation, u64 ms left, u32 n, n x (dst, bytes)
  kAccept = 5,      // u64 seq
  kRefuse = 6,      // u64 seq, u32 status code, the reason
  kDone = 7,        // u64 seq: the receives of the transfer have completed
  kFailed = 8,      // u64 seq, the reason: the link failed under the transfer
};

inline void PutU32(std::string* out, uint32_t v) {
  out->append(reinterpret_cast<const char*>(&v), 4);
}
inline void PutU64(std::string* out, uint64_t v) {
  out->append(reinterpret_cast<const char*>(&v), 8);
}

// A frame of `type` around `body`.
std::string EncodeFrame(Frame type, const std::string& body);

// Takes the next whole frame (type, body) off the front of `buffer`; nullopt if it holds none
// yet; Internal if the next frame claims to be larger than kMaxFrameBytes.
absl::StatusOr<std::optional<std::pair<uint32_t, std::string>>> TakeFrame(std::string* buffer);

// Reads one whole frame off `fd` by `deadline` (the handshake's frames).
absl::Status ReadFrame(int fd, absl::Time deadline, uint32_t* type, std::string* body);

// Reads fixed-size fields off a frame body; every read fails once the body is exhausted.
class BodyReader {
 public:
  explicit BodyReader(const std::string& body) : p_(body.data()), left_(body.size()) {}
  bool U32(uint32_t* v) { return Take(v, 4); }
  bool U64(uint64_t* v) { return Take(v, 8); }
  std::string Rest() {
    std::string out(p_, left_);
    left_ = 0;
    return out;
  }
  bool empty() const { return left_ == 0; }

 private:
  bool Take(void* v, size_t n) {
    if (left_ < n) return false;
    std::memcpy(v, p_, n);
    p_ += n;
    left_ -= n;
    return true;
  }
  const char* p_;
  size_t left_;
};

// Milliseconds left until `deadline` (0 once passed), and the deadline that many ms from now
// (clamped to a year, so a peer's value cannot overflow it).
uint64_t MillisecondsLeft(absl::Time deadline);
absl::Time DeadlineIn(uint64_t ms);

// The hello: magic, an incarnation (the connector: the one it expects to reach; the listener:
// its own) and the connector's own incarnation (0 from the listener).
std::string Hello(uint64_t instance, uint64_t own);

struct ParsedAddress {
  std::string host;
  int port = 0;
  uint64_t instance = 0;
};

// Parses "nccl:NAME@HOST:PORT#INSTANCE"; InvalidArgument saying the expected form otherwise.
absl::StatusOr<ParsedAddress> ParseAddress(const std::string& address);

// A control socket connected to `to` by `deadline` (blocking, no Nagle, bounded writes).
absl::StatusOr<internal::UniqueFd> Dial(const ParsedAddress& to, absl::Time deadline);

// A listening socket on host:port (0: any free port) and the port it got.
absl::StatusOr<std::pair<internal::UniqueFd, int>> Listen(const std::string& host, int port);

// Sets what Dial sets on an accepted control socket.
void TuneSocket(int fd);

}  // namespace tandem::kvtransfer::nccl
