#include "kvtransfer/src/nccl/control.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "tandem/base/host_port.h"
#include "tandem/base/status_macros.h"

namespace tandem::kvtransfer::nccl {

using internal::ReadFully;
using internal::UniqueFd;

namespace {

// A blocked control write (the peer stopped reading) counts as the peer being gone after this.
constexpr int kSendTimeoutSeconds = 10;

absl::StatusOr<addrinfo*> Resolve(const std::string& host, int port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* result = nullptr;
  const std::string service = std::to_string(port);
  if (int e = getaddrinfo(host.c_str(), service.c_str(), &hints, &result); e != 0) {
    return absl::UnavailableError(absl::StrCat("cannot resolve ", host, ": ", gai_strerror(e)));
  }
  return result;
}

}  // namespace

std::string EncodeFrame(Frame type, const std::string& body) {
  std::string out;
  out.reserve(kFrameHeaderBytes + body.size());
  PutU32(&out, type);
  PutU32(&out, static_cast<uint32_t>(body.size()));
  return out + body;
}

uint64_t MillisecondsLeft(absl::Time deadline) {
  const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
  return ms > 0 ? static_cast<uint64_t>(ms) : 0;
}

absl::Time DeadlineIn(uint64_t ms) {
  // Clamped so that a huge value from a peer cannot overflow.
  return absl::Now() + absl::Milliseconds(static_cast<int64_t>(
                           std::min<uint64_t>(ms, uint64_t{365} * 24 * 3600 * 1000)));
}

// Reads one whole frame (handshake only; connections read frames off their buffer).
absl::Status ReadFrame(int fd, absl::Time deadline, uint32_t* type, std::string* body) {
  char header[kFrameHeaderBytes];
  TANDEM_RETURN_IF_ERROR(ReadFully(fd, header, sizeof(header), deadline, "handshake"));
  uint32_t bytes = 0;
  std::memcpy(type, header, 4);
  std::memcpy(&bytes, header + 4, 4);
  if (bytes > kMaxFrameBytes) return absl::UnavailableError("handshake frame too large");
  body->assign(bytes, '\0');
  return ReadFully(fd, body->data(), bytes, deadline, "handshake");
}

std::string Hello(uint64_t instance, uint64_t own) {
  std::string out;
  PutU64(&out, kHelloMagic);
  PutU64(&out, instance);
  PutU64(&out, own);
  return out;
}

// "nccl:NAME@HOST:PORT#INSTANCE".
absl::StatusOr<ParsedAddress> ParseAddress(const std::string& address) {
  const auto bad = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        "\"", address, "\" is not an nccl agent address (nccl:NAME@HOST:PORT#INSTANCE)"));
  };
  const size_t hash = address.rfind('#');
  const size_t at = address.rfind('@', hash);
  if (address.rfind("nccl:", 0) != 0 || hash == std::string::npos || at == std::string::npos) {
    return bad();
  }
  ParsedAddress parsed;
  if (!absl::SimpleHexAtoi(address.substr(hash + 1), &parsed.instance) || parsed.instance == 0) {
    return bad();
  }
  absl::StatusOr<std::pair<std::string, int>> host_port =
      SplitHostPort(address.substr(at + 1, hash - at - 1));
  if (!host_port.ok() || host_port->second == 0) return bad();
  parsed.host = host_port->first;
  parsed.port = host_port->second;
  return parsed;
}

// Control sockets: no Nagle delay (frames are small and answered at once), and a bounded
// blocking write.
void TuneSocket(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  timeval timeout{kSendTimeoutSeconds, 0};
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
}

// Dials host:port, giving up at `deadline`.
absl::StatusOr<UniqueFd> Dial(const ParsedAddress& to, absl::Time deadline) {
  TANDEM_ASSIGN_OR_RETURN(addrinfo * list, Resolve(to.host, to.port, /*passive=*/false));
  absl::Status last = absl::UnavailableError("no address");
  for (addrinfo* ai = list; ai != nullptr; ai = ai->ai_next) {
    UniqueFd fd(socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (fd.get() < 0) continue;
    if (connect(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0 && errno != EINPROGRESS) {
      last = absl::UnavailableError(std::strerror(errno));
      continue;
    }
    pollfd p{fd.get(), POLLOUT, 0};
    const int ms = static_cast<int>(std::min<uint64_t>(MillisecondsLeft(deadline), 1u << 30));
    if (poll(&p, 1, ms) <= 0) {
      last = absl::DeadlineExceededError("no answer by the deadline");
      continue;
    }
    int error = 0;
    socklen_t length = sizeof(error);
    getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &error, &length);
    if (error != 0) {
      last = absl::UnavailableError(std::strerror(error));
      continue;
    }
    fcntl(fd.get(), F_SETFL, fcntl(fd.get(), F_GETFL) & ~O_NONBLOCK);
    TuneSocket(fd.get());
    freeaddrinfo(list);
    return fd;
  }
  freeaddrinfo(list);
  return last;
}

// Takes the next whole frame off `buffer`; nullopt if it has none yet.
absl::StatusOr<std::optional<std::pair<uint32_t, std::string>>> TakeFrame(std::string* buffer) {
  if (buffer->size() < kFrameHeaderBytes) return std::nullopt;
  uint32_t type = 0, bytes = 0;
  std::memcpy(&type, buffer->data(), 4);
  std::memcpy(&bytes, buffer->data() + 4, 4);
  if (bytes > kMaxFrameBytes) return absl::InternalError("control frame too large");
  if (buffer->size() < kFrameHeaderBytes + bytes) return std::nullopt;
  std::pair<uint32_t, std::string> frame{type, buffer->substr(kFrameHeaderBytes, bytes)};
  buffer->erase(0, kFrameHeaderBytes + bytes);
  return frame;
}

absl::StatusOr<std::pair<UniqueFd, int>> Listen(const std::string& host, int port) {
  TANDEM_ASSIGN_OR_RETURN(addrinfo * list, Resolve(host, port, /*passive=*/true));
  UniqueFd listener;
  std::string why = "no address";
  for (addrinfo* ai = list; ai != nullptr && listener.get() < 0; ai = ai->ai_next) {
    UniqueFd fd(socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, 0));
    const int one = 1;
    setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (fd.get() >= 0 && bind(fd.get(), ai->ai_addr, ai->ai_addrlen) == 0 &&
        listen(fd.get(), 64) == 0) {
      listener = std::move(fd);
    } else {
      why = std::strerror(errno);
    }
  }
  freeaddrinfo(list);
  if (listener.get() < 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", host, ":", port, ": ", why));
  }
  sockaddr_storage bound{};
  socklen_t length = sizeof(bound);
  getsockname(listener.get(), reinterpret_cast<sockaddr*>(&bound), &length);
  const int bound_port = bound.ss_family == AF_INET6
                             ? ntohs(reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port)
                             : ntohs(reinterpret_cast<const sockaddr_in*>(&bound)->sin_port);
  return std::pair{std::move(listener), bound_port};
}

}  // namespace tandem::kvtransfer::nccl
