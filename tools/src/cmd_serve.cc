// `tandem serve`: the embedded default. Router, one prefill worker and one decode worker in
// this process, talking over the real control plane (gRPC on loopback) with KV pages moved by
// UCX; `--colocated` serves from one engine instead. With no flags it writes the synthetic
// `small` model once into the user's cache and serves it on 127.0.0.1:8000, so a fresh machine
// has a working endpoint without downloading anything.
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "commands.h"
#include "device_flag.h"
#include "server_flags.h"
#include "tandem/base/status_macros.h"
#include "tandem/decode_worker/decode_worker.h"
#include "tandem/engine/async_engine.h"
#include "tandem/prefill_worker/prefill_worker.h"
#include "tandem/router/disaggregated_generator.h"
#include "tandem/router/openai_server.h"
#include "tandem/worker/tensor_parallel_kv.h"
#include "tensor_parallel_group.h"

namespace tandem::tools {
namespace {

// The tensor-parallel groups: the colocated engine's (`--tp`), or the workers' of
// `serve --prefill-tp N --decode-tp M`.
struct Groups {
  TensorParallelGroup engine;
  TensorParallelGroup prefill;
  TensorParallelGroup decode;
  // Before any engine is destroyed: followers exiting from now on are expected.
  void Stopping() {
    engine.Stopping();
    prefill.Stopping();
    decode.Stopping();
  }
};

absl::Status ServeOn(const Args& args, const sigset_t& signals,
                     engine::EngineOptions engine_options, router::ApiServerOptions options,
                     bool colocated, const std::string& kv_backend,
                     const router::DisaggregatedOptions& routing, Groups& groups);

absl::Status Serve(int argc, char** argv) {
  const sigset_t signals = BlockStopSignals();

  Args args("serve");
  DeclareEngineFlags(args);
  DeclareApiFlags(args);
  DeclareSloControllerFlags(args, /*tpot=*/false, /*ttft=*/false, /*policy=*/true);
  args.DeclareSwitch("colocated", "one engine does prefill and decode (no workers, no transfer)");
  DeclareRoutingFlags(args);
  args.Declare("kv-backend", "ucx|local|cuda_ipc|nccl",
               "how KV pages move from the prefill to the decode worker (default: cuda_ipc "
               "with --device cuda, else ucx; nccl needs the two workers on different GPUs)");
  DeclareTensorParallelFlags(args);
  args.Declare("prefill-tp", "N",
               "tensor-parallel ranks (processes) of the prefill worker (default 1; not with "
               "--colocated)");
  args.Declare("decode-tp", "N",
               "tensor-parallel ranks (processes) of the decode worker (default 1; not with "
               "--colocated)");
  TANDEM_RETURN_IF_ERROR(args.Parse(argc, argv));
  if (args.HandleHelp()) return absl::OkStatus();
  TANDEM_ASSIGN_OR_RETURN(int64_t prefill_tp, args.Int("prefill-tp", 1));
  TANDEM_ASSIGN_OR_RETURN(int64_t decode_tp, args.Int("decode-tp", 1));
  Groups groups;
  TANDEM_RETURN_IF_ERROR(groups.prefill.ConfigureNamed(args, argc, argv, "prefill",
                                                       static_cast<int>(prefill_tp)));
  TANDEM_RETURN_IF_ERROR(
      groups.decode.ConfigureNamed(args, argc, argv, "decode", static_cast<int>(decode_tp)));
  if (const std::string name = TensorParallelGroupName(args); !name.empty()) {
    // A follower rank of the prefill or decode worker's group that a `serve` process started.
    TensorParallelGroup& group = name == "prefill" ? groups.prefill : groups.decode;
    if (name != "prefill" && name != "decode") {
      return absl::InvalidArgumentError("serve: --tp-group must be prefill or decode");
    }
    TANDEM_ASSIGN_OR_RETURN(engine::EngineOptions engine_options, EngineFlags(args));
    TANDEM_ASSIGN_OR_RETURN(std::string kv_backend, KvBackendFlag(args, engine_options.device));
    const worker::KvEndpoint::Options kv{.backend = kv_backend,
                                         .name = absl::StrCat(name, "-0/rank", group.rank()),
                                         .role = name};
    return group.RunFollower(engine_options, [&kv](const engine::EngineOptions& engine) {
      return worker::RunKvFollower(engine, kv);
    });
  }
  TensorParallelGroup& tp = groups.engine;
  TANDEM_RETURN_IF_ERROR(tp.Configure(args, argc, argv));

  TANDEM_ASSIGN_OR_RETURN(engine::EngineOptions engine_options, EngineFlags(args));
  TANDEM_ASSIGN_OR_RETURN(router::ApiServerOptions options,
                          ApiFlags(args, engine_options.model_dir));
  const bool colocated = args.Switch("colocated");
  if (colocated && args.Has("kv-backend")) {
    return absl::InvalidArgumentError("serve: --kv-backend has no use with --colocated");
  }
  for (const char* flag : {"routing", "kv-index-max-blocks"}) {
    if (colocated && args.Has(flag)) {
      return absl::InvalidArgumentError(
          absl::StrCat("serve: --", flag, " has no use with --colocated"));
    }
  }
  router::DisaggregatedOptions routing;  // --routing, checked before any worker starts
  TANDEM_RETURN_IF_ERROR(RoutingFlags(args, routing));
  if (tp.size() > 1 && !colocated) {
    return absl::InvalidArgumentError(
        "serve: --tensor-parallel-size is for --colocated; give the workers theirs with "
        "--prefill-tp N and --decode-tp M");
  }
  for (const char* flag : {"prefill-tp", "decode-tp"}) {
    if (colocated && args.Has(flag)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "serve: --", flag, " has no use with --colocated (its engine takes --tp)"));
    }
  }
  if (tp.follower()) return tp.RunFollower(engine_options);
  std::string kv_backend;
  if (!colocated) {
    TANDEM_ASSIGN_OR_RETURN(kv_backend, KvBackendFlag(args, engine_options.device));
    if (kv_backend == "local" && (prefill_tp > 1 || decode_tp > 1)) {
      return absl::InvalidArgumentError(
          "serve: --kv-backend local moves KV within this process, and tensor-parallel ranks "
          "are processes of their own: use ucx with --prefill-tp / --decode-tp");
    }
  }
  RaiseFileLimit();
  TANDEM_RETURN_IF_ERROR(tp.CheckModel(engine_options));
  TANDEM_RETURN_IF_ERROR(groups.prefill.CheckModel(engine_options));
  TANDEM_RETURN_IF_ERROR(groups.decode.CheckModel(engine_options));
  TANDEM_RETURN_IF_ERROR(tp.Start());
  TANDEM_RETURN_IF_ERROR(groups.prefill.Start());
  TANDEM_RETURN_IF_ERROR(groups.decode.Start());
  engine_options.tensor_parallel = tp.communicator();
  // The engines (and so the followers' steps) end inside; then the groups finish.
  absl::Status status =
      ServeOn(args, signals, engine_options, options, colocated, kv_backend, routing, groups);
  return tp.Finish(groups.prefill.Finish(groups.decode.Finish(std::move(status))));
}

absl::Status ServeOn(const Args& args, const sigset_t& signals,
                     engine::EngineOptions engine_options, router::ApiServerOptions options,
                     bool colocated, const std::string& kv_backend,
                     const router::DisaggregatedOptions& routing, Groups& groups) {
  // Destroyed in reverse order: the API server (and the generator it owns) before the workers.
  std::unique_ptr<decode_worker::DecodeWorker> decode;
  std::unique_ptr<prefill_worker::PrefillWorker> prefill;
  std::unique_ptr<engine::Generator> generator;
  if (colocated) {
    TANDEM_ASSIGN_OR_RETURN(generator, engine::AsyncEngine::Create(engine_options));
  } else {
    // The API's SLO targets also size the workers' batches: TPOT the decode worker's running
    // batch, TTFT the prefill worker's steps.
    TANDEM_RETURN_IF_ERROR(SloControllerFlags(args, engine_options));
    decode_worker::DecodeWorkerOptions decode_options;
    decode_options.engine = engine_options;
    decode_options.engine.tensor_parallel = groups.decode.communicator();
    decode_options.worker_id = "decode-0";
    decode_options.kv_backend = kv_backend;
    TANDEM_ASSIGN_OR_RETURN(decode, decode_worker::DecodeWorker::Create(decode_options));
    prefill_worker::PrefillWorkerOptions prefill_options;
    prefill_options.engine = engine_options;
    prefill_options.engine.tensor_parallel = groups.prefill.communicator();
    prefill_options.worker_id = "prefill-0";
    prefill_options.kv_backend = kv_backend;
    TANDEM_ASSIGN_OR_RETURN(prefill, prefill_worker::PrefillWorker::Create(prefill_options));
    router::DisaggregatedOptions router_options;
    router_options.model_dir = engine_options.model_dir;
    router_options.max_model_len = engine_options.max_model_len;
    router_options.prefill_addresses = {prefill->grpc_address()};
    router_options.decode_addresses = {decode->grpc_address()};
    // With a TTFT target, requests predicted to miss it are refused at once.
    router_options.admission_ttft_seconds = options.ttft_slo_seconds;
    router_options.routing = routing.routing;
    router_options.kv_index_max_blocks = routing.kv_index_max_blocks;
    TANDEM_ASSIGN_OR_RETURN(generator, router::DisaggregatedGenerator::Create(router_options));
  }
  TANDEM_ASSIGN_OR_RETURN(auto server, router::ApiServer::Create(options, std::move(generator)));

  const std::string& name = options.served_model_names.front();
  const std::string host =
      options.http.host == "0.0.0.0" || options.http.host == "::" ? "127.0.0.1" : options.http.host;
  const std::string url = absl::StrCat("http://", host, ":", server->port());
  if (colocated) {
    const std::string tp = engine_options.tensor_parallel
                               ? absl::StrCat(", tensor-parallel over ",
                                              engine_options.tensor_parallel->size(), " ranks")
                               : "";
    std::printf("tandem: serving %s on %s (colocated%s)\n", name.c_str(), url.c_str(), tp.c_str());
  } else {
    auto ranks = [](const TensorParallelGroup& g) {
      return g.size() > 1 ? absl::StrCat(" over ", g.size(), " ranks") : std::string();
    };
    std::printf("tandem: serving %s on %s (prefill %s%s, decode %s%s, KV over %s)\n",
                name.c_str(), url.c_str(), prefill->grpc_address().c_str(),
                ranks(groups.prefill).c_str(), decode->grpc_address().c_str(),
                ranks(groups.decode).c_str(), kv_backend.c_str());
  }
  std::printf(
      "try:    curl %s/v1/completions -H 'Content-Type: application/json'%s -d "
      "'{\"model\": \"%s\", \"prompt\": \"Once upon a time\", \"max_tokens\": 32}'\n",
      url.c_str(), options.api_key.empty() ? "" : " -H \"Authorization: Bearer $TANDEM_API_KEY\"",
      name.c_str());
  std::fflush(stdout);

  WaitForSignal(signals, "finishing requests in flight");
  groups.Stopping();
  server->Shutdown(std::chrono::seconds(30));
  server.reset();
  if (prefill) prefill->Shutdown(absl::Seconds(5));
  if (decode) decode->Shutdown(absl::Seconds(5));
  return absl::OkStatus();
}

}  // namespace

int RunServe(int argc, char** argv) { return ExitCode("serve", Serve(argc, argv)); }

}  // namespace tandem::tools
