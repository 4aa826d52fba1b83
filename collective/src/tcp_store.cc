#include "tcp_store.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gloo/common/error.h"
#include "tandem/base/host_port.h"

namespace tandem::collective::internal {
namespace {

void PutU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint32_t GetU32(const unsigned char* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
}

// Reads exactly `size` bytes; false on EOF or error.
bool ReadFull(int fd, void* out, size_t size) {
  auto* p = static_cast<char*>(out);
  while (size > 0) {
    ssize_t n = ::recv(fd, p, size, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

bool WriteFull(int fd, const void* data, size_t size) {
  auto* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::send(fd, p, size, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

bool ReadString(int fd, std::string& out) {
  unsigned char len[4];
  if (!ReadFull(fd, len, 4)) return false;
  const uint32_t n = GetU32(len);
  if (n > (64u << 20)) return false;  // no rendezvous value is this large
  out.resize(n);
  return n == 0 || ReadFull(fd, out.data(), n);
}

absl::StatusOr<addrinfo*> Resolve(const std::string& address, bool passive) {
  auto host_port = SplitHostPort(address);
  if (!host_port.ok()) return host_port.status();
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* result = nullptr;
  const std::string port = std::to_string(host_port->second);
  int rc = ::getaddrinfo(host_port->first.c_str(), port.c_str(), &hints, &result);
  if (rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rendezvous address ", address, ": ", ::gai_strerror(rc)));
  }
  return result;
}

class Server : public TcpStoreServer {
 public:
  Server(int listen_fd, std::string address) : listen_fd_(listen_fd), address_(std::move(address)) {
    accept_thread_ = std::thread([this] { AcceptLoop(); });
  }

  ~Server() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      for (int fd : connections_) ::shutdown(fd, SHUT_RDWR);
    }
    changed_.notify_all();
    ::shutdown(listen_fd_, SHUT_RDWR);
    accept_thread_.join();
    for (std::thread& t : threads_) t.join();
    ::close(listen_fd_);
  }

  std::string address() const override { return address_; }

 private:
  void AcceptLoop() {
    while (true) {
      int fd = ::accept(listen_fd_, nullptr, nullptr);
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) {
        if (fd >= 0) ::close(fd);
        return;
      }
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        return;
      }
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      connections_.insert(fd);
      threads_.emplace_back([this, fd] { Serve(fd); });
    }
  }

  // Waits until every key is set or the server stops; false when it stopped.
  bool WaitFor(const std::vector<std::string>& keys, std::unique_lock<std::mutex>& lock) {
    changed_.wait(lock, [&] {
      if (stopping_) return true;
      for (const std::string& key : keys) {
        if (!values_.count(key)) return false;
      }
      return true;
    });
    return !stopping_;
  }

  void Serve(int fd) {
    while (true) {
      char op = 0;
      if (!ReadFull(fd, &op, 1)) break;
      std::string reply;
      if (op == 'S') {
        std::string key, value;
        if (!ReadString(fd, key) || !ReadString(fd, value)) break;
        {
          std::lock_guard<std::mutex> lock(mu_);
          values_[key] = std::move(value);
        }
        changed_.notify_all();
        reply.assign(1, 'K');
      } else if (op == 'G') {
        std::string key;
        if (!ReadString(fd, key)) break;
        std::unique_lock<std::mutex> lock(mu_);
        if (!WaitFor({key}, lock)) break;
        PutU32(reply, static_cast<uint32_t>(values_[key].size()));
        reply += values_[key];
      } else if (op == 'W') {
        unsigned char count[4];
        if (!ReadFull(fd, count, 4)) break;
        std::vector<std::string> keys(GetU32(count));
        if (keys.size() > 65536) break;
        bool ok = true;
        for (std::string& key : keys) ok = ok && ReadString(fd, key);
        if (!ok) break;
        std::unique_lock<std::mutex> lock(mu_);
        if (!WaitFor(keys, lock)) break;
        reply.assign(1, 'K');
      } else {
        break;  // not a store client
      }
      if (!WriteFull(fd, reply.data(), reply.size())) break;
    }
    std::lock_guard<std::mutex> lock(mu_);
    connections_.erase(fd);
    ::close(fd);
  }

  const int listen_fd_;
  const std::string address_;
  std::thread accept_thread_;
  std::mutex mu_;
  std::condition_variable changed_;
  bool stopping_ = false;                      // guarded by mu_
  std::map<std::string, std::string> values_;  // guarded by mu_
  std::set<int> connections_;                  // guarded by mu_
  std::vector<std::thread> threads_;           // guarded by mu_ (joined after stopping_)
};

}  // namespace

absl::StatusOr<std::unique_ptr<TcpStoreServer>> StartTcpStoreServer(const std::string& address) {
  auto host_port = SplitHostPort(address);
  if (!host_port.ok()) return host_port.status();
  auto resolved = Resolve(address, /*passive=*/true);
  if (!resolved.ok()) return resolved.status();
  std::string error = "no address";
  for (addrinfo* ai = *resolved; ai != nullptr; ai = ai->ai_next) {
    int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd, 128) != 0) {
      error = std::strerror(errno);
      ::close(fd);
      continue;
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
    const int port = bound.ss_family == AF_INET6
                         ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                         : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    ::freeaddrinfo(*resolved);
    const std::string host = host_port->first.find(':') != std::string::npos
                                 ? absl::StrCat("[", host_port->first, "]")
                                 : host_port->first;
    return std::unique_ptr<TcpStoreServer>(new Server(fd, absl::StrCat(host, ":", port)));
  }
  ::freeaddrinfo(*resolved);
  return absl::UnavailableError(
      absl::StrCat("cannot listen for the rendezvous at ", address, ": ", error));
}

absl::StatusOr<std::unique_ptr<TcpStoreClient>> TcpStoreClient::Connect(
    const std::string& address, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::string error;
  while (true) {
    auto resolved = Resolve(address, /*passive=*/false);
    if (!resolved.ok()) return resolved.status();
    for (addrinfo* ai = *resolved; ai != nullptr; ai = ai->ai_next) {
      int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
      if (fd < 0) continue;
      if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
        ::freeaddrinfo(*resolved);
        int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        return std::unique_ptr<TcpStoreClient>(new TcpStoreClient(fd, address, timeout));
      }
      error = std::strerror(errno);
      ::close(fd);
    }
    ::freeaddrinfo(*resolved);
    // The leader may not be listening yet: poll until the deadline.
    if (std::chrono::steady_clock::now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("no rendezvous store at ", address, " within the timeout: ", error));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

TcpStoreClient::~TcpStoreClient() { ::close(fd_); }

void TcpStoreClient::Exchange(const std::string& request, void* out, size_t size,
                              std::chrono::milliseconds timeout, const std::string& what) {
  if (fd_ < 0) throw gloo::IoException(absl::StrCat("rendezvous store ", address_, " closed"));
  if (!WriteFull(fd_, request.data(), request.size())) {
    throw gloo::IoException(absl::StrCat("rendezvous store ", address_, ": ", what,
                                         ": cannot send: ", std::strerror(errno)));
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto* p = static_cast<char*>(out);
  while (size > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    pollfd pfd{fd_, POLLIN, 0};
    int rc = left.count() > 0
                 ? ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left.count(), 1 << 30)))
                 : 0;
    if (rc < 0 && errno == EINTR) continue;
    if (rc == 0) {
      // The answer may still come; this connection is out of step now.
      ::close(fd_);
      fd_ = -1;
      throw gloo::IoException(absl::StrCat("rendezvous store ", address_, ": timed out after ",
                                           timeout.count(), " ms waiting for ", what));
    }
    ssize_t n = ::recv(fd_, p, size, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      throw gloo::IoException(
          absl::StrCat("rendezvous store ", address_, " went away waiting for ", what));
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
}

void TcpStoreClient::set(const std::string& key, const std::vector<char>& data) {
  std::string request = "S";
  PutU32(request, static_cast<uint32_t>(key.size()));
  request += key;
  PutU32(request, static_cast<uint32_t>(data.size()));
  request.append(data.data(), data.size());
  char ack = 0;
  Exchange(request, &ack, 1, timeout_, absl::StrCat("setting ", key));
}

std::vector<char> TcpStoreClient::get(const std::string& key) {
  std::string request = "G";
  PutU32(request, static_cast<uint32_t>(key.size()));
  request += key;
  const std::string what = absl::StrCat("key ", key);
  unsigned char len[4];
  Exchange(request, len, 4, timeout_, what);
  std::vector<char> value(GetU32(len));
  if (!value.empty()) Exchange("", value.data(), value.size(), timeout_, what);
  return value;
}

void TcpStoreClient::wait(const std::vector<std::string>& keys,
                          const std::chrono::milliseconds& timeout) {
  std::string request = "W";
  PutU32(request, static_cast<uint32_t>(keys.size()));
  std::string names;
  for (const std::string& key : keys) {
    PutU32(request, static_cast<uint32_t>(key.size()));
    request += key;
    absl::StrAppend(&names, names.empty() ? "" : ", ", key);
  }
  char ack = 0;
  Exchange(request, &ack, 1, timeout, absl::StrCat("keys ", names));
}

}  // namespace tandem::collective::internal
