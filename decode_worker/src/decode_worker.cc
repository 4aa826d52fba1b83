#include "tandem/decode_worker/decode_worker.h"

#include <utility>

#include "absl/time/clock.h"
#include "decode_worker_impl.h"
#include "tandem/base/status_macros.h"
#include "tandem/proto/wire.h"

namespace tandem::decode_worker {
namespace internal {

absl::Status DecodeWorkerImpl::Init(DecodeWorkerOptions options) {
  if (options.max_reservation_ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("max_reservation_ttl must be positive");
  }
  if (options.handoff_ttl < absl::ZeroDuration() || options.handoff_ttl > kMaxHandoffTtl) {
    return absl::InvalidArgumentError(absl::StrCat("handoff_ttl must be in [0, ",
                                                   absl::FormatDuration(kMaxHandoffTtl), "], got ",
                                                   absl::FormatDuration(options.handoff_ttl)));
  }
  options_ = options;
  TANDEM_ASSIGN_OR_RETURN(
      core_, worker::WorkerCore::Create(std::move(options), engine::EngineRole::kDecode));
  options_.worker_id = core_->options().worker_id;
  engine_ = &core_->engine();
  snapshot_ = ComputeStats();
  metrics_.tpot_target.Set(options_.engine.tpot_slo_seconds);
  metrics_.batch_limit.Set(options_.engine.max_num_seqs);

  worker::EngineLoop::Options loop;
  loop.iterate = [this] { return Iterate(); };
  loop.finish = [this] { FinishLoop(); };
  handoffs_ = std::make_unique<base::JobPool>(kHandoffThreads);
  return core_->Serve(std::move(loop), &service_, [this] { return RenderMetrics(); });
}

std::string DecodeWorkerImpl::RenderMetrics() {
  const tandem::v1::WorkerStats stats = Stats();
  // From the published snapshot (reservations included), not the engine's own counts.
  metrics_.engine.kv_used.Set(stats.kv_blocks_used());
  metrics_.engine.kv_capacity.Set(stats.kv_blocks_total());
  metrics_.engine.running.Set(stats.running());
  metrics_.engine.waiting.Set(stats.waiting());
  metrics::AdvanceTo(metrics_.engine.preemptions, static_cast<double>(stats.preemptions_total()));
  metrics_.kv_reserved.Set(stats.kv_blocks_reserved());
  metrics_.reservations.Set(stats.reservations());
  return metrics_.registry.Render();
}

// --- the engine loop --------------------------------------------------------------------------

absl::Duration DecodeWorkerImpl::Iterate() {
  if (engine_->has_unfinished()) StepEngine();
  const engine::EngineStats stats = engine_->stats();
  metrics_.engine.RecordSteps(stats);  // the counts come from the snapshot at each scrape
  metrics_.batch_limit.Set(stats.batch_limit);
  metrics_.step_gap.Set(stats.step_gap_seconds);
  PublishStats();
  return engine_->has_unfinished() ? absl::ZeroDuration() : absl::InfiniteDuration();
}

void DecodeWorkerImpl::FinishLoop() {
  // Nothing outlives the loop: requests still running (none after a normal Shutdown) end with
  // an error, reservations are freed.
  std::vector<std::string> ids;
  for (const auto& [id, running] : running_) ids.push_back(id);
  for (const std::string& id : ids) {
    EndRunning(id, absl::UnavailableError("the decode worker shut down"));
  }
  while (!reservations_.empty()) DropReservation(reservations_.begin());
  // No Handoff runs any more (its calls find the loop stopped): parked blocks go too.
  for (auto& [id, parked] : parked_) {
    for (auto& [index, sample] : parked.samples) engine_->FreeReservation(sample.blocks);
  }
  parked_.clear();
  PublishStats();
}

bool DecodeWorkerImpl::FreeParked(const std::string& request_id, bool expired) {
  auto it = parked_.find(request_id);
  if (it == parked_.end()) return false;
  auto& samples = it->second.samples;
  for (auto s = samples.begin(); s != samples.end();) {
    if (s->second.transferring) {
      ++s;  // the Handoff in progress frees it (or leaves it to expire)
      continue;
    }
    engine_->FreeReservation(s->second.blocks);
    if (expired) metrics_.parked_expired.Increment();
    s = samples.erase(s);
  }
  if (samples.empty()) {
    parked_.erase(it);
    core_->loop().ClearDeadline(ParkedKey(request_id));
  }
  PublishStats();
  return true;
}

void DecodeWorkerImpl::DropReservation(std::map<std::string, Reservation>::iterator it) {
  for (engine::BlockTable& blocks : it->second.blocks) engine_->FreeReservation(blocks);
  core_->loop().ClearDeadline(ReservationKey(it->first));
  reserved_request_.erase(it->second.request_id);
  reservations_.erase(it);
}

bool DecodeWorkerImpl::OverBatchLimit(int n) const {
  if (options_.engine.tpot_slo_seconds <= 0) return false;
  const engine::EngineStats stats = engine_->stats();
  int reserved = 0;
  for (const auto& [id, reservation] : reservations_) reserved += reservation.n;
  const int committed = stats.running + stats.waiting + reserved;
  // An idle worker takes any request; a busy one only what fits under the cap, so requests
  // beyond it queue at the router (before their prefill), not here between their first and
  // second tokens.
  return committed > 0 && committed + n > stats.batch_limit;
}
void DecodeWorkerImpl::StepEngine() {
  absl::StatusOr<std::vector<engine::RequestOutput>> outputs = engine_->Step();
  if (!outputs.ok()) {
    // The step failed as a whole: every running request ends with the error, so its stream
    // reports it and its blocks are freed.
    std::vector<std::string> ids;
    for (const auto& [id, running] : running_) ids.push_back(id);
    for (const std::string& id : ids) EndRunning(id, outputs.status());
    return;
  }
  for (engine::RequestOutput& out : *outputs) {
    auto it = running_.find(out.request_id);
    if (it == running_.end()) continue;  // aborted since (first tokens of an ended request)
    Running& running = it->second;
    std::vector<tandem::v1::TokenEvent> events;
    for (engine::ChoiceDelta& delta : out.choices) {
      tandem::v1::TokenEvent& event = events.emplace_back();
      event.set_request_id(out.request_id);
      event.set_index(delta.index);
      for (int32_t t : delta.token_ids) event.add_token_ids(t);
      event.set_text(std::move(delta.text));
      for (float lp : delta.logprobs) event.add_logprobs(lp);
      for (const std::vector<engine::TokenLogprob>& top : delta.top_logprobs) {
        tandem::v1::TopLogprobs* entries = event.add_top_logprobs();
        for (const engine::TokenLogprob& t : top) {
          tandem::v1::TokenLogprob* entry = entries->add_entries();
          entry->set_token_id(t.token);
          entry->set_logprob(t.logprob);
        }
      }
      event.set_finish_reason(proto::ToProto(delta.finish_reason));
      if (delta.finish_reason != engine::FinishReason::kNone && delta.index >= 0 &&
          delta.index < static_cast<int>(running.finished.size())) {
        running.finished[delta.index] = true;
      }
      metrics_.generation_tokens.Increment(static_cast<double>(delta.token_ids.size()));
    }
    running.num_generation_tokens = out.num_generation_tokens;
    if (out.finished && !events.empty()) {
      tandem::v1::Usage* usage = events.back().mutable_usage();
      usage->set_prompt_tokens(running.num_prompt_tokens);
      usage->set_completion_tokens(running.num_generation_tokens);
    }
    std::shared_ptr<TokenStream> stream = running.stream;
    if (out.finished) {
      running_.erase(it);
      // The engine has freed the request's blocks: Stats must say so before the client reads
      // the last event.
      PublishStats();
    }
    stream->Push(std::move(events), out.finished);
  }
}

void DecodeWorkerImpl::EndRunning(const std::string& request_id, const absl::Status& error) {
  auto it = running_.find(request_id);
  if (it == running_.end()) return;
  engine_->Abort(request_id);
  Running running = std::move(it->second);
  running_.erase(it);
  std::vector<tandem::v1::TokenEvent> events = FinalEvents(request_id, running, error);
  PublishStats();
  running.stream->Push(std::move(events), /*last=*/true);
}

std::vector<tandem::v1::TokenEvent> DecodeWorkerImpl::FinalEvents(const std::string& request_id,
                                                                  const Running& running,
                                                                  const absl::Status& error) {
  std::vector<tandem::v1::TokenEvent> events;
  for (size_t i = 0; i < running.finished.size(); ++i) {
    if (running.finished[i]) continue;
    tandem::v1::TokenEvent& event = events.emplace_back();
    event.set_request_id(request_id);
    event.set_index(static_cast<int>(i));
    event.set_finish_reason(tandem::v1::FINISH_REASON_ABORT);
  }
  if (events.empty()) {  // every sample had finished; the request's last event is still owed
    tandem::v1::TokenEvent& event = events.emplace_back();
    event.set_request_id(request_id);
  }
  tandem::v1::TokenEvent& last = events.back();
  last.mutable_usage()->set_prompt_tokens(running.num_prompt_tokens);
  last.mutable_usage()->set_completion_tokens(running.num_generation_tokens);
  if (!error.ok()) *last.mutable_error() = proto::ToProto(error);
  return events;
}

bool DecodeWorkerImpl::ParkRunning(const std::string& request_id) {
  auto it = running_.find(request_id);
  if (it == running_.end()) return false;
  absl::StatusOr<std::vector<engine::ParkedSample>> samples = engine_->Park(request_id);
  if (!samples.ok()) return false;
  Running running = std::move(it->second);
  running_.erase(it);
  Parked parked;
  parked.expires = absl::Now() + options_.handoff_ttl;
  tandem::v1::KvHandoff handoff;
  handoff.set_expires_unix_ms(absl::ToUnixMillis(parked.expires));
  handoff.set_worker_id(options_.worker_id);
  for (engine::ParkedSample& sample : *samples) {
    tandem::v1::KvHandoff::Sample* wire = handoff.add_samples();
    wire->set_index(sample.choice_index);
    wire->mutable_generated_token_ids()->Add(sample.state.generated.begin(),
                                             sample.state.generated.end());
    wire->set_sampler_state(proto::SamplerStateBytes(sample.state.rng_state));
    wire->set_num_kv_tokens(sample.state.num_kv_tokens);
    if (sample.state.num_kv_tokens > 0) {
      parked.samples[sample.choice_index] = {std::move(sample.state.blocks),
                                             sample.state.num_kv_tokens, false};
    }
  }
  if (!parked.samples.empty()) {
    core_->loop().SetDeadline(ParkedKey(request_id), parked.expires,
                              [this, request_id] { FreeParked(request_id, /*expired=*/true); });
    parked_[request_id] = std::move(parked);
  }
  std::vector<tandem::v1::TokenEvent> events = FinalEvents(
      request_id, running,
      absl::UnavailableError("the decode worker is draining; the request's KV is parked for "
                             "handoff"));
  *events.back().mutable_handoff() = std::move(handoff);
  PublishStats();
  running.stream->Push(std::move(events), /*last=*/true);
  return true;
}

tandem::v1::WorkerStats DecodeWorkerImpl::ComputeStats() const {
  const engine::EngineStats engine_stats = engine_->stats();
  tandem::v1::WorkerStats stats;
  stats.set_role(tandem::v1::WORKER_ROLE_DECODE);
  stats.set_worker_id(options_.worker_id);
  stats.set_running(engine_stats.running);
  stats.set_waiting(engine_stats.waiting);
  stats.set_kv_blocks_used(engine_stats.kv_blocks_used);
  stats.set_kv_blocks_total(engine_stats.kv_blocks_total);
  int reserved = 0;
  for (const auto& [id, reservation] : reservations_) reserved += reservation.num_blocks();
  stats.set_kv_blocks_reserved(reserved);
  stats.set_reservations(static_cast<int>(reservations_.size()));
  stats.set_preemptions_total(engine_stats.preemptions);
  stats.set_prefix_cache_queries_tokens(engine_stats.prefix_cache_queries_tokens);
  stats.set_prefix_cache_hits_tokens(engine_stats.prefix_cache_hits_tokens);
  stats.set_spec_proposed_tokens(engine_stats.spec_proposed_tokens);
  stats.set_spec_accepted_tokens(engine_stats.spec_accepted_tokens);
  stats.set_spec_verify_steps(engine_stats.spec_verify_steps);
  stats.set_backend_sampled_tokens(engine_stats.backend_sampled_tokens);
  stats.set_host_sampled_tokens(engine_stats.host_sampled_tokens);
  stats.set_graph_steps(engine_stats.graph_steps);
  stats.mutable_spec_proposed_by_position()->Add(engine_stats.spec_proposed_by_position.begin(),
                                                 engine_stats.spec_proposed_by_position.end());
  stats.mutable_spec_accepted_by_position()->Add(engine_stats.spec_accepted_by_position.begin(),
                                                 engine_stats.spec_accepted_by_position.end());
  return stats;
}

void DecodeWorkerImpl::PublishStats() {
  tandem::v1::WorkerStats stats = ComputeStats();
  int parked = 0;
  for (const auto& [id, p] : parked_) parked += static_cast<int>(p.samples.size());
  {
    std::lock_guard<std::mutex> lock(mu_);
    snapshot_ = std::move(stats);
    num_running_ = static_cast<int>(running_.size());
    num_parked_ = parked;
  }
  changed_.notify_all();
}

tandem::v1::WorkerStats DecodeWorkerImpl::Stats() const {
  // The snapshot is published after every change the engine loop makes (before any RPC that
  // made it is answered, and before a stream's last event is queued).
  std::lock_guard<std::mutex> lock(mu_);
  tandem::v1::WorkerStats stats = snapshot_;
  stats.set_draining(!core_->accepting());
  return stats;
}

void DecodeWorkerImpl::ShutdownImpl(absl::Duration grace, bool park) {
  if (core_ == nullptr) return;
  core_->Shutdown([&] {
    const bool handoff = park && options_.handoff_ttl > absl::ZeroDuration();
    {
      std::unique_lock<std::mutex> lock(mu_);
      changed_.wait_for(lock, absl::ToChronoNanoseconds(std::min(grace, absl::Hours(24))),
                        [&] { return num_running_ == 0; });
    }
    // Whatever still runs is parked for KV handoff, or ends with an error event; unstarted
    // reservations are freed.
    core_->loop().Call<bool>(
        [this, handoff] {
          std::vector<std::string> ids;
          for (const auto& [id, running] : running_) ids.push_back(id);
          for (const std::string& id : ids) {
            if (handoff && ParkRunning(id)) continue;
            EndRunning(id, ShuttingDown());
          }
          while (!reservations_.empty()) DropReservation(reservations_.begin());
          PublishStats();
          return true;
        },
        false);
    // The router moves parked samples with Handoff (the server still answers); each is freed
    // when handed off, cancelled or expired.
    std::unique_lock<std::mutex> lock(mu_);
    changed_.wait_for(
        lock,
        absl::ToChronoNanoseconds(options_.handoff_ttl + kHandoffTransferMax + absl::Seconds(1)),
        [&] { return num_parked_ == 0; });
  });
}

}  // namespace internal

absl::StatusOr<std::unique_ptr<DecodeWorker>> DecodeWorker::Create(DecodeWorkerOptions options) {
  auto worker = std::make_unique<internal::DecodeWorkerImpl>();
  TANDEM_RETURN_IF_ERROR(worker->Init(std::move(options)));
  return std::unique_ptr<DecodeWorker>(std::move(worker));
}

}  // namespace tandem::decode_worker
