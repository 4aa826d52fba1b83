// Blocking-with-deadline socket helpers shared by the backends that run their own control
// connection (cuda_ipc over a Unix-domain socket, nccl over TCP). Private to kvtransfer.
#pragma once

#include <cstddef>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace tandem::kvtransfer::internal {

// A file descriptor, closed on destruction.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) {
      Reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { Reset(); }
  int get() const { return fd_; }
  void Reset();

 private:
  int fd_ = -1;
};

// Whether the other end of a connected socket has closed it (its agent or process is gone).
// Peeks, so unread bytes stay unread.
bool HungUp(int fd);

// Reads exactly `size` bytes before `deadline`: DeadlineExceeded if they are not all there by
// then, Unavailable if the peer closes the connection or the socket fails. `what` names the
// exchange in the messages ("handshake").
absl::Status ReadFully(int fd, char* out, size_t size, absl::Time deadline, const char* what);

// Writes all of `bytes` (blocking; MSG_NOSIGNAL, so a closed peer is an error, not a signal).
absl::Status WriteFully(int fd, const std::string& bytes, const char* what);

}  // namespace tandem::kvtransfer::internal
