// `tandem prefill` and `tandem decode`: one worker process of each pool.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <mutex>
#include <string>

#include "absl/strings/str_cat.h"
#include "commands.h"
#include "device_flag.h"
#include "server_flags.h"
#include "tandem/base/host_port.h"
#include "tandem/base/status_macros.h"
#include "tandem/cluster/etcd_client.h"
#include "tandem/cluster/registration.h"
#include "tandem/decode_worker/decode_worker.h"
#include "tandem/prefill_worker/prefill_worker.h"
#include "tandem/worker/status_server.h"
#include "tandem/worker/tensor_parallel_kv.h"
#include "tensor_parallel_group.h"

namespace tandem::tools {
namespace {

struct WorkerFlags {
  engine::EngineOptions engine;
  std::string worker_id;
  std::string listen;
  std::string metrics_listen;
  std::string kv_backend;
  std::string kv_host;
  // Discovery (docs/operations.md): empty etcd means none.
  std::string etcd;
  std::string cluster;
  int64_t lease_ttl_s = 10;
  std::string advertise;
  // On SIGTERM, how long requests in flight may run before the rest are handed off (decode:
  // parked for KV handoff) or failed.
  int64_t drain_grace_s = 30;
  // Mutual TLS on the control plane and to etcd; empty: plaintext.
  proto::TlsFiles tls;
};

void DeclareWorkerFlags(Args& args, int default_port) {
  DeclareEngineFlags(args);
  DeclareSloControllerFlags(args, /*tpot=*/args.command() == "decode",
                            /*ttft=*/args.command() == "prefill",
                            /*policy=*/args.command() == "prefill");
  args.Declare("listen", "HOST:PORT",
               absl::StrCat("control-plane (gRPC) address; port 0 picks a free one (default "
                            "127.0.0.1:",
                            default_port, ")"));
  args.Declare("metrics-listen", "HOST:PORT",
               "serve GET /metrics and /health over HTTP here (default: not served)");
  args.Declare("worker-id", "ID", "name in Stats, logs and metrics (default: ROLE-PID)");
  args.Declare("kv-backend", "ucx|local|cuda_ipc|nccl",
               "KV transfer backend (default: cuda_ipc with --device cuda, else ucx; nccl: "
               "device memory between GPUs, also across nodes)");
  args.Declare("kv-host", "ADDR",
               "address the KV transfer listener binds, reachable by the other pool (default "
               "127.0.0.1)");
  args.Declare("etcd", "ENDPOINTS",
               "register in etcd (comma-separated http://HOST:PORT list; https:// with "
               "--tls-ca) so routers discover this worker (default: no registration)");
  args.Declare("cluster", "NAME", "cluster name, the etcd key prefix /tandem/NAME/ (default "
               "default)");
  args.Declare("lease-ttl", "SECONDS",
               "etcd lease TTL: a worker that stops renewing disappears after this (default 10)");
  args.Declare("advertise", "HOST:PORT",
               "control-plane address published in etcd for others to dial (default: the bound "
               "--listen address)");
  args.Declare("drain-grace", "SECONDS",
               args.command() == "decode"
                   ? "on SIGTERM, let running requests finish for this long, then park the rest "
                     "so routers move them with their KV to another decode worker (default 30)"
                   : "on SIGTERM, let requests in flight finish for this long, then fail the rest "
                     "so routers retry them elsewhere (default 30)");
  DeclareTlsFlags(args, "the control plane (routers must present a certificate) and etcd");
}

bool IsWildcardHost(const std::string& host) {
  return host.empty() || host == "0.0.0.0" || host == "::" || host == "[::]";
}

absl::StatusOr<WorkerFlags> ParseWorkerFlags(const Args& args, int default_port) {
  WorkerFlags flags;
  TANDEM_ASSIGN_OR_RETURN(flags.engine, EngineFlags(args));
  TANDEM_RETURN_IF_ERROR(SloControllerFlags(args, flags.engine));
  TANDEM_ASSIGN_OR_RETURN(flags.tls, TlsFlags(args));
  flags.listen = args.GetOr("listen", absl::StrCat("127.0.0.1:", default_port));
  flags.metrics_listen = args.GetOr("metrics-listen", "");
  for (const auto& [flag, value] : {std::pair<std::string, std::string>{"listen", flags.listen},
                                    {"metrics-listen", flags.metrics_listen}}) {
    if (!value.empty() && !SplitHostPort(value).ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(args.command(), ": --", flag, " must be HOST:PORT, got ", value));
    }
  }
  flags.worker_id = args.GetOr("worker-id", absl::StrCat(args.command(), "-", getpid()));
  TANDEM_ASSIGN_OR_RETURN(flags.kv_backend, KvBackendFlag(args, flags.engine.device));
  flags.kv_host = args.GetOr("kv-host", "127.0.0.1");
  flags.etcd = args.GetOr("etcd", "");
  flags.cluster = args.GetOr("cluster", "default");
  TANDEM_ASSIGN_OR_RETURN(flags.lease_ttl_s, IntFlag(args, "lease-ttl", 10, 1, 3600));
  flags.advertise = args.GetOr("advertise", "");
  TANDEM_ASSIGN_OR_RETURN(flags.drain_grace_s, IntFlag(args, "drain-grace", 30, 0, 3600));
  if (flags.etcd.empty()) {
    for (const char* flag : {"cluster", "lease-ttl", "advertise"}) {
      if (args.Has(flag)) {
        return absl::InvalidArgumentError(
            absl::StrCat(args.command(), ": --", flag, " needs --etcd"));
      }
    }
    return flags;
  }
  if (auto endpoints = cluster::ParseEndpoints(flags.etcd, flags.tls.enabled());
      !endpoints.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(args.command(), ": --etcd: ", endpoints.status().message()));
  }
  if (auto status = cluster::ValidateKeySegment("--cluster", flags.cluster); !status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(args.command(), ": ", status.message()));
  }
  if (auto status = cluster::ValidateKeySegment("--worker-id", flags.worker_id); !status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(args.command(), ": ", status.message()));
  }
  if (!flags.advertise.empty()) {
    auto host_port = SplitHostPort(flags.advertise);
    if (!host_port.ok() || host_port->second == 0 || IsWildcardHost(host_port->first)) {
      return absl::InvalidArgumentError(absl::StrCat(
          args.command(), ": --advertise must be a dialable HOST:PORT, got ", flags.advertise));
    }
  }
  return flags;
}

// The lease-loss reason, handed from the registration's thread to the one waiting for signals.
std::mutex lost_mu;
std::string lost_reason;

// Registers the worker in etcd with --etcd; nullptr without it.
absl::StatusOr<std::unique_ptr<cluster::WorkerRegistration>> RegisterWorker(
    const std::string& command, const WorkerFlags& flags, const std::string& bound_address,
    int metrics_port, int64_t kv_blocks_total) {
  if (flags.etcd.empty()) return nullptr;
  cluster::WorkerInfo info;
  info.id = flags.worker_id;
  info.role = command;
  info.address = flags.advertise;
  if (info.address.empty()) {
    TANDEM_ASSIGN_OR_RETURN(auto bound, SplitHostPort(bound_address));
    if (IsWildcardHost(bound.first)) {
      return absl::InvalidArgumentError(absl::StrCat(
          command, ": --listen ", flags.listen,
          " binds every interface; say which address others dial with --advertise HOST:PORT"));
    }
    info.address = bound_address;
  }
  if (metrics_port > 0) {
    TANDEM_ASSIGN_OR_RETURN(auto metrics, SplitHostPort(flags.metrics_listen));
    std::string host = metrics.first;
    if (IsWildcardHost(host)) host = SplitHostPort(info.address)->first;
    if (host.find(':') != std::string::npos) host = absl::StrCat("[", host, "]");
    info.metrics_address = absl::StrCat(host, ":", metrics_port);
  }
  info.kv_backend = flags.kv_backend;
  info.kv_blocks_total = kv_blocks_total;
  TANDEM_ASSIGN_OR_RETURN(auto etcd,
                          cluster::EtcdClient::Create({.endpoints = flags.etcd, .tls = flags.tls}));
  cluster::RegistrationOptions options;
  options.cluster = flags.cluster;
  options.worker = info;
  options.ttl = absl::Seconds(flags.lease_ttl_s);
  options.on_lost = [](absl::Status why) {
    {
      std::lock_guard lock(lost_mu);
      lost_reason = std::string(why.message());
    }
    // Wakes the main thread's sigwait (every thread blocks SIGUSR1).
    kill(getpid(), SIGUSR1);
  };
  auto registration = cluster::WorkerRegistration::Register(std::move(etcd), std::move(options));
  if (!registration.ok()) {
    return absl::Status(registration.status().code(),
                        absl::StrCat(command, ": registering in etcd (", flags.etcd,
                                     "): ", registration.status().message()));
  }
  return registration;
}

template <typename Worker, typename Options>
absl::Status ServeWorker(const std::string& command, const sigset_t& signals,
                         const WorkerFlags& flags, TensorParallelGroup& tp);

template <typename Worker, typename Options>
absl::Status RunWorker(const std::string& command, int default_port, int argc, char** argv) {
  sigset_t signals = BlockStopSignals();
  // SIGUSR1: the etcd registration lost its lease (see RegisterWorker).
  sigaddset(&signals, SIGUSR1);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  Args args(command);
  DeclareWorkerFlags(args, default_port);
  DeclareTensorParallelFlags(args);
  TANDEM_RETURN_IF_ERROR(args.Parse(argc, argv));
  if (args.HandleHelp()) return absl::OkStatus();
  TensorParallelGroup tp;
  TANDEM_RETURN_IF_ERROR(tp.Configure(args, argc, argv));
  TANDEM_ASSIGN_OR_RETURN(WorkerFlags flags, ParseWorkerFlags(args, default_port));
  tp.UseEtcd(flags.etcd, flags.tls);
  if (tp.follower()) {
    // Ranks 1..N-1 hold their shards and KV heads; rank 0 serves, registers and schedules.
    const worker::KvEndpoint::Options kv{
        .backend = flags.kv_backend,
        .name = absl::StrCat(flags.worker_id, "/rank", tp.rank()),
        .role = command,
        .listen_host = flags.kv_host};
    // A rank of a group that meets on etcd runs in a pod of its own (a LeaderWorkerSet worker):
    // it answers the pod's probes at --metrics-listen. (On one node the launcher's followers
    // share rank 0's flags, so they must not bind its port.)
    std::unique_ptr<worker::StatusServer> status;
    if (tp.meets_on_etcd() && !flags.metrics_listen.empty()) {
      TANDEM_ASSIGN_OR_RETURN(
          status, worker::StatusServer::Create(
                      flags.metrics_listen, [] { return false; }, [] { return std::string(); }));
      std::printf("tandem: %s tensor-parallel rank %d: health on port %d\n", command.c_str(),
                  tp.rank(), status->port());
      std::fflush(stdout);
    }
    return tp.RunFollower(flags.engine, [&kv](const engine::EngineOptions& engine) {
      return worker::RunKvFollower(engine, kv);
    });
  }
  TANDEM_RETURN_IF_ERROR(tp.CheckModel(flags.engine));
  TANDEM_RETURN_IF_ERROR(tp.Start());
  flags.engine.tensor_parallel = tp.communicator();
  // The worker (and so the followers' steps) ends inside; then the group finishes.
  return tp.Finish(ServeWorker<Worker, Options>(command, signals, flags, tp));
}

template <typename Worker, typename Options>
absl::Status ServeWorker(const std::string& command, const sigset_t& signals,
                         const WorkerFlags& flags, TensorParallelGroup& tp) {
  Options options;
  options.engine = flags.engine;
  options.worker_id = flags.worker_id;
  options.grpc_address = flags.listen;
  options.metrics_address = flags.metrics_listen;
  options.kv_backend = flags.kv_backend;
  options.kv_listen_host = flags.kv_host;
  options.tls = flags.tls;
  RaiseFileLimit();
  TANDEM_ASSIGN_OR_RETURN(auto worker, Worker::Create(options));
  std::printf("tandem: %s worker %s listening on %s", command.c_str(), flags.worker_id.c_str(),
              worker->grpc_address().c_str());
  if (worker->metrics_port() > 0) std::printf(" (metrics on port %d)", worker->metrics_port());
  std::printf("\n");
  std::fflush(stdout);
  auto registration = RegisterWorker(command, flags, worker->grpc_address(),
                                     worker->metrics_port(), worker->Stats().kv_blocks_total());
  if (!registration.ok()) {
    worker->Shutdown(absl::ZeroDuration());
    return registration.status();
  }
  if (*registration != nullptr) {
    std::printf("tandem: %s worker %s registered in etcd as %s (lease TTL %llds)\n",
                command.c_str(), flags.worker_id.c_str(), (*registration)->key().c_str(),
                static_cast<long long>(flags.lease_ttl_s));
    std::fflush(stdout);
  }
  int received = 0;
  do {
    sigwait(&signals, &received);
  } while (received == SIGUSR1 && *registration == nullptr);
  tp.Stopping();  // the worker's engine releases its followers as it shuts down
  if (received == SIGUSR1) {
    // The lease is gone: routers have dropped this worker, so it stops serving.
    std::string reason;
    {
      std::lock_guard lock(lost_mu);
      reason = lost_reason;
    }
    (void)(*registration)->Unregister();
    std::fprintf(stderr, "tandem: %s lost its etcd registration, shutting down\n",
                 command.c_str());
    worker->Shutdown(absl::Seconds(10));
    return absl::UnavailableError(absl::StrCat("lost the etcd lease: ", reason));
  }
  std::fprintf(stderr, "tandem: %s received, %sfinishing requests in flight\n",
               received == SIGINT ? "SIGINT" : "SIGTERM",
               *registration != nullptr ? "unregistering from etcd, " : "");
  if (*registration != nullptr) {
    if (absl::Status status = (*registration)->Unregister(); !status.ok()) {
      std::fprintf(stderr, "tandem: %s: unregistering from etcd: %s\n", command.c_str(),
                   std::string(status.message()).c_str());
    }
  }
  worker->Shutdown(absl::Seconds(flags.drain_grace_s));
  return absl::OkStatus();
}

}  // namespace

int RunPrefill(int argc, char** argv) {
  return ExitCode("prefill",
                  RunWorker<prefill_worker::PrefillWorker, prefill_worker::PrefillWorkerOptions>(
                      "prefill", 7001, argc, argv));
}

int RunDecode(int argc, char** argv) {
  return ExitCode("decode",
                  RunWorker<decode_worker::DecodeWorker, decode_worker::DecodeWorkerOptions>(
                      "decode", 7002, argc, argv));
}

}  // namespace tandem::tools
