#include "tensor_parallel_group.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"
#include "tandem/cluster/etcd_client.h"
#include "tandem/cluster/etcd_rendezvous_store.h"
#include "tandem/cluster/worker_info.h"
#include "tandem/collective/nccl_communicator.h"
#include "tandem/engine/tensor_parallel.h"

namespace tandem::tools {
namespace {

std::string DescribeExit(int status) {
  if (WIFSIGNALED(status)) {
    return absl::StrCat("was killed by signal ", WTERMSIG(status), " (",
                        strsignal(WTERMSIG(status)), ")");
  }
  return absl::StrCat("exited with status ", WEXITSTATUS(status));
}

}  // namespace

void DeclareTensorParallelFlags(Args& args) {
  args.Declare("tensor-parallel-size", "N",
               "ranks (processes) the model is split across; on one node the command starts "
               "ranks 1..N-1 itself (default 1). With --device cuda rank R runs on GPU "
               "R % (the GPUs its process sees), the activations going over NCCL");
  args.Declare("tp", "N", "alias of --tensor-parallel-size");
  args.Declare("tp-rank", "R",
               "this process's rank, for groups spanning nodes (each rank started by hand or by "
               "the LeaderWorkerSet); needs --tp-leader");
  args.Declare("tp-leader", "HOST:PORT",
               "where rank 0 serves the group's rendezvous store (rank 0 binds it)");
  args.Declare("tp-name", "NAME",
               "instead of --tp-leader on `prefill`/`decode`: the group's ranks meet on the "
               "worker's --etcd under /tandem/tp/NAME/ (one NAME per group)");
  args.Declare("tp-host", "HOST",
               "the address the other ranks reach this rank's collectives at (default 127.0.0.1 "
               "on one node, else this machine's host name)");
  args.Declare("tp-group", "NAME",
               "set by `serve` on the ranks it starts for --prefill-tp / --decode-tp: which "
               "worker's group the rank belongs to");
}

std::string TensorParallelGroupName(const Args& args) { return args.GetOr("tp-group", ""); }

absl::Status TensorParallelGroup::ConfigureNamed(const Args& args, int argc, char** argv,
                                                 const std::string& name, int size) {
  command_ = args.command();
  argv_.assign(argv, argv + argc);
  name_ = name;
  const std::string prefix = absl::StrCat(command_, ": ");
  if (size < 1 || size > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "the ", name, " worker's tensor-parallel size must be in [1, 64]"));
  }
  size_ = size;
  rank_ = 0;
  host_ = "127.0.0.1";
  if (TensorParallelGroupName(args) == name) {
    // A follower this command started for the group: its rank and the store's address.
    TANDEM_ASSIGN_OR_RETURN(int64_t rank, args.Int("tp-rank", 0));
    leader_ = args.GetOr("tp-leader", "");
    if (rank < 1 || rank >= size_ || leader_.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(prefix, "--tp-group ", name, " needs --tp-rank in [1, ", size_ - 1,
                       "] and --tp-leader"));
    }
    rank_ = static_cast<int>(rank);
  }
  return absl::OkStatus();
}

absl::Status TensorParallelGroup::Configure(const Args& args, int argc, char** argv) {
  command_ = args.command();
  argv_.assign(argv, argv + argc);
  const std::string prefix = absl::StrCat(command_, ": ");
  if (args.Has("tp-group")) {
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, "--tp-group is set by `serve --prefill-tp/--decode-tp` on the ranks it starts"));
  }
  if (args.Has("tensor-parallel-size") && args.Has("tp") &&
      *args.Get("tensor-parallel-size") != *args.Get("tp")) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "--tp and --tensor-parallel-size differ"));
  }
  TANDEM_ASSIGN_OR_RETURN(int64_t size, args.Int("tp", 1));
  TANDEM_ASSIGN_OR_RETURN(size, args.Int("tensor-parallel-size", size));
  if (size < 1 || size > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "--tensor-parallel-size must be in [1, 64]"));
  }
  size_ = static_cast<int>(size);
  TANDEM_ASSIGN_OR_RETURN(int64_t rank, args.Int("tp-rank", 0));
  leader_ = args.GetOr("tp-leader", "");
  etcd_name_ = args.GetOr("tp-name", "");
  if (!leader_.empty() && !etcd_name_.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "give one of --tp-leader and --tp-name, not both"));
  }
  if (!etcd_name_.empty()) {
    if (auto valid = cluster::ValidateKeySegment("--tp-name", etcd_name_); !valid.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(prefix, valid.message()));
    }
    if (!args.Has("tp-rank")) {
      return absl::InvalidArgumentError(
          absl::StrCat(prefix, "--tp-name needs --tp-rank (every rank of a multi-node group "
                               "is started with its rank)"));
    }
  }
  const bool multi_node = !leader_.empty() || !etcd_name_.empty();
  if (args.Has("tp-rank") && !multi_node) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "--tp-rank needs --tp-leader or --tp-name"));
  }
  if ((args.Has("tp-rank") || multi_node) && size_ == 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, "--tp-rank, --tp-leader and --tp-name need --tensor-parallel-size > 1"));
  }
  if (rank < 0 || rank >= size_) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "--tp-rank must be in [0, ", size_ - 1, "]"));
  }
  rank_ = static_cast<int>(rank);
  if (!leader_.empty() && !args.Has("tp-rank")) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix,
                     "--tp-leader needs --tp-rank (every rank of a multi-node group "
                     "is started with its rank)"));
  }
  host_given_ = args.Has("tp-host");
  if (host_given_) {
    host_ = *args.Get("tp-host");
  } else if (!multi_node) {
    host_ = "127.0.0.1";
  } else {
    char name[256] = {};
    ::gethostname(name, sizeof(name) - 1);
    host_ = name;
  }
  return absl::OkStatus();
}

collective::GlooOptions TensorParallelGroup::GroupOptions() const {
  return {.rank = rank_, .size = size_, .leader_address = leader_, .hostname = host_};
}

absl::StatusOr<std::unique_ptr<collective::Communicator>> TensorParallelGroup::JoinGroup()
    const {
  if (etcd_name_.empty()) return collective::CreateGlooCommunicator(GroupOptions());
  if (etcd_endpoints_.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(command_, ": --tp-name needs --etcd (the group meets on etcd)"));
  }
  TANDEM_ASSIGN_OR_RETURN(auto etcd, cluster::EtcdClient::Create(
                                         {.endpoints = etcd_endpoints_, .tls = etcd_tls_}));
  collective::GlooOptions options = GroupOptions();
  TANDEM_ASSIGN_OR_RETURN(auto store, cluster::EtcdRendezvousStore::Create(
                                          *etcd, absl::StrCat("/tandem/tp/", etcd_name_, "/"),
                                          rank_, options.connect_timeout));
  options.store = store.get();
  // The store's keys (and lease) go once every rank has joined.
  return collective::CreateGlooCommunicator(options);
}

absl::Status TensorParallelGroup::RunFollower(
    engine::EngineOptions options,
    const std::function<absl::Status(const engine::EngineOptions&)>& run) {
  auto comm = JoinGroup();
  if (!comm.ok()) {
    return absl::Status(comm.status().code(), absl::StrCat("tensor-parallel rank ", rank_, ": ",
                                                           comm.status().message()));
  }
  options.tensor_parallel = comm->get();
  absl::Status status = run(options);
  if (!status.ok()) {
    return absl::Status(status.code(),
                        absl::StrCat("tensor-parallel rank ", rank_, ": ", status.message()));
  }
  return status;
}

absl::Status TensorParallelGroup::CheckModel(const engine::EngineOptions& options) const {
  if (size_ == 1) return absl::OkStatus();
  if (options.device == engine::Device::kCuda && !collective::NcclBuilt()) {
    return absl::FailedPreconditionError(
        "--device cuda with --tensor-parallel-size > 1 needs NCCL, and this build has none "
        "(configure with CUDA where nccl.h and libnccl are found)");
  }
  if (options.speculative.method != engine::SpeculativeMethod::kNone) {
    return absl::UnimplementedError(
        "--speculative-method does not run with --tensor-parallel-size > 1 yet");
  }
  return engine::CheckTensorParallelModel(options.model_dir, size_);
}

absl::Status TensorParallelGroup::Start() {
  if (size_ == 1) return absl::OkStatus();
  if (!leader_.empty() || !etcd_name_.empty()) {
    // Rank 0 of a multi-node group: serves the store at --tp-leader (or meets the others on
    // etcd), starts nobody.
    auto comm = JoinGroup();
    if (!comm.ok()) return comm.status();
    comm_ = std::move(comm).value();
    return absl::OkStatus();
  }
  auto store = collective::TcpStoreServer::Start("127.0.0.1:0");
  if (!store.ok()) return store.status();
  store_ = std::move(store).value();
  const std::string self = "/proc/self/exe";
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t parent = ::getpid();
  for (int r = 1; r < size_; ++r) {
    std::vector<std::string> args = {"tandem"};
    args.insert(args.end(), argv_.begin(), argv_.end());
    for (const std::string& flag : {std::string("--tp-rank"), std::to_string(r),
                                    std::string("--tp-leader"), store_->address()}) {
      args.push_back(flag);
    }
    if (!name_.empty()) {
      args.push_back("--tp-group");
      args.push_back(name_);
    }
    if (!host_given_) {
      args.push_back("--tp-host");
      args.push_back(host_);
    }
    std::vector<char*> cargv;
    for (std::string& a : args) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    const pid_t pid = ::fork();
    if (pid < 0) {
      KillFollowers();
      return absl::InternalError(
          absl::StrCat("cannot start tensor-parallel rank ", r, ": ", std::strerror(errno)));
    }
    if (pid == 0) {
      // Dies with rank 0; its own process group, so a terminal's Ctrl-C reaches rank 0 only
      // (which shuts the group down in order); the signals serve blocks are unblocked.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(1);
      ::setpgid(0, 0);
      sigset_t none;
      sigemptyset(&none);
      ::sigprocmask(SIG_SETMASK, &none, nullptr);
      ::execv(self.c_str(), cargv.data());
      std::fprintf(stderr, "tandem %s: cannot run %s for tensor-parallel rank %d: %s\n",
                   command_.c_str(), self.c_str(), r, std::strerror(errno));
      ::_exit(127);
    }
    children_.push_back({r, pid});
  }
  for (size_t i = 0; i < children_.size(); ++i) {
    watchers_.emplace_back([this, i] {
      Child& child = children_[i];
      int status = 0;
      while (::waitpid(child.pid, &status, 0) < 0 && errno == EINTR) {
      }
      child.status = status;
      if (stopping_ || finishing_.exchange(true)) return;
      // A rank went away while the group runs: the group cannot compute another step.
      std::fprintf(stderr, "tandem %s: tensor-parallel rank %d (pid %d) %s; stopping the group\n",
                   command_.c_str(), child.rank, static_cast<int>(child.pid),
                   DescribeExit(status).c_str());
      std::fflush(stderr);
      for (const Child& other : children_) ::kill(other.pid, SIGKILL);
      ::_exit(1);
    });
  }
  auto comm = collective::CreateGlooCommunicatorWithServer(GroupOptions(), *store_);
  if (!comm.ok()) {
    KillFollowers();
    return comm.status();
  }
  comm_ = std::move(comm).value();
  return absl::OkStatus();
}

absl::Status TensorParallelGroup::Finish(absl::Status status) {
  if (finishing_.exchange(true)) {
    // A watcher saw a rank die and is ending the process with its reason; wait for it.
    while (true) ::pause();
  }
  if (!status.ok()) KillFollowers();
  for (std::thread& t : watchers_) t.join();
  watchers_.clear();
  if (status.ok()) {
    for (const Child& child : children_) {
      if (!WIFEXITED(child.status) || WEXITSTATUS(child.status) != 0) {
        status = absl::InternalError(
            absl::StrCat("tensor-parallel rank ", child.rank, " ", DescribeExit(child.status)));
        break;
      }
    }
  }
  children_.clear();
  return status;
}

void TensorParallelGroup::KillFollowers() {
  finishing_ = true;
  for (const Child& child : children_) ::kill(child.pid, SIGKILL);
}

TensorParallelGroup::~TensorParallelGroup() {
  if (!watchers_.empty()) {
    KillFollowers();
    for (std::thread& t : watchers_) t.join();
  }
}

}  // namespace tandem::tools
