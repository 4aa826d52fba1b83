// The prefill worker's engine loop: steps, the layer-by-layer KV push into the decode worker's
// reserved blocks, and the answers once every page has landed.
#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "prefill_worker_impl.h"
#include "tandem/base/status_macros.h"
#include "tandem/proto/wire.h"

namespace tandem::prefill_worker::internal {

// ---------------------------------------------------------------------------------------------
// The engine loop

absl::Duration PrefillWorkerImpl::Iterate() {
  worker::EngineLoop& loop = core_->loop();
  if (loop.stopping()) {
    for (auto& [id, job] : jobs_) {
      Fail(*job, absl::UnavailableError(
                     absl::StrCat("request ", id, ": the prefill worker is shutting down")));
    }
  } else {
    ReachFollowers();
  }
  if (!loop.stopping() && engine_->has_unfinished()) {
    step_start_ = absl::Now();
    auto outputs = engine_->Step();
    if (!outputs.ok() && WaitForHeldBlocks()) {
      // The scheduler found no room because handed-off samples still hold blocks while their
      // pages are in flight; those are free now, so the next step goes on.
    } else if (!outputs.ok()) {
      for (auto& [id, job] : jobs_) {
        Fail(*job, absl::InternalError(absl::StrCat("request ", id, ": engine step failed: ",
                                                    std::string(outputs.status().message()))));
      }
    } else {
      AfterStep(*outputs);
    }
  }

  bool transfers = false;
  for (auto& [id, job] : jobs_) {
    PollHandles(*job, job->failing());
    ReleaseIdleHandoffs(*job);
    transfers = transfers || !job->handles.empty();
  }
  const bool force = loop.stopping() && absl::Now() - *loop.stop_since() > kShutdownDrain;
  std::vector<Answer> answers = FinishJobs(force);
  UpdateStats();
  for (Answer& answer : answers) {
    answer.call->Answer(std::move(answer.result));
    tandem::v1::CancelResponse found;
    found.set_found(true);
    for (UnaryCall<tandem::v1::CancelResponse>* cancel : answer.cancels) cancel->Answer(found);
  }
  if (!answers.empty()) idle_.notify_all();
  if (engine_->has_unfinished() && !loop.stopping()) return absl::ZeroDuration();
  if (transfers) return kTransferPoll;
  return awaiting_followers_.empty() ? absl::InfiniteDuration() : kFollowerConnectPoll;
}

void PrefillWorkerImpl::AddJob(std::unique_ptr<Job> job) {
  Job& ref = *job;
  jobs_.emplace(job->id, std::move(job));  // in_flight_ refuses duplicates before they get here
  if (core_->loop().stopping()) return Fail(ref, ShuttingDown());
  if (ref.call_cancelled->load()) {
    return Fail(ref, absl::CancelledError(
                         absl::StrCat("request ", ref.id, ": the Submit call was cancelled")));
  }
  core_->loop().SetDeadline(ref.id, ref.deadline, [this, &ref] {
    if (ref.failing()) return;
    Fail(ref, absl::DeadlineExceededError(absl::StrCat("request ", ref.id, " passed its deadline (",
                                                       absl::FormatTime(ref.deadline), ")")));
  });
  if (ref.followers_push() && !FollowersReach(ref)) {
    // Its first step would wait for a follower's connect: the followers connect first, in the
    // background, and the steps of other requests go on meanwhile.
    awaiting_followers_.push_back(ref.id);
    last_reach_ = absl::InfinitePast();
    return;
  }
  AddToEngine(ref);
}

void PrefillWorkerImpl::AddToEngine(Job& job) {
  absl::Status added = engine_->AddRequest(job.request);
  if (!added.ok()) {
    Fail(job, added);
  } else {
    job.admitted = true;
  }
}

bool PrefillWorkerImpl::FollowersReach(const Job& job) const {
  return std::all_of(job.follower_addresses.begin(), job.follower_addresses.end(),
                     [this](const std::string& a) { return followers_reached_.count(a) > 0; });
}

void PrefillWorkerImpl::ReachFollowers() {
  if (awaiting_followers_.empty()) return;
  const absl::Time now = absl::Now();
  if (now - last_reach_ < kFollowerConnectPoll) return;
  last_reach_ = now;
  // One destination per set of follower addresses, named by them.
  const auto key = [](const Job& job) { return absl::StrJoin(job.follower_addresses, " "); };
  std::vector<Job*> waiting;
  tandem::v1::KvPushOrders orders;
  orders.set_connect_only(true);
  std::set<std::string> asked;
  std::set<Job*> seen;
  for (const std::string& id : awaiting_followers_) {
    // The id may have ended and come back since (a new Submit): its job is listed once, and
    // one admitted already is not admitted again.
    auto it = jobs_.find(id);
    if (it == jobs_.end() || it->second->failing() || it->second->admitted) continue;
    Job& job = *it->second;
    if (!seen.insert(&job).second) continue;
    waiting.push_back(&job);
    if (FollowersReach(job) || !asked.insert(key(job)).second) continue;
    tandem::v1::KvPushOrders::Destination* d = orders.add_destinations();
    d->set_request_id(key(job));
    *d->mutable_endpoint() = job.endpoint;
    d->set_deadline_unix_ms(absl::ToUnixMillis(std::min(job.deadline, job.transfer_deadline)));
  }
  std::map<std::string, absl::Status> failed;
  std::set<std::string> connecting;
  if (orders.destinations_size() > 0) {
    absl::StatusOr<std::vector<std::string>> reports =
        engine_->TensorParallelSideChannel(orders.SerializeAsString());
    if (!reports.ok()) {
      for (const std::string& k : asked) failed[k] = reports.status();
    }
    for (size_t r = 0; reports.ok() && r < reports->size(); ++r) {
      tandem::v1::KvPushReport report;
      if (!report.ParseFromString((*reports)[r])) {
        for (const std::string& k : asked) {
          failed.emplace(k, absl::UnavailableError(absl::StrCat(
                                "tensor-parallel rank ", r + 1, " sent an unreadable report")));
        }
        continue;
      }
      for (const tandem::v1::KvPushReport::Failure& f : report.failures()) {
        failed.emplace(f.request_id(),
                       absl::Status(static_cast<absl::StatusCode>(f.code()), f.message()));
      }
      connecting.insert(report.connecting().begin(), report.connecting().end());
    }
  }
  awaiting_followers_.clear();
  for (Job* job : waiting) {
    const std::string k = key(*job);
    if (auto f = failed.find(k); f != failed.end()) {
      Fail(*job, absl::Status(f->second.code(), absl::StrCat("request ", job->id,
                                                             ": cannot reach the decode worker: ",
                                                             f->second.message())));
    } else if (asked.count(k) > 0 && connecting.count(k) == 0) {
      followers_reached_.insert(job->follower_addresses.begin(), job->follower_addresses.end());
    }
    if (job->failing()) continue;
    if (FollowersReach(*job)) {
      AddToEngine(*job);
    } else {
      awaiting_followers_.push_back(job->id);
    }
  }
}

void PrefillWorkerImpl::CancelJob(const std::string& id, uint64_t serial, absl::Status reason,
                                  UnaryCall<tandem::v1::CancelResponse>* waiter) {
  auto it = jobs_.find(id);
  if (it == jobs_.end() || (serial != 0 && it->second->serial != serial)) {
    if (waiter != nullptr) {
      tandem::v1::CancelResponse found;
      found.set_found(true);  // it was in flight when asked, and is over now
      waiter->Answer(found);
    }
    return;
  }
  Fail(*it->second, std::move(reason));
  if (waiter != nullptr) it->second->cancels.push_back(waiter);
}

void PrefillWorkerImpl::Fail(Job& job, absl::Status status) {
  if (job.failure.ok()) job.failure = std::move(status);
}
std::pair<int, int> PrefillWorkerImpl::PushRange(const Job& job, const KvWritten& w) const {
  // What the decode worker lacks of what this sample holds now: the tokens this step wrote,
  // and, the first time or when this worker's prefix cache moved the sample ahead of what was
  // pushed (a recomputation after preemption), the cached or shared tokens before them.
  const int end = std::min(w.end, job.prompt_len);
  const int begin =
      std::max(job.dst_cached_tokens, std::min(w.begin, job.computed[w.choice_index]));
  return {begin, end};
}

void PrefillWorkerImpl::OnLayerWritten(int layer, std::span<const KvWritten> written) {
  // One transfer per request, destination rank and layer, with a range per (K or V, block)
  // piece of its tokens (per token when the two caches hold different heads).
  std::map<std::pair<Job*, size_t>, std::vector<kvtransfer::Range>> posts;
  for (const KvWritten& w : written) {
    auto it = jobs_.find(w.request_id);
    if (it == jobs_.end()) continue;
    Job& job = *it->second;
    if (job.failing() || w.choice_index < 0 || w.choice_index >= job.n) continue;
    if (layer == 0) {
      job.scheduled = std::min(job.scheduled, step_start_);
      if (w.begin < job.computed[w.choice_index]) {
        // The sample was preempted and is being recomputed: what it posts now must land after
        // what it posted before, so let the earlier transfers finish first (a follower's have:
        // it waits for its pushes at the end of every step).
        for (auto& handle : job.handles) {
          absl::Status status = handle->Wait();
          if (!status.ok()) HandleFailed(job, status);
        }
        job.handles.clear();
        job.last_done = absl::Now();
        if (job.failing()) continue;
      }
    }
    const int c = w.choice_index;
    if (layer == 0 && !job.started[c]) {
      job.started[c] = true;
      job.cached_tokens += w.begin;
    }
    if (job.embed) {  // its KV stays here: nothing to push
      if (layer == num_layers_ - 1) job.computed[c] = std::min(w.end, job.prompt_len);
      continue;
    }
    const auto [begin, end] = PushRange(job, w);
    const std::span<const int32_t> dst_blocks(
        job.dst_blocks.data() + static_cast<size_t>(c) * job.blocks_per_choice,
        static_cast<size_t>(job.blocks_per_choice));
    for (const engine::KvHeadRun& run : job.runs) {
      if (run.src_rank != 0) {
        // A follower rank pushes these heads (FollowerOrders); count its bytes.
        if (end > begin) {
          job.bytes += worker::RunBytes(group_layouts_[run.src_rank], run, end - begin);
        }
        continue;
      }
      Job::Destination& dst = job.dsts[run.dst_rank];
      // The decode worker's cache: one region, or one region per layer.
      const int dst_layer = dst.descriptors.size() > 1 ? 0 : layer;
      worker::AppendTokenRanges(cache_layout_, dst.layout, run, layer, dst_layer, begin, end,
                                /*first_block=*/0, *w.blocks, dst_blocks,
                                posts[{&job, static_cast<size_t>(run.dst_rank)}]);
    }
    if (layer == num_layers_ - 1) job.computed[c] = end;
  }
  for (auto& [key, ranges] : posts) {
    auto [job, dst] = key;
    if (!ranges.empty() && !job->failing()) Post(*job, dst, layer, std::move(ranges));
  }
}

std::string PrefillWorkerImpl::FollowerOrders(std::span<const KvWritten> written) {
  tandem::v1::KvPushOrders orders;
  std::set<Job*> described;
  for (const KvWritten& w : written) {
    auto it = jobs_.find(w.request_id);
    if (it == jobs_.end()) continue;
    Job& job = *it->second;
    if (job.failing() || job.embed || w.choice_index < 0 || w.choice_index >= job.n) continue;
    if (!job.followers_push()) continue;  // rank 0 sends every head this job needs
    const auto [begin, end] = PushRange(job, w);
    if (begin >= end) continue;
    if (described.insert(&job).second) {
      tandem::v1::KvPushOrders::Destination* d = orders.add_destinations();
      d->set_request_id(job.id);
      *d->mutable_endpoint() = job.endpoint;
      d->set_deadline_unix_ms(absl::ToUnixMillis(job.transfer_deadline));
    }
    tandem::v1::KvPushOrders::Write* out = orders.add_writes();
    out->set_request_id(job.id);
    out->set_begin(begin);
    out->set_end(end);
    const int bs = cache_layout_.block_size;
    const size_t dst_base = static_cast<size_t>(w.choice_index) * job.blocks_per_choice;
    for (int logical = begin / bs; logical <= (end - 1) / bs; ++logical) {
      if (logical >= static_cast<int>(w.blocks->size()) || logical >= job.blocks_per_choice) break;
      out->add_src_blocks((*w.blocks)[logical]);
      out->add_dst_blocks(job.dst_blocks[dst_base + logical]);
    }
  }
  if (orders.writes_size() == 0) return std::string();
  return orders.SerializeAsString();
}

void PrefillWorkerImpl::FollowerReports(std::span<const std::string> reports) {
  for (size_t r = 0; r < reports.size(); ++r) {
    tandem::v1::KvPushReport report;
    if (!report.ParseFromString(reports[r])) {
      // Cut short (too many failures to fit): every job of the step may have failed.
      followers_reached_.clear();
      for (auto& [id, job] : jobs_) {
        if (!job->embed) {
          HandleFailed(*job, absl::UnavailableError(absl::StrCat(
                                 "tensor-parallel rank ", r + 1, " sent an unreadable report")));
        }
      }
      continue;
    }
    for (const tandem::v1::KvPushReport::Failure& f : report.failures()) {
      auto it = jobs_.find(f.request_id());
      if (it == jobs_.end()) continue;
      // The follower may have dropped its connection: the next request going there has the
      // followers reach it first.
      for (const std::string& address : it->second->follower_addresses) {
        followers_reached_.erase(address);
      }
      HandleFailed(*it->second,
                   absl::Status(static_cast<absl::StatusCode>(f.code()), f.message()));
    }
  }
}

void PrefillWorkerImpl::Post(Job& job, size_t dst_rank, int layer,
                             std::vector<kvtransfer::Range> ranges) {
  Job::Destination& dst = job.dsts[dst_rank];
  const std::string& descriptor =
      dst.descriptors.size() > 1 ? dst.descriptors[layer] : dst.descriptors[0];
  uint64_t bytes = 0;
  for (const kvtransfer::Range& r : ranges) bytes += r.bytes;
  const absl::Time posted = absl::Now();
  auto handle = core_->kv().Push(dst.peer, descriptor, ranges, job.transfer_deadline);
  // NotFound: another request dropped the cached connection after it failed.
  auto gone = [](const absl::Status& s) {
    return s.code() == absl::StatusCode::kUnavailable || s.code() == absl::StatusCode::kNotFound;
  };
  if (!handle.ok() && gone(handle.status()) && !dst.reconnected) {
    // The cached connection is gone (e.g. closed after an earlier failure): connect once more.
    dst.reconnected = true;
    auto peer =
        core_->kv().Peer(dst.address, std::min(job.deadline, absl::Now() + kConnectTimeout),
                         /*fresh=*/true);
    if (!peer.ok()) {
      Fail(job, TransferFailure(job.id, peer.status()));
      return;
    }
    dst.peer = *peer;
    handle = core_->kv().Push(dst.peer, descriptor, std::move(ranges), job.transfer_deadline);
  }
  if (!handle.ok()) {
    if (handle.status().code() == absl::StatusCode::kUnavailable) {
      core_->kv().DropPeer(dst.address, dst.peer);
    }
    Fail(job, TransferFailure(job.id, handle.status()));
    return;
  }
  job.first_post = std::min(job.first_post, posted);
  job.bytes += bytes;
  job.handles.push_back(std::move(handle).value());
  PollHandles(job, false);
}

void PrefillWorkerImpl::PollHandles(Job& job, bool all) {
  for (auto it = job.handles.begin(); it != job.handles.end();) {
    std::optional<absl::Status> status = (*it)->Poll();
    if (!status.has_value()) {
      if (!all) return;
      ++it;
      continue;
    }
    if (status->ok()) {
      job.last_done = absl::Now();
    } else {
      HandleFailed(job, *status);
    }
    it = job.handles.erase(it);
  }
}

void PrefillWorkerImpl::ReleaseIdleHandoffs(Job& job) {
  if (!job.handles.empty()) return;
  for (PrefillHandoff& handoff : job.handoffs) {
    if (handoff.blocks.empty()) continue;
    engine_->ReleaseHandoff(handoff);
    handoff.blocks.clear();
  }
}

bool PrefillWorkerImpl::WaitForHeldBlocks() {
  bool held = false;
  for (auto& [id, job] : jobs_) {
    const bool holds = std::any_of(job->handoffs.begin(), job->handoffs.end(),
                                   [](const PrefillHandoff& h) { return !h.blocks.empty(); });
    if (!holds) continue;
    held = true;
    for (auto& handle : job->handles) {
      absl::Status status = handle->Wait();  // bounded by the transfer deadline
      if (status.ok()) {
        job->last_done = absl::Now();
      } else {
        HandleFailed(*job, status);
      }
    }
    job->handles.clear();
    ReleaseIdleHandoffs(*job);
  }
  return held;
}

void PrefillWorkerImpl::HandleFailed(Job& job, const absl::Status& status) {
  // The connection is gone, or a transfer outlived the reservation and may still be landing in
  // blocks the decode worker is about to reuse: closing the connection stops it (and a later
  // request connects again).
  if (status.code() == absl::StatusCode::kUnavailable ||
      status.code() == absl::StatusCode::kCancelled ||
      status.code() == absl::StatusCode::kDeadlineExceeded) {
    for (const Job::Destination& dst : job.dsts) {
      if (dst.peer != 0) core_->kv().DropPeer(dst.address, dst.peer);
    }
  }
  Fail(job, TransferFailure(job.id, status));
}

void PrefillWorkerImpl::AfterStep(const std::vector<engine::RequestOutput>& outputs) {
  const absl::Time now = absl::Now();
  for (PrefillHandoff& handoff : engine_->TakeHandoffs()) {
    auto it = jobs_.find(handoff.request_id);
    if (it == jobs_.end()) {
      engine_->ReleaseHandoff(handoff);  // not ours (cannot happen): never leak its blocks
      continue;
    }
    Job& job = *it->second;
    job.sample_done[handoff.choice_index] = true;
    job.handoffs.push_back(std::move(handoff));
  }
  // A sample whose first token already ends it (EOS, a stop id or string, max_tokens 1) is
  // finished by the engine instead of handed off; its blocks are freed and the decode worker
  // only needs the token to finish it the same way.
  for (const engine::RequestOutput& out : outputs) {
    auto it = jobs_.find(out.request_id);
    if (it == jobs_.end()) continue;
    Job& job = *it->second;
    if (job.embed) {
      // An embedding's one output carries its vector; the engine has already freed its blocks.
      if (!out.embedding.empty() && !job.sample_done[0]) {
        job.sample_done[0] = true;
        job.computed[0] = job.prompt_len;
        job.embedding = out.embedding;
      }
      continue;
    }
    for (const engine::ChoiceDelta& delta : out.choices) {
      if (delta.finish_reason == engine::FinishReason::kNone ||
          delta.finish_reason == engine::FinishReason::kPrefilled || delta.token_ids.empty() ||
          delta.index < 0 || delta.index >= job.n || job.sample_done[delta.index]) {
        continue;
      }
      PrefillHandoff handoff;
      handoff.request_id = job.id;
      handoff.choice_index = delta.index;
      handoff.first_token = delta.token_ids[0];
      if (!delta.logprobs.empty()) handoff.first_logprob = delta.logprobs[0];
      if (!delta.top_logprobs.empty()) handoff.first_top_logprobs = delta.top_logprobs[0];
      job.sample_done[delta.index] = true;
      job.handoffs.push_back(std::move(handoff));
    }
  }
  for (auto& [id, job] : jobs_) {
    if (job->all_sampled() && job->compute_done == absl::InfiniteFuture()) job->compute_done = now;
  }
}

std::vector<Answer> PrefillWorkerImpl::FinishJobs(bool force) {
  std::vector<Answer> answers;
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    Job& job = *it->second;
    const bool ready =
        job.failing() ? job.handles.empty() || force : job.all_sampled() && job.handles.empty();
    if (!ready) {
      ++it;
      continue;
    }
    answers.push_back(Complete(job));
    it = jobs_.erase(it);
  }
  return answers;
}

Answer PrefillWorkerImpl::Complete(Job& job) {
  core_->loop().ClearDeadline(job.id);
  // Nothing reads the request's blocks any more (or, forced at shutdown, destroying the agent
  // stops what still does before the cache goes away): free them.
  for (auto& handle : job.handles) abandoned_.push_back(std::move(handle));
  job.handles.clear();
  if (job.admitted) engine_->Abort(job.id);  // no-op once every sample is handed off
  for (const PrefillHandoff& handoff : job.handoffs) {
    if (!handoff.blocks.empty()) engine_->ReleaseHandoff(handoff);
  }
  Answer answer{job.call, tandem::v1::SubmitResponse(), std::move(job.cancels)};
  if (job.failing()) {
    answer.result = job.failure;
  } else {
    std::sort(job.handoffs.begin(), job.handoffs.end(),
              [](const PrefillHandoff& a, const PrefillHandoff& b) {
                return a.choice_index < b.choice_index;
              });
    tandem::v1::SubmitResponse response;
    for (const PrefillHandoff& handoff : job.handoffs) {
      *response.add_choices() = proto::ToProto(handoff.choice_index, handoff);
    }
    response.mutable_embedding()->Add(job.embedding.begin(), job.embedding.end());
    response.set_num_prompt_tokens(job.prompt_len);
    response.set_kv_transfer_bytes(job.bytes);
    response.set_num_cached_tokens(job.cached_tokens);
    double transfer = 0, exposed = 0;
    if (job.bytes > 0 && job.first_post != absl::InfiniteFuture()) {
      transfer =
          absl::ToDoubleSeconds(std::max(job.last_done - job.first_post, absl::ZeroDuration()));
      exposed =
          absl::ToDoubleSeconds(std::max(job.last_done - job.compute_done, absl::ZeroDuration()));
    }
    const absl::Time scheduled = std::min(job.scheduled, job.compute_done);
    response.set_kv_transfer_seconds(transfer);
    response.set_kv_transfer_exposed_seconds(exposed);
    response.set_prefill_seconds(absl::ToDoubleSeconds(job.compute_done - scheduled));
    response.set_queue_seconds(
        absl::ToDoubleSeconds(std::max(scheduled - job.received, absl::ZeroDuration())));
    metrics_.prompt_tokens.Increment(job.prompt_len);
    metrics_.transfer_bytes.Increment(static_cast<double>(job.bytes));
    metrics_.transfer_seconds.Increment(transfer);
    metrics_.exposed_seconds.Increment(exposed);
    metrics_.prefill_seconds.Observe(response.prefill_seconds());
    answer.result = std::move(response);
  }
  metrics_.Requests(answer.result.status().code()).Increment();
  {
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_.erase(job.id);
  }
  return answer;
}
void PrefillWorkerImpl::UpdateStats() {
  if (!engine_) return;
  const engine::EngineStats engine_stats = engine_->stats();
  int64_t queued = 0;
  for (const auto& [id, job] : jobs_) {
    if (job->failing()) continue;
    for (int c = 0; c < job->n; ++c) {
      if (!job->sample_done[c]) queued += job->prompt_len - job->computed[c];
    }
  }
  metrics_.engine.Record(engine_stats);
  metrics_.queued_tokens.Set(static_cast<double>(queued));
  metrics_.token_budget.Set(engine_stats.token_budget);
  std::lock_guard<std::mutex> lock(mu_);
  stats_.set_queued_prefill_tokens(queued);
  stats_.set_running(engine_stats.running);
  stats_.set_waiting(engine_stats.waiting);
  stats_.set_kv_blocks_used(engine_stats.kv_blocks_used);
  stats_.set_kv_blocks_total(engine_stats.kv_blocks_total);
  stats_.set_preemptions_total(engine_stats.preemptions);
  stats_.set_backend_sampled_tokens(engine_stats.backend_sampled_tokens);
  stats_.set_host_sampled_tokens(engine_stats.host_sampled_tokens);
  stats_.set_graph_steps(engine_stats.graph_steps);
  stats_.set_prefix_cache_queries_tokens(engine_stats.prefix_cache_queries_tokens);
  stats_.set_prefix_cache_hits_tokens(engine_stats.prefix_cache_hits_tokens);
}

}  // namespace tandem::prefill_worker::internal
