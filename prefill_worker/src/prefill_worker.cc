#include "tandem/prefill_worker/prefill_worker.h"

#include <algorithm>
#include <set>
#include <string>
#include <utility>

#include "absl/time/clock.h"
#include "prefill_worker_impl.h"
#include "tandem/base/status_macros.h"
#include "tandem/proto/wire.h"

namespace tandem::prefill_worker {
namespace internal {

// ---------------------------------------------------------------------------------------------
// Start and shutdown

absl::Status PrefillWorkerImpl::Start(PrefillWorkerOptions options) {
  options.engine.on_layer_kv_written = [this](int layer, std::span<const KvWritten> written) {
    OnLayerWritten(layer, written);
  };
  if (options.engine.tensor_parallel != nullptr && options.engine.tensor_parallel->size() > 1) {
    options.engine.tensor_parallel_step_attachment = [this](std::span<const KvWritten> written) {
      return FollowerOrders(written);
    };
    options.engine.tensor_parallel_step_reports = [this](std::span<const std::string> reports) {
      FollowerReports(reports);
    };
  }
  TANDEM_ASSIGN_OR_RETURN(
      core_, worker::WorkerCore::Create(std::move(options), engine::EngineRole::kPrefill));
  engine_ = &core_->engine();
  cache_layout_ = core_->kv().cache_layout();
  group_layouts_ = core_->kv().group_layouts();
  num_layers_ = cache_layout_.num_layers;
  metrics_.ttft_target.Set(core_->options().engine.ttft_slo_seconds);
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.set_role(tandem::v1::WORKER_ROLE_PREFILL);
    stats_.set_worker_id(core_->options().worker_id);
  }
  UpdateStats();

  worker::EngineLoop::Options loop;
  loop.iterate = [this] { return Iterate(); };
  loop.drained = [this] { return jobs_.empty(); };
  return core_->Serve(std::move(loop), &service_, [this] { return metrics_.registry.Render(); });
}

void PrefillWorkerImpl::Shutdown(absl::Duration grace) {
  if (core_ == nullptr) return;
  core_->Shutdown([&] {
    // Requests in flight may finish within the grace period; the loop's drain then cancels the
    // rest, waits for their transfers and answers every call.
    std::unique_lock<std::mutex> lock(mu_);
    idle_.wait_for(lock, absl::ToChronoNanoseconds(std::min(grace, absl::Hours(24))),
                   [&] { return in_flight_.empty(); });
  });
  abandoned_.clear();  // after the agent: destroying it cancelled them
  UpdateStats();
}

// ---------------------------------------------------------------------------------------------
// Handlers

absl::StatusOr<std::unique_ptr<Job>> PrefillWorkerImpl::PrepareJob(
    const tandem::v1::SubmitRequest& request, absl::Time call_deadline) {
  const tandem::v1::KvReservation& reservation = request.reservation();
  if (request.request_id().empty()) {
    return absl::InvalidArgumentError("request_id must not be empty");
  }
  TANDEM_ASSIGN_OR_RETURN(const engine::RequestTask task, proto::FromProto(request.task()));
  const bool embed = task == engine::RequestTask::kEmbed;
  if (embed && request.has_reservation()) {
    return absl::InvalidArgumentError("an embedding request takes no reservation");
  }
  if (!embed) {
    TANDEM_RETURN_IF_ERROR(
        core_->kv().CheckReceiver(reservation.endpoint(), "reservation.endpoint"));
  }

  auto job = std::make_unique<Job>();
  job->received = absl::Now();
  job->id = request.request_id();
  job->request.request_id = request.request_id();
  job->request.arrival = std::chrono::steady_clock::now();
  job->request.prompt_tokens.assign(request.prompt_token_ids().begin(),
                                    request.prompt_token_ids().end());
  job->request.params = proto::FromProto(request.sampling());
  job->request.cache_salt = request.cache_salt();
  job->request.task = task;
  job->embed = embed;
  TANDEM_RETURN_IF_ERROR(engine_->Validate(job->request));
  job->n = job->request.params.n;
  job->prompt_len = static_cast<int>(job->request.prompt_tokens.size());
  if (!embed) TANDEM_RETURN_IF_ERROR(TakeReservation(reservation, *job));

  // The deadline: the Submit's, the reservation's expiry (none for an embedding), the call's, and
  // this worker's cap.
  const absl::Time expiry = worker::FromUnixMillisOrInfinite(reservation.expires_unix_ms());
  const absl::Time deadline =
      std::min({worker::FromUnixMillisOrInfinite(request.deadline_unix_ms()), expiry, call_deadline,
                job->received + kMaxRequestTime});
  if (deadline <= job->received) {
    return absl::DeadlineExceededError(
        absl::StrCat("request ", job->id, " arrived after its deadline"));
  }
  job->deadline = deadline;
  job->transfer_deadline = std::min(expiry, job->received + kMaxRequestTime);
  job->computed.assign(job->n, 0);
  job->started.assign(job->n, false);
  job->sample_done.assign(job->n, false);

  {
    std::lock_guard<std::mutex> lock(mu_);
    if (in_flight_.count(job->id) > 0) {
      return absl::AlreadyExistsError(absl::StrCat("request ", job->id, " is already in flight"));
    }
  }
  if (embed) return job;  // nothing to push, no decode worker to reach
  for (const engine::KvHeadRun& run : job->runs) {
    Job::Destination& dst = job->dsts[run.dst_rank];
    if (run.src_rank != 0 || dst.peer != 0) continue;  // a follower's, or connected
    auto peer = core_->kv().Peer(dst.address, std::min(deadline, absl::Now() + kConnectTimeout));
    if (!peer.ok()) {
      return absl::Status(peer.status().code(),
                          absl::StrCat("request ", job->id, ": cannot reach the decode worker: ",
                                       std::string(peer.status().message())));
    }
    dst.peer = *peer;
  }
  return job;
}

absl::Status PrefillWorkerImpl::TakeReservation(const tandem::v1::KvReservation& reservation,
                                                Job& job) {
  const tandem::v1::TransferEndpoint& endpoint = reservation.endpoint();
  const int bs = cache_layout_.block_size;
  const int blocks_per_choice = (job.prompt_len + bs - 1) / bs;
  if (reservation.blocks_per_choice() != blocks_per_choice) {
    return absl::InvalidArgumentError(
        absl::StrCat("reservation.blocks_per_choice is ", reservation.blocks_per_choice(), " but ",
                     job.prompt_len, " prompt tokens take ", blocks_per_choice, " blocks of ", bs));
  }
  const int64_t want_blocks = static_cast<int64_t>(job.n) * blocks_per_choice;
  if (reservation.block_ids_size() != want_blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("reservation has ", reservation.block_ids_size(), " block ids; n = ", job.n,
                     " samples of ", blocks_per_choice, " blocks need ", want_blocks));
  }
  const int dst_cached = reservation.num_cached_tokens();
  if (dst_cached < 0 || dst_cached % bs != 0 || dst_cached > job.prompt_len) {
    return absl::InvalidArgumentError(absl::StrCat("reservation.num_cached_tokens is ", dst_cached,
                                                   "; want a multiple of ", bs, " in [0, ",
                                                   job.prompt_len, "]"));
  }
  // Each rank of the decode worker's group, and which of this group's ranks sends it which
  // heads.
  const std::vector<const tandem::v1::TransferEndpoint*> ranks = worker::RankEndpoints(endpoint);
  TANDEM_ASSIGN_OR_RETURN(std::vector<engine::KvCacheLayout> dst_layouts,
                          worker::RankLayouts(ranks));
  int num_blocks = endpoint.num_blocks();
  for (size_t r = 0; r < ranks.size(); ++r) {
    num_blocks = std::min(num_blocks, dst_layouts[r].num_blocks);
    job.dsts.push_back({.address = ranks[r]->address(),
                        .descriptors = {ranks[r]->region_descriptors().begin(),
                                        ranks[r]->region_descriptors().end()},
                        .layout = dst_layouts[r]});
  }
  absl::StatusOr<std::vector<engine::KvHeadRun>> runs =
      engine::KvHeadRuns(group_layouts_, dst_layouts);
  if (!runs.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("reservation.endpoint: the KV heads of this prefill worker's ",
                     group_layouts_.size(), " ranks do not map onto the decode worker's ",
                     dst_layouts.size(), ": ", runs.status().message()));
  }
  job.runs = std::move(runs).value();
  std::set<std::string> follower_addresses;
  for (const engine::KvHeadRun& run : job.runs) {
    if (run.src_rank != 0) follower_addresses.insert(job.dsts[run.dst_rank].address);
  }
  job.follower_addresses.assign(follower_addresses.begin(), follower_addresses.end());
  if (job.followers_push()) job.endpoint = endpoint;
  // Blocks written must be distinct; the decode worker's cached blocks (never written) are
  // shared by every sample.
  std::set<int32_t> seen;
  for (int i = 0; i < reservation.block_ids_size(); ++i) {
    const int32_t id = reservation.block_ids(i);
    if (id < 0 || id >= num_blocks) {
      return absl::InvalidArgumentError(
          absl::StrCat("reservation block id ", id, " is outside [0, ", num_blocks, ")"));
    }
    if (i % blocks_per_choice < dst_cached / bs) continue;
    if (!seen.insert(id).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("reservation block id ", id, " appears more than once"));
    }
  }
  for (int c = 0; c < job.n; ++c) {
    for (int i = 0; i < dst_cached / bs; ++i) {
      if (seen.count(reservation.block_ids(c * blocks_per_choice + i)) > 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("reservation block id ", reservation.block_ids(c * blocks_per_choice + i),
                         " is both cached and to be written"));
      }
    }
  }
  job.dst_cached_tokens = dst_cached;
  job.dst_blocks.assign(reservation.block_ids().begin(), reservation.block_ids().end());
  job.blocks_per_choice = blocks_per_choice;

  return absl::OkStatus();
}

void PrefillWorkerImpl::Submit(const grpc::CallbackServerContext& context,
                               const tandem::v1::SubmitRequest& request,
                               UnaryCall<tandem::v1::SubmitResponse>* call) {
  if (!core_->accepting()) return call->Answer(ShuttingDown());
  // Admitting may compile the request's grammar or connect to its decode worker: that runs on
  // the core's preparer, so no gRPC thread waits for it. `request` is gRPC's until the answer.
  const tandem::v1::SubmitRequest* submit = &request;
  const absl::Time call_deadline = worker::CallDeadline(context);
  if (!core_->preparer().Post([this, submit, call_deadline, call] {
                                Admit(*submit, call_deadline, call);
                              },
                              [call] { call->Answer(ShuttingDown()); })) {
    call->Answer(ShuttingDown());
  }
}

void PrefillWorkerImpl::Admit(const tandem::v1::SubmitRequest& request, absl::Time call_deadline,
                              UnaryCall<tandem::v1::SubmitResponse>* call) {
  if (!core_->accepting()) return call->Answer(ShuttingDown());
  absl::StatusOr<std::unique_ptr<Job>> job = PrepareJob(request, call_deadline);
  if (!job.ok()) return call->Answer(job.status());
  Job& ref = **job;
  ref.call = call;
  std::lock_guard<std::mutex> lock(mu_);
  if (!core_->accepting()) return call->Answer(ShuttingDown());
  if (!in_flight_.insert(ref.id).second) {
    return call->Answer(
        absl::AlreadyExistsError(absl::StrCat("request ", ref.id, " is already in flight")));
  }
  ref.serial = next_serial_++;
  // A client that goes away (or whose deadline passes) cancels the request; the flag covers a
  // cancellation that comes before the job reaches the loop.
  call->OnCancelled([this, id = ref.id, serial = ref.serial, flag = ref.call_cancelled] {
    flag->store(true);
    core_->loop().Post([this, id, serial] {
      CancelJob(
          id, serial,
          absl::CancelledError(absl::StrCat("request ", id, ": the Submit call was cancelled")),
          nullptr);
    });
  });
  // Posted under mu_, so a Cancel that finds the id in flight is posted after it.
  const std::string id = ref.id;
  auto holder = std::make_shared<std::unique_ptr<Job>>(std::move(*job));
  if (!core_->loop().Post([this, holder] { AddJob(std::move(*holder)); })) {
    in_flight_.erase(id);
    call->Answer(ShuttingDown());  // the loop has stopped
  }
}

void PrefillWorkerImpl::Cancel(const tandem::v1::CancelRequest& request,
                               UnaryCall<tandem::v1::CancelResponse>* call) {
  const std::string& id = request.request_id();
  absl::Status reason = absl::CancelledError(absl::StrCat(
      "request ", id, " was cancelled", request.reason().empty() ? "" : ": ", request.reason()));
  tandem::v1::CancelResponse found;
  found.set_found(true);
  std::lock_guard<std::mutex> lock(mu_);
  if (in_flight_.count(id) == 0) return call->Answer(tandem::v1::CancelResponse());
  // Answered once the request is over (its transfers final, its blocks freed), so that the
  // caller may release the reservation right after.
  if (!core_->loop().Post([this, id, reason, call] { CancelJob(id, 0, reason, call); })) {
    call->Answer(found);
  }
}

grpc::ServerUnaryReactor* Service::Submit(grpc::CallbackServerContext* context,
                                          const tandem::v1::SubmitRequest* request,
                                          tandem::v1::SubmitResponse* response) {
  return worker::AnswerLater(response,
                             [&](auto* call) { worker_->Submit(*context, *request, call); });
}

grpc::ServerUnaryReactor* Service::Cancel(grpc::CallbackServerContext*,
                                          const tandem::v1::CancelRequest* request,
                                          tandem::v1::CancelResponse* response) {
  return worker::AnswerLater(response, [&](auto* call) { worker_->Cancel(*request, call); });
}

}  // namespace internal

absl::StatusOr<std::unique_ptr<PrefillWorker>> PrefillWorker::Create(PrefillWorkerOptions options) {
  auto worker = std::make_unique<internal::PrefillWorkerImpl>();
  TANDEM_RETURN_IF_ERROR(worker->Start(std::move(options)));
  return worker;
}

}  // namespace tandem::prefill_worker
