// The decode worker's RPCs: their checks on the gRPC thread, their bodies on the engine loop.
#include <algorithm>
#include <map>
#include <span>
#include <utility>

#include "absl/time/clock.h"
#include "decode_worker_impl.h"
#include "tandem/base/status_macros.h"
#include "tandem/proto/wire.h"

namespace tandem::decode_worker::internal {

// --- RPC bodies -------------------------------------------------------------------------------

void DecodeWorkerImpl::Reserve(const tandem::v1::ReserveRequest& request,
                               UnaryCall<tandem::v1::ReserveResponse>* call) {
  const absl::Status valid = [&]() -> absl::Status {
    if (request.request_id().empty()) return absl::InvalidArgumentError("request_id is empty");
    if (request.num_prompt_tokens() <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("num_prompt_tokens must be positive, got ", request.num_prompt_tokens()));
    }
    if (request.n() < 0 || request.n() > kMaxReserveSamples) {
      return absl::InvalidArgumentError(
          absl::StrCat("n must be in [0, ", kMaxReserveSamples, "], got ", request.n()));
    }
    if (request.prompt_token_ids_size() != 0 &&
        request.prompt_token_ids_size() != request.num_prompt_tokens()) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt_token_ids holds ", request.prompt_token_ids_size(),
                       " tokens, num_prompt_tokens is ", request.num_prompt_tokens()));
    }
    if (request.max_tokens() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("max_tokens must not be negative, got ", request.max_tokens()));
    }
    return absl::OkStatus();
  }();
  if (!valid.ok()) return call->Answer(valid);
  const absl::Time now = absl::Now();
  const absl::Time deadline = worker::FromUnixMillisOrInfinite(request.deadline_unix_ms());
  if (deadline <= now) {
    return call->Answer(absl::DeadlineExceededError(absl::StrCat(
        "the reservation deadline passed ", absl::FormatDuration(now - deadline), " ago")));
  }
  const absl::Time expires = std::min(now + options_.max_reservation_ttl, deadline);
  worker::AnswerOnLoop<tandem::v1::ReserveResponse>(
      core_->loop(), call,
      [this, request, expires]() -> absl::StatusOr<tandem::v1::ReserveResponse> {
        TANDEM_ASSIGN_OR_RETURN(tandem::v1::KvReservation reservation,
                                ReserveOnLoop(request, expires));
        tandem::v1::ReserveResponse response;
        *response.mutable_reservation() = std::move(reservation);
        return response;
      },
      Stopped());
}

absl::StatusOr<tandem::v1::KvReservation> DecodeWorkerImpl::ReserveOnLoop(
    const tandem::v1::ReserveRequest& request, absl::Time expires) {
  if (!core_->accepting()) return ShuttingDown();
  const int64_t total = static_cast<int64_t>(request.num_prompt_tokens()) + request.max_tokens();
  if (total > engine_->max_model_len()) {
    return absl::InvalidArgumentError(absl::StrCat("num_prompt_tokens + max_tokens = ", total,
                                                   " exceeds the model's context length ",
                                                   engine_->max_model_len()));
  }
  if (reserved_request_.count(request.request_id()) > 0 ||
      running_.count(request.request_id()) > 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("request ", request.request_id(), " already exists here"));
  }
  if (OverBatchLimit(std::max(1, request.n()))) {
    metrics_.slo_refusals.Increment();
    return absl::ResourceExhaustedError(absl::StrCat("the running batch is at its TPOT limit of ",
                                                     engine_->stats().batch_limit, " sequences"));
  }
  Reservation reservation;
  reservation.request_id = request.request_id();
  reservation.num_prompt_tokens = request.num_prompt_tokens();
  reservation.n = std::max(1, request.n());
  reservation.expires = expires;
  const std::span<const int32_t> prompt(request.prompt_token_ids().data(),
                                        request.prompt_token_ids_size());
  for (int i = 0; i < reservation.n; ++i) {
    int cached = 0;
    absl::StatusOr<engine::BlockTable> blocks =
        engine_->ReserveBlocks(request.num_prompt_tokens(), prompt, request.cache_salt(), &cached);
    // Every sample shares the same cached prefix: the first lookup's, or none.
    if (blocks.ok() && i == 0) {
      reservation.num_cached_tokens = cached;
    } else if (blocks.ok() && cached != reservation.num_cached_tokens) {
      engine_->FreeReservation(*blocks);
      blocks = engine_->ReserveBlocks(request.num_prompt_tokens());
    }
    if (!blocks.ok()) {
      for (engine::BlockTable& b : reservation.blocks) engine_->FreeReservation(b);
      return absl::ResourceExhaustedError(
          absl::StrCat("not enough free KV blocks for ", reservation.n, " x ",
                       request.num_prompt_tokens(), " prompt tokens: ", blocks.status().message()));
    }
    reservation.blocks.push_back(std::move(*blocks));
  }
  const std::string id = absl::StrCat(options_.worker_id, "-", next_reservation_++);
  tandem::v1::KvReservation out;
  out.set_reservation_id(id);
  for (const engine::BlockTable& blocks : reservation.blocks) {
    for (int32_t b : blocks) out.add_block_ids(b);
  }
  out.set_blocks_per_choice(static_cast<int>(reservation.blocks.front().size()));
  out.set_num_cached_tokens(reservation.num_cached_tokens);
  reservation.cached_prefix.assign(prompt.begin(), prompt.begin() + reservation.num_cached_tokens);
  reservation.cache_salt = request.cache_salt();
  *out.mutable_endpoint() = core_->kv().Describe();
  out.set_expires_unix_ms(absl::ToUnixMillis(expires));
  reserved_request_[reservation.request_id] = id;
  reservations_[id] = std::move(reservation);
  // Unstarted, it keeps its blocks a grace period past its expiry (late transfers may land).
  core_->loop().SetDeadline(ReservationKey(id), expires + kExpiryGrace, [this, id] {
    auto it = reservations_.find(id);
    if (it == reservations_.end()) return;
    DropReservation(it);
    metrics_.expired.Increment();
    PublishStats();
  });
  PublishStats();
  return out;
}

void DecodeWorkerImpl::Release(const std::string& reservation_id,
                               UnaryCall<tandem::v1::ReleaseResponse>* call) {
  worker::AnswerOnLoop<tandem::v1::ReleaseResponse>(
      core_->loop(), call,
      [this, reservation_id]() -> absl::StatusOr<tandem::v1::ReleaseResponse> {
        TANDEM_ASSIGN_OR_RETURN(bool released, ReleaseOnLoop(reservation_id));
        tandem::v1::ReleaseResponse response;
        response.set_released(released);
        return response;
      },
      Stopped());
}

absl::StatusOr<bool> DecodeWorkerImpl::ReleaseOnLoop(const std::string& reservation_id) {
  auto it = reservations_.find(reservation_id);
  // An expired reservation is left to the expiry sweep: a late transfer may land in it.
  if (it == reservations_.end() || absl::Now() > it->second.expires) return false;
  DropReservation(it);
  PublishStats();
  return true;
}

grpc::ServerWriteReactor<tandem::v1::TokenEvent>* DecodeWorkerImpl::Start(
    const tandem::v1::StartRequest& request) {
  const std::string id = request.request_id();
  // The client going away ends the request; the stream is compared so that a later Start of
  // the same id is not ended by an earlier call.
  std::shared_ptr<TokenStream> stream = TokenStream::Create([this, id](const TokenStream* gone) {
    core_->loop().Post([this, id, gone] { AbandonStream(id, gone); });
  });
  if (id.empty()) {
    stream->Fail(absl::InvalidArgumentError("request_id is empty"));
    return stream->reactor();
  }
  // Runs once: the request (prompt tokens and all) is copied here only, then moved on.
  auto start = [this, request, stream]() mutable {
    if (!core_->loop().Post([this, request = std::move(request), stream] {
          absl::Status started = StartOnLoop(request, stream);
          if (!started.ok()) stream->Fail(started);
        })) {
      stream->Fail(Stopped());
    }
  };
  if (!request.sampling().has_structured_output()) {
    start();
    return stream->reactor();
  }
  // A grammar is compiled on the core's preparer, neither on gRPC's thread nor on the engine
  // loop (once per schema: the engine's grammar cache); StartOnLoop reports a bad one.
  if (!core_->preparer().Post(
          [this, params = proto::FromProto(request.sampling()), stream,
           start = std::move(start)]() mutable {
            if (!core_->accepting()) return stream->Fail(ShuttingDown());
            engine_->PrepareConstraint(params).IgnoreError();
            start();
          },
          [stream] { stream->Fail(Stopped()); })) {
    stream->Fail(Stopped());
  }
  return stream->reactor();
}
absl::Status DecodeWorkerImpl::StartOnLoop(const tandem::v1::StartRequest& request,
                                           std::shared_ptr<TokenStream> stream) {
  if (!core_->accepting()) return ShuttingDown();
  // A client that went away before its request reached the loop: nothing to start (the
  // reservation is the router's to release, or expires).
  if (stream->abandoned()) return absl::CancelledError("the Start call was cancelled");
  auto it = reservations_.find(request.reservation_id());
  if (it == reservations_.end() || absl::Now() > it->second.expires) {
    return absl::NotFoundError(absl::StrCat("reservation '", request.reservation_id(),
                                            "' is unknown, released or expired"));
  }
  Reservation& reservation = it->second;
  // The sender finished pushing into the reservation's blocks before it called Start.
  kvtransfer::AcquireTransferred(core_->engine().kv_cache());
  if (request.choices_size() != reservation.n) {
    return absl::InvalidArgumentError(absl::StrCat("the reservation is for ", reservation.n,
                                                   " samples but ", request.choices_size(),
                                                   " choices were sent"));
  }
  if (running_.count(request.request_id()) > 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("request ", request.request_id(), " is already running"));
  }
  engine::GenerateRequest generate;
  generate.request_id = request.request_id();
  generate.prompt_tokens.assign(request.prompt_token_ids().begin(),
                                request.prompt_token_ids().end());
  generate.params = proto::FromProto(request.sampling());
  generate.cache_salt = request.cache_salt();
  if (!request.sampling().has_n()) generate.params.n = reservation.n;
  if (reservation.num_cached_tokens > 0 &&
      (request.cache_salt() != reservation.cache_salt ||
       request.prompt_token_ids_size() < reservation.num_cached_tokens ||
       !std::equal(reservation.cached_prefix.begin(), reservation.cached_prefix.end(),
                   request.prompt_token_ids().begin()))) {
    return absl::InvalidArgumentError(
        "the prompt or cache_salt differs from the reservation's, whose cached blocks hold "
        "another prefix");
  }
  std::vector<engine::PrefilledChoice> choices(reservation.n);
  std::vector<bool> seen(reservation.n, false);
  for (const tandem::v1::PrefilledChoice& wire : request.choices()) {
    if (wire.index() < 0 || wire.index() >= reservation.n || seen[wire.index()]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "choice index ", wire.index(), " is out of range or repeated (n = ", reservation.n, ")"));
    }
    seen[wire.index()] = true;
    absl::StatusOr<engine::PrefilledChoice> choice = proto::FromProto(wire);
    if (!choice.ok()) return choice.status();
    const int prompt_len = request.prompt_token_ids_size();
    if (choice->generated.empty()) {
      if (prompt_len != reservation.num_prompt_tokens) {
        return absl::InvalidArgumentError(absl::StrCat("the prompt has ", prompt_len,
                                                       " tokens but the reservation is for ",
                                                       reservation.num_prompt_tokens));
      }
    } else {
      // A continuation after a KV handoff: the reservation holds the KV of the first
      // num_prompt_tokens tokens of prompt + generated.
      const int total = prompt_len + static_cast<int>(choice->generated.size());
      if (reservation.num_prompt_tokens >= total) {
        return absl::InvalidArgumentError(absl::StrCat(
            "choice ", wire.index(), " continues ", prompt_len, " prompt + ",
            choice->generated.size(), " generated tokens, but the reservation holds the KV of ",
            reservation.num_prompt_tokens, " (want fewer than all)"));
      }
      choice->num_kv_tokens = reservation.num_prompt_tokens;
    }
    choice->blocks = reservation.blocks[wire.index()];
    choices[wire.index()] = std::move(*choice);
  }
  // On refusal the reservation stays as it was (Release or expiry frees it).
  TANDEM_RETURN_IF_ERROR(engine_->AddPrefilled(std::move(generate), std::move(choices)));
  // The engine owns the blocks now.
  const engine::KvCacheLayout& layout = engine_->cache_layout();
  metrics_.kv_cached_bytes.Increment(
      static_cast<double>(static_cast<uint64_t>(reservation.num_cached_tokens) * reservation.n *
                          layout.num_layers * 2 * layout.row_bytes()));
  Running running;
  running.stream = std::move(stream);
  running.finished.assign(reservation.n, false);
  running.num_prompt_tokens = request.prompt_token_ids_size();
  core_->loop().ClearDeadline(ReservationKey(it->first));
  reserved_request_.erase(reservation.request_id);
  reservations_.erase(it);
  running_[request.request_id()] = std::move(running);
  metrics_.requests.Increment();
  PublishStats();
  return absl::OkStatus();
}

void DecodeWorkerImpl::AbandonStream(const std::string& request_id, const TokenStream* stream) {
  auto it = running_.find(request_id);
  if (it == running_.end() || it->second.stream.get() != stream) return;
  EndRunning(request_id, absl::CancelledError("the Start call was cancelled"));
}

void DecodeWorkerImpl::Cancel(const std::string& request_id,
                              UnaryCall<tandem::v1::CancelResponse>* call) {
  worker::AnswerOnLoop<tandem::v1::CancelResponse>(
      core_->loop(), call,
      [this, request_id]() -> absl::StatusOr<tandem::v1::CancelResponse> {
        TANDEM_ASSIGN_OR_RETURN(bool found, CancelOnLoop(request_id));
        tandem::v1::CancelResponse response;
        response.set_found(found);
        return response;
      },
      Stopped());
}

absl::StatusOr<bool> DecodeWorkerImpl::CancelOnLoop(const std::string& request_id) {
  bool found = false;
  if (running_.count(request_id) > 0) {
    EndRunning(request_id, absl::OkStatus());
    found = true;
  }
  if (FreeParked(request_id, /*expired=*/false)) found = true;
  auto it = reserved_request_.find(request_id);
  if (it != reserved_request_.end()) {
    auto r = reservations_.find(it->second);
    // An expired reservation is left to the expiry sweep: a late transfer may land in it.
    if (r != reservations_.end() && absl::Now() <= r->second.expires) {
      DropReservation(r);
      found = true;
    }
  }
  PublishStats();
  return found;
}

absl::StatusOr<DecodeWorkerImpl::HandoffPlan> DecodeWorkerImpl::PlanHandoff(
    const tandem::v1::HandoffRequest& request) {
  const std::string& id = request.request_id();
  const int index = request.index();
  const tandem::v1::KvReservation& reservation = request.reservation();
  auto it = parked_.find(id);
  if (it == parked_.end() || absl::Now() > it->second.expires) {
    return absl::NotFoundError(absl::StrCat("request ", id,
                                            " has no parked KV here (unknown, handed off, "
                                            "cancelled or expired)"));
  }
  auto sample = it->second.samples.find(index);
  if (sample == it->second.samples.end()) {
    return absl::NotFoundError(
        absl::StrCat("sample ", index, " of request ", id, " is not parked here"));
  }
  ParkedSample& parked = sample->second;
  if (parked.transferring) {
    return absl::AbortedError(
        absl::StrCat("sample ", index, " of request ", id, " is being handed off already"));
  }
  const std::vector<engine::KvCacheLayout> group = core_->kv().group_layouts();
  const int block_size = group[0].block_size;
  const int need = (parked.num_kv_tokens + block_size - 1) / block_size;
  const int per_choice = reservation.blocks_per_choice();
  if (per_choice < need) {
    return absl::InvalidArgumentError(
        absl::StrCat("the reservation has ", per_choice, " blocks per sample but the KV of ",
                     parked.num_kv_tokens, " tokens takes ", need, " blocks of ", block_size));
  }
  const int64_t first = static_cast<int64_t>(request.target_index()) * per_choice;
  if (request.target_index() < 0 || first + per_choice > reservation.block_ids_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "target_index ", request.target_index(), " is outside the ", reservation.block_ids_size(),
        " block ids of the reservation (", per_choice, " per sample)"));
  }
  // Each rank of the target (one without tensor parallelism), and which rank of this worker's
  // group sends it which heads.
  const tandem::v1::TransferEndpoint& endpoint = reservation.endpoint();
  const std::vector<const tandem::v1::TransferEndpoint*> ranks = worker::RankEndpoints(endpoint);
  TANDEM_ASSIGN_OR_RETURN(std::vector<engine::KvCacheLayout> dst, worker::RankLayouts(ranks));
  absl::StatusOr<std::vector<engine::KvHeadRun>> runs = engine::KvHeadRuns(group, dst);
  if (!runs.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the KV heads of this decode worker do not map onto the target's: ",
                     runs.status().message()));
  }
  const std::vector<int32_t> src_blocks(parked.blocks.begin(), parked.blocks.begin() + need);
  const std::vector<int32_t> dst_blocks(reservation.block_ids().begin() + first,
                                        reservation.block_ids().begin() + first + need);
  for (int32_t b : dst_blocks) {
    for (const engine::KvCacheLayout& layout : dst) {
      if (b < 0 || b >= layout.num_blocks) {
        return absl::InvalidArgumentError(absl::StrCat(
            "reservation block id ", b, " is outside [0, ", layout.num_blocks, ")"));
      }
    }
  }
  HandoffPlan plan;
  plan.num_kv_tokens = parked.num_kv_tokens;
  plan.deadline = std::min(absl::Now() + kHandoffTransferMax,
                           worker::FromUnixMillisOrInfinite(reservation.expires_unix_ms()));
  std::map<int, size_t> push_of_rank;
  bool followers = false;
  for (const engine::KvHeadRun& run : *runs) {
    plan.bytes += worker::RunBytes(group[run.src_rank], run, parked.num_kv_tokens) *
                  static_cast<uint64_t>(group[run.src_rank].num_layers);
    if (run.src_rank != 0) {
      followers = true;
      continue;
    }
    auto [at, added] = push_of_rank.emplace(run.dst_rank, plan.pushes.size());
    if (added) {
      plan.pushes.push_back({ranks[run.dst_rank]->address(),
                             ranks[run.dst_rank]->region_descriptors(0), {}});
    }
    for (int layer = 0; layer < group[0].num_layers; ++layer) {
      worker::AppendTokenRanges(group[0], dst[run.dst_rank], run, layer, layer, 0,
                                parked.num_kv_tokens, 0, src_blocks, dst_blocks,
                                plan.pushes[at->second].ranges);
    }
  }
  if (followers) {
    tandem::v1::KvPushOrders orders;
    const std::string key = absl::StrCat(id, "#", index);
    tandem::v1::KvPushOrders::Destination* d = orders.add_destinations();
    d->set_request_id(key);
    *d->mutable_endpoint() = endpoint;
    d->set_deadline_unix_ms(absl::ToUnixMillis(plan.deadline));
    tandem::v1::KvPushOrders::Write* w = orders.add_writes();
    w->set_request_id(key);
    w->set_begin(0);
    w->set_end(parked.num_kv_tokens);
    w->mutable_src_blocks()->Add(src_blocks.begin(), src_blocks.end());
    w->mutable_dst_blocks()->Add(dst_blocks.begin(), dst_blocks.end());
    w->set_all_layers(true);
    plan.follower_orders = orders.SerializeAsString();
  }
  parked.transferring = true;
  return plan;
}

void DecodeWorkerImpl::EndHandoff(const std::string& id, int index, bool moved, uint64_t bytes,
                                  double seconds) {
  auto it = parked_.find(id);
  if (it == parked_.end()) return;
  auto sample = it->second.samples.find(index);
  if (sample == it->second.samples.end()) return;
  if (moved) {
    engine_->FreeReservation(sample->second.blocks);
    it->second.samples.erase(sample);
    metrics_.handoffs.Increment();
    metrics_.handoff_bytes.Increment(static_cast<double>(bytes));
    metrics_.handoff_seconds.Increment(seconds);
  } else {
    // Stays parked until it expires (its expiry may have passed during the copy).
    sample->second.transferring = false;
    core_->loop().SetDeadline(ParkedKey(id), it->second.expires,
                              [this, id] { FreeParked(id, /*expired=*/true); });
  }
  if (it->second.samples.empty()) {
    parked_.erase(it);
    core_->loop().ClearDeadline(ParkedKey(id));
  }
  PublishStats();
}

void DecodeWorkerImpl::Handoff(const tandem::v1::HandoffRequest& request,
                               UnaryCall<tandem::v1::HandoffResponse>* call) {
  // `request` is gRPC's until the call is answered.
  const tandem::v1::HandoffRequest* handoff = &request;
  if (!handoffs_->Post([this, handoff, call] { call->Answer(RunHandoff(*handoff)); },
                       [call] { call->Answer(Stopped()); })) {
    call->Answer(Stopped());
  }
}

absl::StatusOr<tandem::v1::HandoffResponse> DecodeWorkerImpl::RunHandoff(
    const tandem::v1::HandoffRequest& request) {
  const std::string& id = request.request_id();
  const int index = request.index();
  if (id.empty()) return absl::InvalidArgumentError("request_id is empty");
  const tandem::v1::TransferEndpoint& endpoint = request.reservation().endpoint();
  TANDEM_RETURN_IF_ERROR(core_->kv().CheckReceiver(endpoint, "reservation.endpoint"));
  for (const tandem::v1::TransferEndpoint* rank : worker::RankEndpoints(endpoint)) {
    if (rank->region_descriptors_size() != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "reservation.endpoint has ", rank->region_descriptors_size(),
          " region descriptors; a handoff writes into a decode worker's one region"));
    }
  }
  absl::StatusOr<HandoffPlan> plan = core_->loop().Call<absl::StatusOr<HandoffPlan>>(
      [&] { return PlanHandoff(request); }, Stopped());
  if (!plan.ok()) return plan.status();

  const uint64_t bytes = plan->bytes;
  const absl::Time begin = absl::Now();
  absl::Status moved = [&]() -> absl::Status {
    // Connections of their own: closing them also cancels whatever a failed transfer still has
    // in flight, so nothing reads the parked blocks once they are given back.
    kvtransfer::Agent& agent = core_->kv().agent();
    std::vector<kvtransfer::PeerId> peers;
    std::vector<std::unique_ptr<kvtransfer::TransferHandle>> handles;
    absl::Status status;
    for (HandoffPlan::RankPush& push : plan->pushes) {
      absl::StatusOr<kvtransfer::PeerId> peer = agent.Connect(push.address, plan->deadline);
      if (!peer.ok()) {
        status = peer.status();
        break;
      }
      peers.push_back(*peer);
      auto handle =
          core_->kv().Push(*peer, push.descriptor, std::move(push.ranges), plan->deadline);
      if (!handle.ok()) {
        status = handle.status();
        break;
      }
      handles.push_back(std::move(handle).value());
    }
    if (status.ok() && !plan->follower_orders.empty()) {
      // The followers push their heads between two steps; they answer once their pushes are
      // done (or failed).
      absl::StatusOr<std::vector<std::string>> reports =
          core_->loop().Call<absl::StatusOr<std::vector<std::string>>>(
              [&] { return engine_->TensorParallelSideChannel(plan->follower_orders); },
              Stopped());
      status = reports.status();
      for (size_t r = 0; reports.ok() && status.ok() && r < reports->size(); ++r) {
        tandem::v1::KvPushReport report;
        if (!report.ParseFromString((*reports)[r])) {
          status = absl::InternalError(absl::StrCat("rank ", r + 1, " sent an unreadable report"));
        } else if (report.failures_size() > 0) {
          status = absl::Status(static_cast<absl::StatusCode>(report.failures(0).code()),
                                report.failures(0).message());
        }
      }
    }
    for (auto& handle : handles) {
      absl::Status done = handle->Wait();
      if (status.ok()) status = done;
    }
    for (kvtransfer::PeerId peer : peers) agent.Disconnect(peer).IgnoreError();
    return status;
  }();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - begin);
  core_->loop().Call<bool>(
      [&] {
        EndHandoff(id, index, moved.ok(), bytes, seconds);
        return true;
      },
      false);
  if (!moved.ok()) {
    const absl::StatusCode code = moved.code() == absl::StatusCode::kInvalidArgument
                                      ? absl::StatusCode::kInvalidArgument
                                      : absl::StatusCode::kUnavailable;
    return absl::Status(code, absl::StrCat("handing off sample ", index, " of request ", id, ": ",
                                           std::string(moved.message())));
  }
  tandem::v1::HandoffResponse response;
  response.set_num_kv_tokens(plan->num_kv_tokens);
  response.set_kv_transfer_bytes(static_cast<int64_t>(bytes));
  response.set_kv_transfer_seconds(seconds);
  return response;
}

// --- gRPC -------------------------------------------------------------------------------------

grpc::ServerUnaryReactor* Service::Reserve(grpc::CallbackServerContext*,
                                           const tandem::v1::ReserveRequest* request,
                                           tandem::v1::ReserveResponse* response) {
  return worker::AnswerLater(response, [&](auto* call) { worker_->Reserve(*request, call); });
}

grpc::ServerUnaryReactor* Service::Release(grpc::CallbackServerContext*,
                                           const tandem::v1::ReleaseRequest* request,
                                           tandem::v1::ReleaseResponse* response) {
  return worker::AnswerLater(
      response, [&](auto* call) { worker_->Release(request->reservation_id(), call); });
}

grpc::ServerWriteReactor<tandem::v1::TokenEvent>* Service::Start(
    grpc::CallbackServerContext*, const tandem::v1::StartRequest* request) {
  return worker_->Start(*request);
}

grpc::ServerUnaryReactor* Service::Cancel(grpc::CallbackServerContext*,
                                          const tandem::v1::CancelRequest* request,
                                          tandem::v1::CancelResponse* response) {
  return worker::AnswerLater(response,
                             [&](auto* call) { worker_->Cancel(request->request_id(), call); });
}

grpc::ServerUnaryReactor* Service::Handoff(grpc::CallbackServerContext*,
                                           const tandem::v1::HandoffRequest* request,
                                           tandem::v1::HandoffResponse* response) {
  return worker::AnswerLater(response,
                             [&](auto* call) { worker_->Handoff(*request, call); });
}

}  // namespace tandem::decode_worker::internal
