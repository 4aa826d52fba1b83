// `--tensor-parallel-size N` (alias `--tp N`), `--tp-rank R`, `--tp-leader HOST:PORT`,
// `--tp-host HOST` on the commands that run a colocated engine (`generate`, `serve --colocated`):
// one process per rank of a tensor-parallel group (docs/operations.md, "Tensor parallelism").
//
// On one node the command starts its ranks itself: the process the user started is rank 0; it
// serves the rendezvous store on loopback and runs its own binary again for ranks 1..N-1 with
// `--tp-rank R --tp-leader ADDR` appended. Those followers die with it (PR_SET_PDEATHSIG), and a
// follower that exits while the group runs takes rank 0 down at once with a one-line reason
// (a watcher thread per child). Across nodes every rank is started with `--tp-rank R
// --tp-leader ADDR` (ADDR: where rank 0 serves the store; rank 0 binds it), or, on the worker
// commands, with `--tp-rank R --tp-name NAME` and the `--etcd` endpoints the worker registers
// with: the ranks then meet on etcd under /tandem/tp/NAME/ (cluster::EtcdRendezvousStore) and
// nobody serves a store.
//
//   TensorParallelGroup tp;
//   TANDEM_RETURN_IF_ERROR(tp.Configure(args, argc, argv));  // after args.Parse
//   if (tp.follower()) return tp.RunFollower(engine_options);
//   TANDEM_RETURN_IF_ERROR(tp.Start());
//   engine_options.tensor_parallel = tp.communicator();  // null without tensor parallelism
//   ... create the engine, run it, destroy it (which releases the followers) ...
//   return tp.Finish(status);
#pragma once

#include <sys/types.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "tandem/collective/communicator.h"
#include "tandem/collective/gloo_communicator.h"
#include "tandem/proto/tls.h"
#include "tandem/engine/llm_engine.h"
#include "tandem/tools/args.h"

namespace tandem::tools {

void DeclareTensorParallelFlags(Args& args);
// The group a follower rank of `serve --prefill-tp/--decode-tp` belongs to ("" otherwise).
std::string TensorParallelGroupName(const Args& args);

class TensorParallelGroup {
 public:
  TensorParallelGroup() = default;
  // Kills and reaps the followers it started that are still running.
  ~TensorParallelGroup();
  TensorParallelGroup(const TensorParallelGroup&) = delete;
  TensorParallelGroup& operator=(const TensorParallelGroup&) = delete;

  // Reads the flags (argv as the subcommand got it: argv[0] is its name, kept to start the
  // followers with the same flags). InvalidArgument for flags that do not fit together.
  absl::Status Configure(const Args& args, int argc, char** argv);
  // One of several groups a command runs on one node (`serve --prefill-tp N --decode-tp M`):
  // `size` ranks, and its followers are started with `--tp-group NAME` besides their rank.
  absl::Status ConfigureNamed(const Args& args, int argc, char** argv, const std::string& name,
                              int size);
  int size() const { return size_; }
  int rank() const { return rank_; }
  bool follower() const { return rank_ > 0; }
  // Whether the group meets on etcd (--tp-name): each rank was started on its own, typically in
  // a pod of its own.
  bool meets_on_etcd() const { return !etcd_name_.empty(); }
  // The etcd a `--tp-name` group meets on (the worker's --etcd and its TLS files); without it
  // such a group fails to join, saying so.
  void UseEtcd(std::string endpoints, proto::TlsFiles tls) {
    etcd_endpoints_ = std::move(endpoints);
    etcd_tls_ = std::move(tls);
  }

  // Rank > 0: joins the group and runs the leader's steps until it stops (OK) or fails; `run`
  // runs them (a worker's followers also move their KV: worker::RunKvFollower).
  absl::Status RunFollower(
      engine::EngineOptions options,
      const std::function<absl::Status(const engine::EngineOptions&)>& run =
          engine::RunTensorParallelFollower);
  // Rank 0, before Start: refuses what no rank could run (shapes that do not divide,
  // speculation, the CUDA backend in a build without NCCL), so that the reason is said once,
  // before any rank starts.
  absl::Status CheckModel(const engine::EngineOptions& options) const;
  // Rank 0: starts the followers (one node), joins the group. Nothing for a group of one.
  absl::Status Start();
  // The group's communicator for EngineOptions::tensor_parallel; null for a group of one.
  collective::Communicator* communicator() const { return comm_.get(); }
  // Rank 0, before it destroys its engine (which releases the followers): their exits from
  // now on are expected, not a failure of the group (Finish reports how they exited). A
  // command with several groups calls it on each before destroying any engine.
  void Stopping() { stopping_ = true; }
  // Rank 0, after the engine is destroyed: with `status` OK waits for the followers it started
  // and returns the first one's failure; otherwise kills them and returns `status`.
  absl::Status Finish(absl::Status status);

 private:
  collective::GlooOptions GroupOptions() const;
  // Joins a multi-node group (--tp-leader or --tp-name) as this rank.
  absl::StatusOr<std::unique_ptr<collective::Communicator>> JoinGroup() const;
  void KillFollowers();

  std::string command_;
  std::vector<std::string> argv_;
  std::string name_;  // ConfigureNamed's
  int size_ = 1;
  int rank_ = 0;
  std::string leader_;  // --tp-leader, empty on one node
  std::string etcd_name_;  // --tp-name, empty unless the group meets on etcd
  std::string etcd_endpoints_;
  proto::TlsFiles etcd_tls_;
  std::string host_;
  bool host_given_ = false;  // --tp-host on the command line (the followers get it from argv)
  std::unique_ptr<collective::TcpStoreServer> store_;
  std::unique_ptr<collective::Communicator> comm_;
  struct Child {
    int rank;
    pid_t pid;
    int status = 0;  // as waitpid returned it
  };
  std::vector<Child> children_;
  std::vector<std::thread> watchers_;
  std::atomic<bool> finishing_{false};
  std::atomic<bool> stopping_{false};
};

}  // namespace tandem::tools
