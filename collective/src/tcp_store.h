// The TCP rendezvous store behind GlooOptions::leader_address: rank 0 serves a key-value map,
// every rank (rank 0 included) reaches it through a TcpStoreClient, a gloo::rendezvous::Store.
// Keys are written once; a read waits until its key exists.
//
// Wire format, one request per message on a connection, answered in order:
//   'S' <u32 key length> <key> <u32 value length> <value>   -> 'K'
//   'G' <u32 key length> <key>                              -> <u32 length> <value>, once set
//   'W' <u32 count> (<u32 key length> <key>)*               -> 'K', once all are set
// Integers are little-endian. A client gives up (and closes its connection) after its timeout.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gloo/rendezvous/store.h"
#include "tandem/collective/gloo_communicator.h"

namespace tandem::collective::internal {

absl::StatusOr<std::unique_ptr<TcpStoreServer>> StartTcpStoreServer(const std::string& address);

// A connection to a TcpStoreServer. Gloo calls it and expects exceptions on failure: each method
// throws gloo::IoException naming the store and the key.
class TcpStoreClient : public gloo::rendezvous::Store {
 public:
  // Connects, retrying until `timeout` (rank 0 may not be listening yet).
  static absl::StatusOr<std::unique_ptr<TcpStoreClient>> Connect(const std::string& address,
                                                                 std::chrono::milliseconds timeout);
  ~TcpStoreClient() override;

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

 private:
  TcpStoreClient(int fd, std::string address, std::chrono::milliseconds timeout)
      : fd_(fd), address_(std::move(address)), timeout_(timeout) {}
  // Sends `request`, then reads exactly `size` bytes of answer into `out`, giving up after
  // `timeout`; throws naming `what`.
  void Exchange(const std::string& request, void* out, size_t size,
                std::chrono::milliseconds timeout, const std::string& what);

  int fd_;
  std::string address_;
  std::chrono::milliseconds timeout_;
};

}  // namespace tandem::collective::internal
