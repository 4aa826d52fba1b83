#include "tandem/engine/scheduler.h"

#include <algorithm>

#include "tandem/base/status_macros.h"

namespace tandem::engine {

Scheduler::Scheduler(const SchedulerOptions& options, BlockManager* blocks)
    : options_(options),
      blocks_(blocks),
      max_running_(options.max_num_seqs),
      token_budget_(options.max_num_batched_tokens) {
  TANDEM_CHECK(options.max_num_seqs > 0 && options.max_num_batched_tokens > 0);
}

void Scheduler::set_max_running(int n) { max_running_ = std::clamp(n, 1, options_.max_num_seqs); }

void Scheduler::set_token_budget(int tokens) {
  token_budget_ = std::clamp(tokens, 1, options_.max_num_batched_tokens);
}

void Scheduler::Add(Sequence* seq) {
  seq->status = SequenceStatus::kWaiting;
  if (options_.queue_policy == QueuePolicy::kShortestPromptFirst) {
    // Behind every sequence with as few tokens left (and every preempted one), before the rest.
    const int left = seq->num_uncomputed_tokens();
    auto it = std::find_if(waiting_.begin(), waiting_.end(), [&](const Sequence* other) {
      return other->num_preemptions == 0 && other->num_uncomputed_tokens() > left;
    });
    waiting_.insert(it, seq);
    return;
  }
  waiting_.push_back(seq);
}

void Scheduler::AddPrefilled(Sequence* seq) {
  TANDEM_CHECK(blocks_->BlocksFor(seq->num_computed_tokens) <=
               static_cast<int>(seq->block_table.size()));
  seq->status = SequenceStatus::kRunning;
  running_.push_back(seq);
}

void Scheduler::Preempt(Sequence* seq) {
  blocks_->Free(seq->block_table);
  seq->num_computed_tokens = 0;
  seq->status = SequenceStatus::kWaiting;
  ++seq->num_preemptions;
  ++num_preemptions_;
  waiting_.push_front(seq);
}

SchedulerStep Scheduler::Schedule() {
  SchedulerStep step;
  int budget = token_budget_;
  bool preempted = false;

  // Prefilled sequences join running_ directly (AddPrefilled), so it may hold more than
  // max_running_ (max_num_seqs, or the TPOT controller's lower cap): those beyond it wait for a
  // later step, in arrival order.
  for (size_t i = 0; i < running_.size() && budget > 0 &&
                     static_cast<int>(step.seqs.size()) < max_running_;) {
    Sequence* seq = running_[i];
    int new_tokens = std::min(seq->num_uncomputed_tokens(), budget);
    if (new_tokens <= 0) {
      ++i;
      continue;
    }
    // Make room by preempting the newest running sequences, possibly this one.
    bool self_preempted = false;
    while (!blocks_->CanAppend(seq->block_table, seq->num_computed_tokens, new_tokens)) {
      Sequence* victim = running_.back();
      running_.pop_back();
      Preempt(victim);
      preempted = true;
      if (victim == seq) {
        self_preempted = true;
        break;
      }
    }
    if (self_preempted) break;
    auto copy = blocks_->Append(seq->block_table, seq->num_computed_tokens, new_tokens);
    TANDEM_CHECK(copy.ok()) << copy.status();
    if (copy->first >= 0) step.block_copies.push_back(*copy);
    step.seqs.push_back({seq, new_tokens, new_tokens == seq->num_uncomputed_tokens()});
    budget -= new_tokens;
    ++i;
  }

  // Admitting new work right after a preemption would only thrash the cache.
  while (!preempted && budget > 0 && !waiting_.empty() &&
         static_cast<int>(running_.size()) < max_running_) {
    Sequence* seq = waiting_.front();
    int new_tokens = std::min(seq->num_uncomputed_tokens(), budget);
    if (!blocks_->CanAppend(seq->block_table, seq->num_computed_tokens, new_tokens)) break;
    auto copy = blocks_->Append(seq->block_table, seq->num_computed_tokens, new_tokens);
    TANDEM_CHECK(copy.ok()) << copy.status();
    if (copy->first >= 0) step.block_copies.push_back(*copy);
    waiting_.pop_front();
    seq->status = SequenceStatus::kRunning;
    running_.push_back(seq);
    step.seqs.push_back({seq, new_tokens, new_tokens == seq->num_uncomputed_tokens()});
    budget -= new_tokens;
  }
  step.num_tokens = token_budget_ - budget;
  return step;
}

void Scheduler::Commit(const SchedulerStep& step) {
  for (const ScheduledSequence& s : step.seqs) s.seq->num_computed_tokens += s.num_new_tokens;
}

void Scheduler::Finish(Sequence* seq, FinishReason reason) {
  if (auto it = std::find(running_.begin(), running_.end(), seq); it != running_.end()) {
    running_.erase(it);
  } else if (auto wit = std::find(waiting_.begin(), waiting_.end(), seq); wit != waiting_.end()) {
    waiting_.erase(wit);
  }
  seq->status = SequenceStatus::kFinished;
  seq->finish_reason = reason;
  if (reason != FinishReason::kPrefilled) blocks_->Free(seq->block_table);
}

void Scheduler::ReleaseBlocks(Sequence* seq) { blocks_->Free(seq->block_table); }

}  // namespace tandem::engine
