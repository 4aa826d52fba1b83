// `tandem prefill` and `tandem decode`: one worker process of each pool.
#include <cstdio>
#include <string>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "commands.h"
#include "server_flags.h"
#include "tandem/base/host_port.h"
#include "tandem/base/status_macros.h"
#include "tandem/decode_worker/decode_worker.h"
#include "tandem/prefill_worker/prefill_worker.h"

namespace tandem::tools {
namespace {

struct WorkerFlags {
  engine::EngineOptions engine;
  std::string worker_id;
  std::string listen;
  std::string metrics_listen;
  std::string kv_backend;
  std::string kv_host;
};

void DeclareWorkerFlags(Args& args, int default_port) {
  DeclareEngineFlags(args);
  args.Declare("listen", "HOST:PORT",
               absl::StrCat("control-plane (gRPC) address; port 0 picks a free one (default "
                            "127.0.0.1:",
                            default_port, ")"));
  args.Declare("metrics-listen", "HOST:PORT",
               "serve GET /metrics and /health over HTTP here (default: not served)");
  args.Declare("worker-id", "ID", "name in Stats, logs and metrics (default: ROLE-PID)");
  args.Declare("kv-backend", "ucx|local", "KV transfer backend (default ucx)");
  args.Declare("kv-host", "ADDR",
               "address the KV transfer listener binds, reachable by the other pool (default "
               "127.0.0.1)");
}

absl::StatusOr<WorkerFlags> ParseWorkerFlags(const Args& args, int default_port) {
  WorkerFlags flags;
  TANDEM_ASSIGN_OR_RETURN(flags.engine, EngineFlags(args));
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
  flags.kv_backend = args.GetOr("kv-backend", "ucx");
  if (flags.kv_backend != "ucx" && flags.kv_backend != "local") {
    return absl::InvalidArgumentError(absl::StrCat(
        args.command(), ": --kv-backend must be ucx or local, got ", flags.kv_backend));
  }
  flags.kv_host = args.GetOr("kv-host", "127.0.0.1");
  return flags;
}

template <typename Worker, typename Options>
absl::Status RunWorker(const std::string& command, int default_port, int argc, char** argv) {
  const sigset_t signals = BlockStopSignals();
  Args args(command);
  DeclareWorkerFlags(args, default_port);
  TANDEM_RETURN_IF_ERROR(args.Parse(argc, argv));
  if (args.HandleHelp()) return absl::OkStatus();
  TANDEM_ASSIGN_OR_RETURN(WorkerFlags flags, ParseWorkerFlags(args, default_port));
  Options options;
  options.engine = flags.engine;
  options.worker_id = flags.worker_id;
  options.grpc_address = flags.listen;
  options.metrics_address = flags.metrics_listen;
  options.kv_backend = flags.kv_backend;
  options.kv_listen_host = flags.kv_host;
  RaiseFileLimit();
  TANDEM_ASSIGN_OR_RETURN(auto worker, Worker::Create(options));
  std::printf("tandem: %s worker %s listening on %s", command.c_str(), flags.worker_id.c_str(),
              worker->grpc_address().c_str());
  if (worker->metrics_port() > 0) std::printf(" (metrics on port %d)", worker->metrics_port());
  std::printf("\n");
  std::fflush(stdout);
  WaitForSignal(signals, "finishing requests in flight");
  worker->Shutdown(absl::Seconds(30));
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
