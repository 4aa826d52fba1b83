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
  CacheComputedBlocks(*seq, 0);
  seq->status = SequenceStatus::kRunning;
  running_.push_back(seq);
}

void Scheduler::Preempt(Sequence* seq) {
  blocks_->Free(seq->block_table);
  seq->num_computed_tokens = 0;
  seq->draft_kv_tokens = 0;
  seq->draft_kv_stale_from = -1;
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
      seq->draft_tokens.clear();
      ++i;
      continue;
    }
    // Draft tokens ride along with a sequence's last real token while budget and free blocks
    // allow; they never cost a preemption.
    int drafts = 0;
    if (new_tokens == seq->num_uncomputed_tokens()) {
      drafts = std::min(static_cast<int>(seq->draft_tokens.size()), budget - new_tokens);
      if (drafts > 0 &&
          !blocks_->CanAppend(seq->block_table, seq->num_computed_tokens, new_tokens + drafts)) {
        drafts = 0;
      }
    }
    seq->draft_tokens.resize(drafts);
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
    const bool samples = new_tokens == seq->num_uncomputed_tokens();
    new_tokens += drafts;
    auto copy = blocks_->Append(seq->block_table, seq->num_computed_tokens, new_tokens);
    TANDEM_CHECK(copy.ok()) << copy.status();
    if (copy->first >= 0) step.block_copies.push_back(*copy);
    step.seqs.push_back({seq, new_tokens, samples, drafts});
    budget -= new_tokens;
    ++i;
  }

  // Admitting new work right after a preemption would only thrash the cache.
  for (size_t i = 0; !preempted && budget > 0 && i < waiting_.size() &&
                     static_cast<int>(running_.size()) < max_running_;) {
    Sequence* seq = waiting_[i];
    const int before = step.num_tokens;
    Admission admission = Admit(seq, budget, step);
    if (admission == Admission::kNoRoom) break;
    if (admission == Admission::kNotYet) {
      ++i;
      continue;
    }
    waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(i));
    seq->status = SequenceStatus::kRunning;
    running_.push_back(seq);
    budget -= step.num_tokens - before;
  }
  step.num_tokens = token_budget_ - budget;
  return step;
}

Scheduler::Admission Scheduler::Admit(Sequence* seq, int budget, SchedulerStep& step) {
  const int bs = blocks_->block_size();
  const int num_tokens = static_cast<int>(seq->tokens.size());
  const bool fresh = seq->num_computed_tokens == 0 && seq->block_table.empty();
  int shared_blocks = 0;  // leading blocks taken from the cache or the prompt source
  int shared_tokens = 0;
  const Sequence* source = seq->prompt_source;
  if (fresh && source != nullptr && num_tokens == seq->num_prompt_tokens &&
      source->status != SequenceStatus::kFinished) {
    const bool source_ready = source->status == SequenceStatus::kRunning &&
                              source->num_computed_tokens >= seq->num_prompt_tokens;
    if (!source_ready) return Admission::kNotYet;
    // Share the blocks of every prompt token but the last, which runs again for this sample's
    // logits: into a copy of the shared block when that block also holds earlier tokens
    // (copy-on-write, by Append), else into a block of its own.
    shared_tokens = seq->num_prompt_tokens - 1;
    shared_blocks = blocks_->BlocksFor(shared_tokens);
    seq->block_table = blocks_->Fork(source->block_table, shared_blocks);
  } else if (fresh && blocks_->prefix_caching()) {
    ExtendBlockHashes(seq->prefix_root, seq->tokens, bs, seq->block_hashes);
    // At least the last token is computed, so that the step yields its logits.
    const int max_blocks = (num_tokens - 1) / bs;
    shared_blocks = std::min(blocks_->CountCached(seq->block_hashes), max_blocks);
    shared_tokens = shared_blocks * bs;
    const int new_tokens = std::min(num_tokens - shared_tokens, budget);
    const int needed = blocks_->CountCachedFree(seq->block_hashes, shared_blocks) +
                       blocks_->BlocksFor(shared_tokens + new_tokens) - shared_blocks;
    if (needed > blocks_->num_free_blocks()) return Admission::kNoRoom;
    blocks_->AllocateCached(seq->block_table, seq->block_hashes, shared_blocks);
  }
  seq->num_computed_tokens = shared_tokens;
  const int new_tokens = std::min(seq->num_uncomputed_tokens(), budget);
  if (!blocks_->CanAppend(seq->block_table, seq->num_computed_tokens, new_tokens)) {
    blocks_->Free(seq->block_table);
    seq->num_computed_tokens = 0;
    return Admission::kNoRoom;
  }
  auto copy = blocks_->Append(seq->block_table, seq->num_computed_tokens, new_tokens);
  TANDEM_CHECK(copy.ok()) << copy.status();
  if (copy->first >= 0) step.block_copies.push_back(*copy);
  step.seqs.push_back({seq, new_tokens, new_tokens == seq->num_uncomputed_tokens()});
  step.num_tokens += new_tokens;
  // Counted once admitted (an admission refused for room is tried again later).
  if (fresh && (blocks_->prefix_caching() || source != nullptr)) {
    prefix_cache_queries_tokens_ += num_tokens;
    prefix_cache_hits_tokens_ += shared_tokens;
  }
  return Admission::kAdmitted;
}

void Scheduler::Commit(const SchedulerStep& step) {
  for (const ScheduledSequence& s : step.seqs) {
    Sequence& seq = *s.seq;
    const int first_block = seq.num_computed_tokens / blocks_->block_size();
    seq.num_computed_tokens += s.num_new_tokens - s.num_draft_tokens;
    // Name the blocks this step filled, so that later requests with this prefix share them.
    CacheComputedBlocks(seq, first_block);
  }
}

void Scheduler::AcceptDrafts(Sequence* seq, int accepted) {
  TANDEM_CHECK(accepted >= 0 &&
               seq->num_computed_tokens + accepted < static_cast<int>(seq->tokens.size()))
      << "accepted " << accepted << " draft tokens of a sequence of " << seq->tokens.size()
      << " tokens, " << seq->num_computed_tokens << " computed";
  const int first_block = seq->num_computed_tokens / blocks_->block_size();
  seq->num_computed_tokens += accepted;
  blocks_->Truncate(seq->block_table, seq->num_computed_tokens);
  CacheComputedBlocks(*seq, first_block);
  seq->draft_tokens.clear();
}

void Scheduler::CacheComputedBlocks(Sequence& seq, int first_block) {
  if (!blocks_->prefix_caching()) return;
  const int bs = blocks_->block_size();
  const int full = seq.num_computed_tokens / bs;
  if (full <= first_block) return;
  ExtendBlockHashes(seq.prefix_root, std::span<const int32_t>(seq.tokens).first(full * bs), bs,
                    seq.block_hashes);
  blocks_->CacheFullBlocks(seq.block_table, std::span<const uint64_t>(seq.block_hashes).first(full),
                           first_block);
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
