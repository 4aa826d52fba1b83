#include "tandem/worker/worker_core.h"

#include <unistd.h>

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"
#include "tandem/worker/tensor_parallel_kv.h"

namespace tandem::worker {
namespace {

std::string RoleName(engine::EngineRole role) {
  switch (role) {
    case engine::EngineRole::kPrefill:
      return "prefill";
    case engine::EngineRole::kDecode:
      return "decode";
    default:
      return "colocated";
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<WorkerCore>> WorkerCore::Create(WorkerOptions options,
                                                               engine::EngineRole role) {
  std::unique_ptr<WorkerCore> core(new WorkerCore());
  const std::string role_name = RoleName(role);
  if (options.worker_id.empty()) options.worker_id = absl::StrCat(role_name, "-", getpid());
  options.engine.role = role;
  core->options_ = std::move(options);
  TANDEM_ASSIGN_OR_RETURN(core->engine_, engine::LlmEngine::Create(core->options_.engine));
  TANDEM_ASSIGN_OR_RETURN(core->kv_,
                          KvEndpoint::Create({.backend = core->options_.kv_backend,
                                              .name = core->options_.worker_id,
                                              .role = role_name,
                                              .listen_host = core->options_.kv_listen_host},
                                             *core->engine_));
  if (collective::Communicator* comm = core->options_.engine.tensor_parallel;
      comm != nullptr && comm->size() > 1) {
    // The followers (RunKvFollower) registered their caches too: every rank's endpoint goes
    // into this worker's reservations and pushes.
    TANDEM_ASSIGN_OR_RETURN(std::vector<tandem::v1::TransferEndpoint> ranks,
                            GatherRankEndpoints(*comm, core->kv_->Describe()));
    TANDEM_ASSIGN_OR_RETURN(std::vector<engine::KvCacheLayout> layouts, RankLayouts(ranks));
    core->kv_->SetGroup(std::move(ranks), std::move(layouts));
  }
  core->kv_events_ = std::make_unique<KvEventHub>(core->engine_->block_manager());
  return core;
}

WorkerCore::~WorkerCore() {
  Shutdown([] {});
}

absl::Status WorkerCore::Serve(EngineLoop::Options loop, grpc::Service* service,
                               std::function<std::string()> render_metrics) {
  // The KV events of each iteration (its posted calls and its step) go out after it.
  loop.iterate = [this, iterate = std::move(loop.iterate)] {
    const absl::Duration wake = iterate ? iterate() : absl::InfiniteDuration();
    kv_events_->Publish();
    return wake;
  };
  // Started here, not in Create: its threads then begin after the role has set up what their
  // jobs read (the role calls Serve last).
  preparer_ = std::make_unique<base::JobPool>(kPreparerThreads);
  loop_ = std::make_unique<EngineLoop>(std::move(loop));
  loop_->Start();
  TANDEM_ASSIGN_OR_RETURN(proto::StartedServer started,
                          proto::StartGrpcServer(options_.grpc_address, service, options_.tls));
  server_ = std::move(started.server);
  grpc_address_ = std::move(started.address);
  if (!options_.metrics_address.empty()) {
    TANDEM_ASSIGN_OR_RETURN(status_, StatusServer::Create(
                                         options_.metrics_address, [this] { return !accepting(); },
                                         std::move(render_metrics)));
  }
  return absl::OkStatus();
}

void WorkerCore::Shutdown(const std::function<void()>& wind_down) {
  std::call_once(shutdown_once_, [&] {
    accepting_.store(false);
    if (loop_ != nullptr) {
      wind_down();
      loop_->Stop();
    }
    if (kv_events_ != nullptr) kv_events_->Close();
    if (server_ != nullptr) {
      server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
      server_->Wait();
      server_.reset();
    }
    // Every call has had its answer: nothing queued here is owed one any more.
    if (preparer_ != nullptr) preparer_->Stop();
    if (status_ != nullptr) status_->Stop();
    if (kv_ != nullptr) kv_->Close();
  });
}

}  // namespace tandem::worker
