// `tandem router`: the OpenAI-compatible API in front of pools of prefill and decode workers.
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "commands.h"
#include "server_flags.h"
#include "tandem/base/host_port.h"
#include "tandem/base/status_macros.h"
#include "tandem/cluster/etcd_client.h"
#include "tandem/router/disaggregated_generator.h"
#include "tandem/router/openai_server.h"

namespace tandem::tools {
namespace {

absl::StatusOr<std::vector<std::string>> Addresses(const Args& args, const std::string& flag) {
  if (!args.Has(flag)) {
    return absl::InvalidArgumentError(
        absl::StrCat("router: --", flag, " HOST:PORT[,HOST:PORT...] (or --etcd) is required"));
  }
  std::vector<std::string> out;
  for (absl::string_view part : absl::StrSplit(*args.Get(flag), ',', absl::SkipWhitespace())) {
    std::string address(part);
    absl::StatusOr<std::pair<std::string, int>> host_port = SplitHostPort(address);
    if (!host_port.ok() || host_port->second == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("router: --", flag, " entry '", address, "' is not HOST:PORT"));
    }
    out.push_back(address);
  }
  if (out.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("router: --", flag, " names no worker"));
  }
  return out;
}

absl::Status Router(int argc, char** argv) {
  const sigset_t signals = BlockStopSignals();
  Args args("router");
  args.Declare("prefill", "ADDR[,ADDR]", "control-plane addresses of the prefill workers");
  args.Declare("decode", "ADDR[,ADDR]", "control-plane addresses of the decode workers");
  args.Declare("etcd", "ENDPOINTS",
               "discover the workers registered in etcd instead of (or besides) the lists");
  args.Declare("cluster", "NAME", "with --etcd: the cluster's key prefix (default 'default')");
  args.Declare("model", "DIR",
               "checkpoint directory the workers serve (the router reads its tokenizer, chat "
               "template and config, not its weights)");
  args.Declare("max-model-len", "N", "context length (default: the model's)");
  args.Declare("admission-timeout-ms", "N",
               "how long a request may wait for KV room on a decode worker (default 30000)");
  DeclareRoutingFlags(args);
  DeclareApiFlags(args);
  DeclareTlsFlags(args, "the channels to the workers and etcd");
  TANDEM_RETURN_IF_ERROR(args.Parse(argc, argv));
  if (args.HandleHelp()) return absl::OkStatus();

  router::DisaggregatedOptions options;
  options.etcd_endpoints = args.GetOr("etcd", "");
  if (args.Has("cluster") && options.etcd_endpoints.empty()) {
    return absl::InvalidArgumentError("router: --cluster needs --etcd");
  }
  options.cluster = args.GetOr("cluster", "default");
  TANDEM_ASSIGN_OR_RETURN(options.tls, TlsFlags(args));
  if (!options.etcd_endpoints.empty()) {
    if (auto endpoints = cluster::ParseEndpoints(options.etcd_endpoints, options.tls.enabled());
        !endpoints.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("router: --etcd: ", endpoints.status().message()));
    }
  }
  if (options.etcd_endpoints.empty() || args.Has("prefill")) {
    TANDEM_ASSIGN_OR_RETURN(options.prefill_addresses, Addresses(args, "prefill"));
  }
  if (options.etcd_endpoints.empty() || args.Has("decode")) {
    TANDEM_ASSIGN_OR_RETURN(options.decode_addresses, Addresses(args, "decode"));
  }
  if (!args.Has("model")) return absl::InvalidArgumentError("router: --model DIR is required");
  options.model_dir = *args.Get("model");
  TANDEM_ASSIGN_OR_RETURN(int64_t max_len, IntFlag(args, "max-model-len", 0, 0, 1 << 24));
  options.max_model_len = static_cast<int>(max_len);
  TANDEM_ASSIGN_OR_RETURN(int64_t admission,
                          IntFlag(args, "admission-timeout-ms", 30000, 0, 3600000));
  options.admission_timeout = absl::Milliseconds(admission);
  TANDEM_RETURN_IF_ERROR(RoutingFlags(args, options));
  TANDEM_ASSIGN_OR_RETURN(router::ApiServerOptions api, ApiFlags(args, options.model_dir));
  // With a TTFT target, requests predicted to miss it are refused at once.
  options.admission_ttft_seconds = api.ttft_slo_seconds;
  RaiseFileLimit();

  TANDEM_ASSIGN_OR_RETURN(auto generator, router::DisaggregatedGenerator::Create(options));
  TANDEM_ASSIGN_OR_RETURN(auto server, router::ApiServer::Create(api, std::move(generator)));
  const std::string host =
      api.http.host == "0.0.0.0" || api.http.host == "::" ? "127.0.0.1" : api.http.host;
  if (options.etcd_endpoints.empty()) {
    std::printf("tandem: routing %s on http://%s:%d (prefill %s; decode %s; %s routing)\n",
                api.served_model_names.front().c_str(), host.c_str(), server->port(),
                absl::StrJoin(options.prefill_addresses, ",").c_str(),
                absl::StrJoin(options.decode_addresses, ",").c_str(),
                router::RoutingName(options.routing));
  } else {
    std::printf(
        "tandem: routing %s on http://%s:%d (workers of cluster '%s' in etcd %s; %s routing)\n",
        api.served_model_names.front().c_str(), host.c_str(), server->port(),
        options.cluster.c_str(), options.etcd_endpoints.c_str(),
        router::RoutingName(options.routing));
  }
  std::fflush(stdout);
  WaitForSignal(signals, "finishing requests in flight");
  server->Shutdown(std::chrono::seconds(30));
  return absl::OkStatus();
}

}  // namespace

int RunRouter(int argc, char** argv) { return ExitCode("router", Router(argc, argv)); }

}  // namespace tandem::tools
