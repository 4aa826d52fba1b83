// The CPU communicator: Gloo's collectives over its TCP transport.
//
// The ranks find each other through a rendezvous store: a directory on a file system every rank
// sees (one node), a small TCP key-value store that rank 0 serves at `leader_address`
// (any number of nodes; rank 0 must be able to bind it, the others to reach it), or a store of
// the caller's (`store`: etcd, through tandem::cluster::EtcdRendezvousStore). Each rank
// publishes its transport address there and connects to every other rank (a full mesh).
//
//   TANDEM_ASSIGN_OR_RETURN(auto comm, CreateGlooCommunicator({
//       .rank = rank, .size = 4, .leader_address = "10.0.0.1:29500",
//       .hostname = "10.0.0.2"}));
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tandem/collective/communicator.h"
#include "tandem/collective/rendezvous_store.h"

namespace tandem::collective {

struct GlooOptions {
  int rank = 0;
  int size = 1;
  // Rendezvous: exactly one of these. The directory (or the store's key space) must be empty
  // of a previous group's keys (use a fresh one per group). The leader address is host:port; port 0 lets rank 0 pick one
  // (see TcpStoreServer for starting it before the other ranks know the port).
  std::string file_store_dir;
  std::string leader_address;
  RendezvousStore* store = nullptr;  // not owned; used only while joining
  // Prefixes every rendezvous key, so several groups can share one store.
  std::string group = "tp";
  // The address this rank's transport binds and the others connect to.
  std::string hostname = "127.0.0.1";
  // How long each collective may take before DeadlineExceeded.
  absl::Duration timeout = absl::Seconds(60);
  // How long joining may take: every rank must have started and reached the store by then.
  absl::Duration connect_timeout = absl::Minutes(5);
};

// Joins the group: returns once every rank has connected, or fails after `connect_timeout`
// naming the keys of the ranks that never appeared (InvalidArgument for options that cannot work).
absl::StatusOr<std::unique_ptr<Communicator>> CreateGlooCommunicator(const GlooOptions& options);

// The rendezvous store served by rank 0 when GlooOptions::leader_address is set. A launcher
// that starts every rank of one node creates it first (port 0: the kernel picks a free one),
// passes its address() to the other ranks, and hands it to rank 0's communicator, which then
// does not bind one of its own. Serves until destroyed.
class TcpStoreServer {
 public:
  static absl::StatusOr<std::unique_ptr<TcpStoreServer>> Start(const std::string& address);
  virtual ~TcpStoreServer() = default;
  // host:port it listens on (the port picked when asked for 0).
  virtual std::string address() const = 0;
};

// As CreateGlooCommunicator for rank 0 with a store server already running (which must outlive
// the call; `options.leader_address` is ignored).
absl::StatusOr<std::unique_ptr<Communicator>> CreateGlooCommunicatorWithServer(
    const GlooOptions& options, TcpStoreServer& server);

}  // namespace tandem::collective
