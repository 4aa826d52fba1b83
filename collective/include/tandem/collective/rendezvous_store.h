// A key-value store the ranks of a group meet through, for stores that live outside this
// library (the etcd one in tandem::cluster); GlooOptions::store takes it.
//
//   class MyStore : public collective::RendezvousStore { ... };
//   MyStore store(...);
//   auto comm = CreateGlooCommunicator({.rank = r, .size = n, .store = &store});
//
// Keys are written once per group. Implementations are called from the joining thread only.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tandem::collective {

class RendezvousStore {
 public:
  virtual ~RendezvousStore() = default;
  virtual absl::Status Set(const std::string& key, const std::string& value) = 0;
  // The value of `key`, waiting until some rank has set it; DeadlineExceeded after `timeout`.
  virtual absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) = 0;
};

}  // namespace tandem::collective
